"""Rewards for GRPO, each a function with TRL's reward signature, and the prompts they score.

    task_reward(task)           a built-in task's checker (tinygpt.align.tasks): 1 for a right answer, else 0
    import_reward("mod:fn")     a Python function of the user's, imported only because the command line names
                                it (a run folder records the name and never imports it on its own)
    model_reward(run)           a reward model's score (`tinygpt reward train`'s run, or a Hugging Face
                                *ForSequenceClassification folder)
    named_reward(spec)          whichever of the two a --reward names
    score(rewards, ...)         every function on a batch of completions: (N, F) floats, NaN where one said None
    read_prompts(path)          a JSONL file of TRL's prompt-only rows: "prompt" (a string or a list of
                                messages) and any other columns, which reach the functions by name

A reward function is called as TRL calls one: f(prompts=[...], completions=[...], completion_ids=[...],
**columns), each list one entry per completion (a prompt repeated for its group), and returns one float or
None per completion. Conversational prompts get conversational completions ([{"role": "assistant",
"content": ...}]), as in TRL.
"""

from __future__ import annotations

import importlib
import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import ConfigError, DataError, RewardError
from ..fileio import jsonl_records

BAD_LINES_SHOWN = 5


@dataclass(frozen=True)
class Reward:
    """A reward function and how it counts.

    Args:
        name: what the run records and the metrics are called by: a task's name, "module:function", a run.
        fn: the function, with TRL's signature.
        weight: its weight in the sum the advantages are computed from.
    """

    name: str
    fn: Callable[..., list]
    weight: float = 1.0

    @property
    def label(self) -> str:
        """What the metrics call it (rewards/LABEL/mean): its name, a reward model's folder by its last part, as
        TRL names one."""
        return Path(self.name).name or self.name


def task_reward(task: Any, weight: float = 1.0) -> Reward:
    """A built-in task's checker as a reward (the rows need the task's "answer" column).

    Args:
        task: a task of tinygpt.align.tasks.
        weight: its weight.
    """
    return Reward(task.name, task.reward, weight)


def is_callable_name(spec: str) -> bool:
    """Whether a --reward names a Python function ("module:function") rather than a run folder."""
    module, sep, name = spec.partition(":")
    return bool(sep) and module.replace(".", "").replace("_", "").isalnum() and name.isidentifier()


def import_reward(spec: str, weight: float = 1.0) -> Reward:
    """Import the function "module:function" (the module found on sys.path or in the current directory).

    Args:
        spec: "module:function", as the command line gave it.
        weight: its weight.

    Raises:
        ConfigError: the module does not import (its error named), has no such name, or it is not callable.
    """
    module_name, _, name = spec.partition(":")
    if not is_callable_name(spec):
        raise ConfigError(f"--reward {spec}: a reward function is named module:function (rewards:correct)")
    here = os.getcwd()
    added = here not in sys.path
    if added:  # a module beside the user, as `python -m` would find it
        sys.path.insert(0, here)
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # a module's own error on import too: it is the user's code
        raise ConfigError(f"--reward {spec}: cannot import {module_name} ({type(e).__name__}: "
                          f"{_first_line(e)})") from None
    finally:
        if added:
            sys.path.remove(here)
    fn = getattr(module, name, None)
    if fn is None:
        raise ConfigError(f"--reward {spec}: {module_name} has no {name}")
    if not callable(fn):
        raise ConfigError(f"--reward {spec}: {name} is a {type(fn).__name__}, not a function")
    return Reward(spec, fn, weight)


def model_reward(run: str | Path, weight: float = 1.0, device: torch.device | str = "cpu") -> Reward:
    """A reward model's score of each completion to its prompt as a reward (align.reward.score_completions: the
    texts written as its training wrote a pair's side). Its weights are all that is read of the folder.

    Args:
        run: a reward model's run folder, or a Hugging Face *ForSequenceClassification folder.
        weight: its weight.
        device: where it scores.

    Raises:
        ConfigError: a language model, not a reward model.
        CheckpointError: the folder does not load.
    """
    from ..checkpoint import load_run
    from .reward import score_completions

    model, tokenizer = load_run(run, device)
    if model.config.head != "reward":
        raise ConfigError(f"--reward {run}: a language model, not a reward model (`tinygpt reward train` makes one; "
                          "a function is named module:function)")
    model.eval().requires_grad_(False)

    def reward_model(prompts: list, completions: list, **columns: Any) -> list[float]:
        return score_completions(model, tokenizer, prompts, completions).tolist()

    return Reward(str(run), reward_model, weight)


def named_reward(spec: str, weight: float = 1.0, device: torch.device | str = "cpu") -> Reward:
    """The reward a --reward names: a Python function ("module:function", imported because the command line
    names it) or a reward model's folder.

    Args:
        spec: as the command line gave it.
        weight: its weight.
        device: where a reward model scores.

    Raises:
        ConfigError: neither, or one that does not load (import_reward's and model_reward's errors).
        CheckpointError: a reward model's folder that does not load.
    """
    if is_callable_name(spec):
        return import_reward(spec, weight)
    if Path(spec).is_dir():
        return model_reward(spec, weight, device)
    raise ConfigError(f"--reward {spec}: neither a function named module:function (rewards:correct) nor a reward "
                      "model's folder")


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else "no message"


def score(rewards: list[Reward], prompts: list, completions: list, completion_ids: list[list[int]],
          columns: dict[str, list]) -> torch.Tensor:
    """Every reward function's score of every completion.

    Args:
        rewards: the functions.
        prompts, completions: one entry per completion, as TRL passes them.
        completion_ids: each completion's token ids.
        columns: the rows' other columns, one entry per completion.

    Returns:
        (N, F) float32, NaN where a function returned None.

    Raises:
        RewardError: a function raised, returned something other than N numbers or None, or a number
            that is not finite; naming it.
    """
    n = len(completions)
    out = torch.empty(n, len(rewards))
    for j, reward in enumerate(rewards):
        try:
            values = reward.fn(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
        except Exception as e:  # the user's code: whatever it raises ends the run in one line naming it
            raise RewardError(f"reward {reward.name} raised {type(e).__name__}: {_first_line(e)}") from e
        out[:, j] = torch.tensor(_checked(reward.name, values, n), dtype=torch.float32)
    return out


def _checked(name: str, values: Any, n: int) -> list[float]:
    """values as n floats (None as NaN), or a RewardError saying what is wrong."""
    try:
        values = list(values)
    except TypeError:
        raise RewardError(f"reward {name} returned a {type(values).__name__}, not a list of {n} numbers") from None
    if len(values) != n:
        raise RewardError(f"reward {name} returned {len(values)} rewards for {n} completions (one each)")
    floats = []
    for i, v in enumerate(values):
        if v is None:
            floats.append(math.nan)
            continue
        try:
            f = float(v)
        except (TypeError, ValueError):
            raise RewardError(f"reward {name} returned {v!r} for completion {i}: a number or None") from None
        if not math.isfinite(f):
            raise RewardError(f"reward {name} returned {v!r} for completion {i}: a finite number or None")
        floats.append(f)
    return floats


def read_prompts(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a prompt-only JSONL file, as TRL reads one: each an object with "prompt", a non-empty
    string or a list of messages ({"role", "content"}), and any other columns.

    Args:
        path: the file.

    Raises:
        DataError: the file does not read, holds no row, or has bad lines (the first five listed by number).
    """
    path = Path(path)
    rows, bad = [], []
    try:
        for number, row, why in jsonl_records(path):
            wrong = why or _row_error(row)
            if wrong:
                bad.append(f"line {number}: {wrong}")
            else:
                rows.append(row)
    except OSError as e:
        raise DataError(f"{path}: cannot read the prompts ({e.strerror or e})") from None
    if bad:
        more = f" (and {len(bad) - BAD_LINES_SHOWN} more)" if len(bad) > BAD_LINES_SHOWN else ""
        raise DataError(f"{path}: {len(bad)} bad lines: {'; '.join(bad[:BAD_LINES_SHOWN])}{more}")
    if not rows:
        raise DataError(f"{path}: no prompts (one JSON object a line, with a \"prompt\")")
    return rows


def _row_error(row: Any) -> str | None:
    if not isinstance(row, dict):
        return "not an object"
    prompt = row.get("prompt")
    if prompt is None:
        return 'no "prompt"'
    if isinstance(prompt, str):
        return None if prompt else 'an empty "prompt"'
    if isinstance(prompt, list) and prompt and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in prompt):
        return None
    return '"prompt" is neither a string nor a list of messages with role and content'


def columns_of(rows: list[dict[str, Any]], group: int) -> dict[str, list]:
    """The rows' columns other than "prompt", each value repeated for its group's completions.

    Args:
        rows: the prompts' rows.
        group: completions per prompt.
    """
    names = {k for row in rows for k in row if k not in ("prompt", "completion", "completion_ids")}
    return {k: [row.get(k) for row in rows for _ in range(group)] for k in sorted(names)}
