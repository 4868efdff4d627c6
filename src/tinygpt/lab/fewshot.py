"""Few-shot prompting, measured: k worked examples plus a query in the prompt, accuracy per k.

The lesson claims in-context learning emerges from the CLM objective: the model infers a task
from examples in its context, with no gradient update. This module makes that a number.

Task files are JSON Lines (UTF-8), one object per line:

    {"template": "{input}: {output}", "separator": "\\n", "prefix": "", "name": "colors", "chance": 0.125}
    {"input": "q", "output": "blue"}
    {"input": "x", "output": "red", "group": "episode-7", "choices": ["red", "blue", "green"]}

- The optional first line holds the settings: `template` (where the input and the answer go;
  default "{input} -> {output}"), `separator` between examples (default a newline), `prefix`
  (text before the first example, e.g. an instruction), `name`, and `chance` (the accuracy of
  guessing, drawn on plots).
- Every other line is an example: `input` and `output` (strings); optional `group` (worked
  examples for a query are drawn from the other examples of its group, so a file can hold many
  small tasks, each with its own mapping; without groups the whole file is one pool) and
  `choices` (the candidate answers for likelihood scoring).

A k-shot prompt is the prefix, k worked examples from the query's pool (a seeded random order per
query, so the k-shot examples are the (k-1)-shot ones plus one more), each rendered with the
template and followed by the separator, then the query rendered up to its answer. The query
itself is never among its own examples. Whitespace at the end of that prompt moves into the
answer, as lm-evaluation-harness does, so "q: " + "blue" is scored as "q:" + " blue" (a BPE
tokenizer puts the space in front of the word).

Scoring:
- "generate" (default): greedy decoding until the text that follows an answer (the rest of the
  template, then the separator) or the longest answer's length; correct when the answer, with
  surrounding whitespace stripped, equals `output` exactly.
- "likelihood": each candidate answer (the example's `choices`, else every distinct output in the
  task) followed by the text that ends an answer is scored by the sum of its tokens' log
  probabilities given the prompt; correct when `output` scores highest (ties go to the earlier
  candidate). This is lm-evaluation-harness's multiple-choice accuracy, unnormalized.

A prompt longer than the model's context is seen through its last block_size tokens (the first
examples fall out); the report counts such prompts.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch

from ..errors import ConfigError
from ..fileio import parse_json
from ..generate import StopText, generate_stream
from ..tokenizer.incremental import IncrementalDecoder

DEFAULT_TEMPLATE = "{input} -> {output}"
SETTINGS = ("template", "separator", "prefix", "name", "chance")
EXAMPLE_KEYS = ("input", "output", "group", "choices")
SCORINGS = ("generate", "likelihood")


@dataclass(frozen=True)
class Example:
    input: str
    output: str
    group: str | None = None
    choices: tuple[str, ...] | None = None


@dataclass
class Task:
    """Examples and how they are written into a prompt. See the module docstring for the format."""

    examples: list[Example]
    template: str = DEFAULT_TEMPLATE
    separator: str = "\n"
    prefix: str = ""
    name: str = "task"
    chance: float | None = None

    def __post_init__(self) -> None:
        t = self.template
        if t.count("{input}") != 1 or t.count("{output}") != 1 or t.index("{input}") > t.index("{output}"):
            raise ConfigError(f"template must hold {{input}} then {{output}}, once each: got {t!r}")
        if not self.examples:
            raise ConfigError(f"{self.name}: the task has no examples")

    @property
    def answer_end(self) -> str:
        """The text that follows an answer: the rest of the template, then the separator."""
        return self.template.split("{output}", 1)[1] + self.separator

    def render(self, example: Example) -> str:
        """One worked example, answer included."""
        before, after = self.template.split("{output}", 1)
        return before.replace("{input}", example.input) + example.output + after.replace("{input}", example.input)

    def query(self, example: Example) -> str:
        """The query: the template up to where the answer goes."""
        return self.template.split("{output}", 1)[0].replace("{input}", example.input)

    def pools(self) -> list[list[int]]:
        """For each example, the indices of the examples that may serve as its worked examples."""
        groups: dict[str | None, list[int]] = {}
        for i, ex in enumerate(self.examples):
            groups.setdefault(ex.group, []).append(i)
        return [[j for j in groups[ex.group] if j != i] for i, ex in enumerate(self.examples)]


def build_prompt(task: Task, query: Example, shots: Sequence[Example]) -> str:
    """The k-shot prompt: prefix, each worked example and a separator, then the query up to its answer."""
    return task.prefix + "".join(task.render(s) + task.separator for s in shots) + task.query(query)


def _split_trailing_space(prompt: str) -> tuple[str, str]:
    stripped = prompt.rstrip()
    return stripped, prompt[len(stripped) :]


# ---------------------------------------------------------------------------------------------
# Task files


def read_task(path: str | os.PathLike) -> Task:
    """Read a task file (JSON Lines, see the module docstring).

    Raises:
        ConfigError: a missing file, a line that is not JSON or not a task line, a bad template.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: no such task file")
    settings: dict = {}
    examples: list[Example] = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.start})") from None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}, line {number}"
        try:
            record = parse_json(line)
        except ValueError as e:
            raise ConfigError(f"{where}: not valid JSON ({e})") from None
        if not isinstance(record, dict):
            raise ConfigError(f"{where}: expected a JSON object")
        if "input" not in record and "output" not in record:
            if examples or settings:
                raise ConfigError(f"{where}: the settings line must come first and only once")
            unknown = sorted(set(record) - set(SETTINGS))
            if unknown:
                raise ConfigError(f"{where}: unknown setting(s) {', '.join(unknown)}; known: {', '.join(SETTINGS)}")
            settings = record
            continue
        examples.append(_example(record, where))
    for key in ("template", "separator", "prefix", "name"):
        if key in settings and not isinstance(settings[key], str):
            raise ConfigError(f"{path}: setting {key!r} must be a string")
    chance = settings.get("chance")
    if chance is not None and not (isinstance(chance, (int, float)) and 0 <= chance <= 1):
        raise ConfigError(f"{path}: setting 'chance' must be a number in [0, 1]")
    if not examples:
        raise ConfigError(f"{path}: no examples (lines with \"input\" and \"output\")")
    return Task(examples, **{"name": path.stem, **settings})


def _example(record: dict, where: str) -> Example:
    unknown = sorted(set(record) - set(EXAMPLE_KEYS))
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}; an example has {', '.join(EXAMPLE_KEYS)}")
    for key in ("input", "output"):
        if not isinstance(record.get(key), str):
            raise ConfigError(f"{where}: {key!r} must be a string")
    group = record.get("group")
    if group is not None and not isinstance(group, (str, int)):
        raise ConfigError(f"{where}: 'group' must be a string or an integer")
    choices = record.get("choices")
    if choices is not None:
        if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
            raise ConfigError(f"{where}: 'choices' must be a non-empty list of strings")
        if record["output"] not in choices:
            raise ConfigError(f"{where}: the output {record['output']!r} is not among its choices")
        choices = tuple(choices)
    return Example(record["input"], record["output"], None if group is None else str(group), choices)


def write_task(task: Task, path: str | os.PathLike) -> None:
    """Write a task as a task file that `read_task` reads back."""
    from ..fileio import atomic_write

    settings = {"name": task.name, "template": task.template, "separator": task.separator, "prefix": task.prefix}
    if task.chance is not None:
        settings["chance"] = task.chance
    lines = [json.dumps(settings, ensure_ascii=False)]
    for ex in task.examples:
        record: dict = {"input": ex.input, "output": ex.output}
        if ex.group is not None:
            record["group"] = ex.group
        if ex.choices is not None:
            record["choices"] = list(ex.choices)
        lines.append(json.dumps(record, ensure_ascii=False))
    text = "\n".join(lines) + "\n"
    atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


# ---------------------------------------------------------------------------------------------
# The synthetic in-context-learning task


SYNTHETIC_KEYS = "abcdefghijklmnopqrstuvwxyz"
SYNTHETIC_VALUES = "0123456789"
# "q7": a letter and its digit. The answer follows the key directly, so reading it off an earlier
# example is the pattern the lesson's attention learns first: find the last time this token came,
# copy what came after it (an induction head).
SYNTHETIC_TEMPLATE = "{input}{output}"
SYNTHETIC_SEPARATOR = " "
SYNTHETIC_EPISODE_END = "\n"


def _synthetic(examples: list[Example], name: str = "synthetic") -> Task:
    return Task(examples, template=SYNTHETIC_TEMPLATE, separator=SYNTHETIC_SEPARATOR, name=name,
                chance=1 / len(SYNTHETIC_VALUES))


def synthetic_episode(rng: random.Random, n_keys: int, n_lines: int) -> list[Example]:
    """One sequence under a fresh mapping: n_keys random letters, each given its own random digit,
    then n_lines examples with keys drawn at random. Only earlier examples of the same sequence
    can tell what a key means."""
    keys = rng.sample(SYNTHETIC_KEYS, n_keys)
    # one-to-one, so that copying any earlier digit (rather than the key's) does not pay
    mapping = dict(zip(keys, rng.sample(SYNTHETIC_VALUES, n_keys)))
    return [Example(k, mapping[k]) for k in (rng.choice(keys) for _ in range(n_lines))]


def synthetic_task(groups: int = 50, lines: int = 6, keys: int = 2, seed: int = 0) -> Task:
    """The built-in few-shot task (`--task synthetic`): `groups` episodes, each under its own fresh
    mapping of `keys` letters to digits, `lines` examples each. Every example is a query whose
    worked examples come from its own episode, so each worked example shows the query's key with
    probability 1/keys: a model that reads its context goes from chance (1/10) at 0-shot toward
    1 - (1 - 1/keys)^k at k-shot (0.5, 0.75, 0.875 for two keys), plus chance on the rest."""
    rng = random.Random(f"synthetic-task:{seed}")
    examples = []
    for g in range(groups):
        examples += [Example(e.input, e.output, group=f"episode-{g}") for e in synthetic_episode(rng, keys, lines)]
    return _synthetic(examples)


def synthetic_corpus(episodes: int, seed: int = 0, keys: tuple[int, int] = (2, 6),
                     lines: tuple[int, int] = (4, 16)) -> str:
    """Training text for the synthetic task: one episode per line, each under a fresh mapping
    (its number of keys and examples drawn from the given inclusive ranges), e.g. "q7 x3 q7 b1 x3".

    Within an episode a key's first digit is a guess among ten; every later one can be read off
    the earlier examples. Learning to do that is learning to use the context.
    """
    rng = random.Random(f"synthetic-corpus:{seed}")
    render = _synthetic([Example("a", "0")]).render
    out = []
    for _ in range(episodes):
        episode = synthetic_episode(rng, rng.randint(*keys), rng.randint(*lines))
        out.append(SYNTHETIC_SEPARATOR.join(render(e) for e in episode) + SYNTHETIC_EPISODE_END)
    return "".join(out)


def load_task(spec: str, *, seed: int = 0) -> Task:
    """`synthetic` (the built-in task, drawn with `seed`) or the path of a task file."""
    if spec == "synthetic":
        return synthetic_task(seed=seed)
    return read_task(spec)


# ---------------------------------------------------------------------------------------------
# Models


class LanguageModel(Protocol):
    """What the evaluator needs from a model (tests pass scripted fakes)."""

    context_length: int | None  # tokens the model sees; None: unlimited

    def token_count(self, text: str) -> int: ...

    def generate_until(self, prompt: str, stops: Sequence[str], max_new_tokens: int, lead: str = "") -> str:
        """Greedy continuation of `prompt`, cut before the first stop string; a `lead` the
        continuation begins with (the whitespace taken off the prompt's end) is not cut."""
        ...

    def loglikelihood(self, context: str, continuations: Sequence[str]) -> list[float]:
        """Sum of log P(continuation tokens | context) for each continuation."""
        ...


class GPTLanguageModel:
    """A tinygpt GPT and its tokenizer behind the LanguageModel interface."""

    def __init__(self, model, tokenizer) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.context_length = model.config.block_size
        self.device = next(model.parameters()).device

    def token_count(self, text: str) -> int:
        return len(self.tokenizer.encode(text))

    def _context_ids(self, text: str) -> list[int]:
        ids = self.tokenizer.encode(text) if text else []
        if not ids:
            if self.tokenizer.eot_id is None:
                raise ConfigError("the prompt is empty and the tokenizer has no end-of-text token to start from")
            ids = [self.tokenizer.eot_id]
        return ids

    def generate_until(self, prompt: str, stops: Sequence[str], max_new_tokens: int, lead: str = "") -> str:
        idx = torch.tensor([self._context_ids(prompt)], device=self.device)
        eot = self.tokenizer.eot_id
        decoder, stopper = IncrementalDecoder(self.tokenizer), StopText(stops)
        text, held = "", ("" if lead else None)  # held: the continuation while it may still be `lead`

        def past_lead(piece: str) -> str:
            """What of `piece` the stop strings see: nothing of the lead, if the continuation has it."""
            nonlocal text, held
            if held is None:
                return piece
            held += piece
            if len(held) < len(lead) and lead.startswith(held):
                return ""
            kept = len(lead) if held.startswith(lead) else 0
            text, rest, held = text + held[:kept], held[kept:], None
            return rest

        for token in generate_stream(self.model, idx, max_new_tokens, greedy=True,
                                     stop_tokens=None if eot is None else [eot], vocab_size=self.tokenizer.vocab_size):
            if eot is not None and int(token[0]) == eot:
                break
            piece = past_lead(decoder.push([int(token[0])]))  # (which may move the lead into text)
            text += stopper.push(piece)
            if stopper.done:
                return text
        piece = past_lead(decoder.flush())
        text += stopper.push(piece) + stopper.flush()
        return text + (held or "")

    @torch.inference_mode()
    def loglikelihood(self, context: str, continuations: Sequence[str]) -> list[float]:
        ctx = self._context_ids(context)
        block = self.context_length
        rows, lengths = [], []
        for cont in continuations:
            full = self.tokenizer.encode(context + cont)
            # the tokens of the continuation as they fall in the joint text, when the context's
            # tokens survive joining; otherwise encode it on its own
            cont_ids = full[len(ctx) :] if context and full[: len(ctx)] == ctx else self.tokenizer.encode(cont)
            if not cont_ids:
                raise ConfigError("an empty candidate answer cannot be scored")
            if len(cont_ids) > block:
                raise ConfigError(f"a candidate answer of {len(cont_ids)} tokens is longer than the context ({block})")
            seq = (ctx + cont_ids)[-(block + 1) :]  # the last block_size inputs, plus the final target
            rows.append(seq)
            lengths.append(len(cont_ids))
        width = max(len(r) for r in rows) - 1
        x = torch.zeros(len(rows), width, dtype=torch.long)
        y = torch.zeros(len(rows), width, dtype=torch.long)
        for i, seq in enumerate(rows):  # right-padding: causal attention keeps padding out of the rows
            x[i, : len(seq) - 1] = torch.tensor(seq[:-1])
            y[i, : len(seq) - 1] = torch.tensor(seq[1:])
        logp = torch.log_softmax(self.model(x.to(self.device)).float(), dim=-1)  # (C, T, V)
        picked = logp.gather(-1, y.to(self.device).unsqueeze(-1)).squeeze(-1)  # (C, T)
        scores = []
        for i, (seq, n) in enumerate(zip(rows, lengths)):
            end = len(seq) - 1
            scores.append(float(picked[i, end - n : end].sum()))
        return scores


# ---------------------------------------------------------------------------------------------
# Evaluation


@dataclass
class ShotResult:
    shots: int
    correct: int
    total: int
    truncated: int = 0  # prompts whose text with its answer is longer than the model's context

    @property
    def accuracy(self) -> float:
        return self.correct / self.total if self.total else 0.0

    def to_dict(self) -> dict:
        return {"shots": self.shots, "accuracy": self.accuracy, "correct": self.correct, "total": self.total,
                "truncated": self.truncated}


@dataclass
class FewShotReport:
    task: str
    scoring: str
    results: list[ShotResult] = field(default_factory=list)
    chance: float | None = None

    def to_dict(self) -> dict:
        return {"task": self.task, "scoring": self.scoring, "chance": self.chance,
                "results": [r.to_dict() for r in self.results]}


MAX_SHOTS = 10_000  # worked examples in one prompt: far past any context, and "0-99999999999" is a typo


def parse_shots(text: str) -> list[int]:
    """"0,1,2,3" -> [0, 1, 2, 3] (also ranges such as "0-3"), each k in 0..MAX_SHOTS."""
    def number(part: str) -> int:
        try:
            return int(part)
        except ValueError:
            raise ConfigError(f"--shots: expected numbers like 0,1,2,3 or 0-3, got {text!r}") from None

    shots: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if "-" in part[1:]:
            lo, hi = (number(n) for n in part.split("-", 1))
            if 0 <= hi < lo:  # an empty range: its k would be dropped without a word
                raise ConfigError(f"--shots: the range {part} goes down; write it low to high: {hi}-{lo}")
            if hi > MAX_SHOTS:  # before the range is built: a huge one would fill memory
                raise ConfigError(f"--shots: at most {MAX_SHOTS:,} worked examples, got {text!r}")
            shots += range(lo, hi + 1)
        else:
            shots.append(number(part))
    if not shots or min(shots) < 0:
        raise ConfigError(f"--shots: expected numbers >= 0, got {text!r}")
    if max(shots) > MAX_SHOTS:
        raise ConfigError(f"--shots: at most {MAX_SHOTS:,} worked examples, got {text!r}")
    return sorted(set(shots))


def shot_order(task: Task, index: int, seed: int) -> list[int]:
    """The query's pool in its seeded random order: the k-shot examples are the first k."""
    pool = task.pools()[index]
    order = list(pool)
    random.Random(f"{seed}:{index}").shuffle(order)
    return order


def evaluate(
    model: LanguageModel,
    task: Task,
    shots: Sequence[int] = (0, 1, 2, 3),
    *,
    scoring: str = "generate",
    queries: int | None = None,
    seed: int = 0,
    progress: Callable[[int, int], None] | None = None,
) -> FewShotReport:
    """Accuracy of `model` on `task` for each number of worked examples in `shots`.

    Args:
        model: a LanguageModel (GPTLanguageModel for a tinygpt run).
        task: the task (read_task, synthetic_task).
        shots: the k values.
        scoring: "generate" (greedy answer, exact match) or "likelihood" (best-scoring candidate).
        queries: evaluate the first `queries` examples only (default: all).
        seed: the order worked examples are drawn in.
        progress: called as progress(done, total) after every query.

    Raises:
        ConfigError: bad settings, or a k larger than some query's pool.
    """
    if scoring not in SCORINGS:
        raise ConfigError(f"scoring must be one of {', '.join(SCORINGS)}, got {scoring!r}")
    shots = sorted(set(shots))
    if not shots or min(shots) < 0:
        raise ConfigError("shots: expected numbers >= 0")
    n = len(task.examples) if queries is None else queries
    if not 1 <= n <= len(task.examples):
        raise ConfigError(f"queries: must be between 1 and {len(task.examples)}, got {queries}")
    pools = task.pools()
    smallest = min(len(pools[i]) for i in range(n))
    if max(shots) > smallest:
        raise ConfigError(
            f"{max(shots)}-shot prompts need {max(shots)} other examples per query; "
            f"some query has only {smallest} in its {'group' if task.examples[0].group is not None else 'task'}"
        )
    end = task.answer_end
    stops = [s for s in (end, task.separator) if s]
    outputs = list(dict.fromkeys(ex.output for ex in task.examples))
    longest = max(outputs, key=len)
    report = FewShotReport(task.name, scoring, [ShotResult(k, 0, 0) for k in shots], task.chance)
    max_new = None
    for i in range(n):
        query = task.examples[i]
        order = shot_order(task, i, seed)
        for result in report.results:
            prompt = build_prompt(task, query, [task.examples[j] for j in order[: result.shots]])
            prompt, space = _split_trailing_space(prompt)
            if scoring == "generate":
                if max_new is None:
                    max_new = model.token_count(space + longest + end) + 1
                answer = model.generate_until(prompt, stops, max_new, lead=space)
                ok = answer.strip() == query.output.strip()
                full = prompt + space + query.output + end
            else:
                candidates = list(query.choices or outputs)
                scores = model.loglikelihood(prompt, [space + c + end for c in candidates])
                ok = candidates[max(range(len(candidates)), key=scores.__getitem__)] == query.output
                full = prompt + space + max(candidates, key=len) + end
            result.total += 1
            result.correct += int(ok)
            if model.context_length is not None and model.token_count(full) > model.context_length:
                result.truncated += 1
        if progress is not None:
            progress(i + 1, n)
    return report
