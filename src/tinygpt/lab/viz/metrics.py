"""A training run's metrics.jsonl as the pictures read it, and the smoothing their loss curves share."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...errors import CheckpointError
from ...run_folder import RunFolder


@dataclass
class RunMetrics:
    """A training run's metrics.jsonl: per-step training loss, the periodic evaluations and the probes
    (tinygpt.lab.probes: (step, probe record) pairs)."""

    name: str
    steps: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    times: list[float] = field(default_factory=list)  # seconds since the run began, at each step
    eval_steps: list[int] = field(default_factory=list)
    eval_tokens: list[int] = field(default_factory=list)
    eval_times: list[float] = field(default_factory=list)
    train_loss: list[float] = field(default_factory=list)
    val_loss: list[float] = field(default_factory=list)
    probes: list[tuple[int, dict[str, Any]]] = field(default_factory=list)
    # every other number an objective logs (GRPO's reward, kl, ...; an evaluation's val_accuracy, ...): its
    # (step, value) pairs by name
    logged: dict[str, list[tuple[int, float]]] = field(default_factory=dict)

    def series(self, name: str) -> tuple[list[int], list[float]]:
        """The steps and values of a logged number (empty where the run never logged it)."""
        pairs = self.logged.get(name, [])
        return [s for s, _ in pairs], [v for _, v in pairs]


# what every metrics line has, which RunMetrics keeps in its own lists (or no curve wants)
_PLAIN = {"step", "tokens", "loss", "lr", "grad_norm", "tokens_per_s", "time", "train_loss", "val_loss", "eval_iters"}


def read_metrics(run: str | os.PathLike, name: str | None = None) -> RunMetrics:
    """Read a run folder's metrics.jsonl (or the file itself).

    A last line cut short (a run killed while writing it) is skipped; anything else that is not
    a metrics line is an error.

    Raises:
        CheckpointError: no such run, no metrics.jsonl, a corrupt line, or no step logged yet.
    """
    path = Path(run)
    file = RunFolder(path).metrics_file if path.is_dir() else path
    if not path.exists():
        raise CheckpointError(f"{run}: no such run folder")
    if not file.is_file():
        raise CheckpointError(f"{run}: no metrics.jsonl here (is it a tinygpt training run?)")
    m = RunMetrics(name or (path.name if path.is_dir() else path.parent.name))
    lines = file.read_text(encoding="utf-8", errors="replace").splitlines()
    offset = last = 0.0  # a resumed run's clock starts again at 0: it carries on from the last time
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            step, tokens = int(record["step"]), int(record["tokens"])
            if "probe" in record:
                if not isinstance(record["probe"], dict):
                    raise TypeError("a probe is a JSON object")
                m.probes.append((step, record["probe"]))
            elif "val_loss" in record:
                m.eval_steps.append(step)
                m.eval_tokens.append(tokens)
                m.eval_times.append(offset + last)  # an evaluation follows its step
                # an objective's evaluation may have no train loss (GRPO's scores held-out prompts)
                m.train_loss.append(float(record.get("train_loss", "nan")))
                m.val_loss.append(float(record["val_loss"]))
            else:
                loss = float(record["loss"])
                t = float(record.get("time", last))
                if t < last:
                    offset += last
                m.steps.append(step)
                m.tokens.append(tokens)
                m.times.append(offset + t)
                m.loss.append(loss)
                last = t
            for name, value in record.items():
                if name not in _PLAIN and isinstance(value, (int, float)) and not isinstance(value, bool):
                    m.logged.setdefault(name, []).append((step, float(value)))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            if number == len(lines) and isinstance(e, json.JSONDecodeError):
                break  # cut short by a kill; the lines before it are whole
            raise CheckpointError(f"{file}, line {number}: not a metrics line ({e})") from None
    if not m.steps and not m.eval_steps:
        raise CheckpointError(f"{file}: no training step logged yet")
    return m


def smooth(values: list[float], span: int) -> list[float]:
    """Exponential moving average, bias-corrected so the first points are not pulled toward 0."""
    if span <= 1:
        return list(values)
    alpha, avg, out = 2.0 / (span + 1), 0.0, []
    for i, v in enumerate(values, start=1):
        avg = alpha * v + (1 - alpha) * avg
        out.append(avg / (1 - (1 - alpha) ** i))
    return out
