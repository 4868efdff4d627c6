"""Tasks whose answers a program checks: the prompts, the answers, the checker and a held-out set.

The course's last stage trains against a reward; the simplest honest reward is a program that checks an
answer. A task here writes its own data, so a learner needs nothing else to watch a reward go up:

    addition   "37+58="  ->  "95"   (operands of up to `digits` digits; one line each)

The prompts are split once and for all by the operands, not by a random draw: a held-out prompt is never in
the training prompts, whatever seed or count a run asks for, so "held-out accuracy" means the same thing in
every run. `reward` has the signature TRL gives a reward function (`prompts, completions, **columns` -> one
float per completion), so the same function serves GRPO here and in TRL.
"""

from __future__ import annotations

import random
import re
import zlib
from dataclasses import dataclass, field

from ..errors import ConfigError

SPLITS = ("train", "held-out")


@dataclass(frozen=True)
class Addition:
    """Add two whole numbers: the prompt "a+b=", the answer the sum's digits, then a newline.

    Args:
        digits: the most digits an operand has (1-4).
        held_out_share: the share of the operand pairs kept out of training, one in round(1 / share).
    """

    digits: int = 2
    held_out_share: float = 0.1
    name: str = field(default="addition", init=False)
    end: str = field(default="\n", init=False)  # what closes an answer: the checker reads up to it

    def __post_init__(self) -> None:
        if not 1 <= self.digits <= 4:
            raise ConfigError(f"addition: digits must be 1-4, got {self.digits}")
        if not 0 < self.held_out_share < 0.5:
            raise ConfigError(f"addition: held_out_share must be above 0 and below 0.5, got {self.held_out_share}")

    @property
    def largest(self) -> int:
        return 10**self.digits - 1

    def split_of(self, a: int, b: int) -> str:
        """The split an operand pair belongs to, fixed by the pair: a CRC-32 of "a+b", so the held-out pairs
        are spread over the whole range and over every answer. (A sum of multiples of the operands modulo
        ten, as this was, holds out exactly the pairs whose sum ends in 0: no training answer ended in 0,
        and no model could answer a held-out prompt.)"""
        every = round(1 / self.held_out_share)
        return "held-out" if zlib.crc32(f"{a}+{b}".encode()) % every == 0 else "train"

    def pairs(self, split: str, n: int, seed: int = 0) -> list[tuple[int, int]]:
        """n operand pairs of `split`, drawn with `seed` (repeats allowed once a split is exhausted)."""
        if split not in SPLITS:
            raise ConfigError(f"addition: no split {split!r} (one of {', '.join(SPLITS)})")
        rng = random.Random(f"{self.name}-{self.digits}-{split}-{seed}")
        out: list[tuple[int, int]] = []
        while len(out) < n:
            a, b = rng.randint(0, self.largest), rng.randint(0, self.largest)
            if self.split_of(a, b) == split:
                out.append((a, b))
        return out

    def rows(self, split: str, n: int, seed: int = 0) -> list[dict[str, str]]:
        """n prompt-only rows of `split` in TRL's format: {"prompt": "a+b=", "answer": "sum"}."""
        return [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in self.pairs(split, n, seed)]

    def text(self, n: int, seed: int = 0) -> str:
        """n worked examples of the train split as plain lines ("37+58=95"), for pretraining or SFT."""
        return "".join(row["prompt"] + row["answer"] + self.end for row in self.rows("train", n, seed))

    def answer_of(self, completion: str) -> str:
        """What a completion answers: its text up to the first newline, spaces around it removed."""
        return completion.split(self.end, 1)[0].strip()

    def correct(self, completion: str, answer: str) -> bool:
        """Whether a completion's answer is `answer`, digit for digit (no leading zeros, nothing else)."""
        return re.fullmatch(r"0|[1-9][0-9]*", self.answer_of(completion)) is not None and \
            self.answer_of(completion) == answer

    def reward(self, prompts: list, completions: list, answer: list[str], **columns) -> list[float]:
        """1.0 for each completion whose answer is right, else 0.0 (TRL's reward-function signature: the
        `answer` column of the rows reaches it by name)."""
        return [float(self.correct(c if isinstance(c, str) else _message_text(c), a))
                for c, a in zip(completions, answer)]


def _message_text(completion: list[dict]) -> str:
    """A conversational completion's text (TRL passes a list of messages; the assistant's content)."""
    return "".join(m.get("content", "") for m in completion if isinstance(m, dict))


TASKS = {"addition": Addition}


def task(name: str, **settings) -> Addition:
    """The built-in task called `name`, with `settings` (e.g. digits=3).

    Raises:
        ConfigError: no such task, or settings it does not take.
    """
    if name not in TASKS:
        raise ConfigError(f"no task {name!r}: the built-in tasks are {', '.join(sorted(TASKS))}")
    try:
        return TASKS[name](**settings)
    except TypeError as e:
        raise ConfigError(f"task {name}: {e}") from None
