"""What a run tells those who watch it: TrainCallback's hooks (a progress bar, probes, a trace), the
RunStart they get first and the TrainResult the run ends with."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


@dataclass
class TrainResult:
    """What train() returns, and TrainCallback.on_end is given."""

    run: Path
    step: int  # optimizer steps done in total
    train_loss: float | None  # the last step's loss
    val_loss: float | None  # the last evaluation's
    stopped: str  # "max_iters", "max_time", "SIGINT", "SIGTERM" or "requested"
    tokens: int  # training tokens seen in total
    elapsed: float  # seconds of this invocation
    # seconds of training over the whole run: what its checkpoint recorded before a resume (none in a
    # checkpoint saved before tinygpt kept it) and this invocation's
    total_elapsed: float


@dataclass(frozen=True)
class RunStart:
    """What a TrainCallback learns as a run starts.

    Args:
        run: the run folder.
        rank, world_size: this process and how many train together (0 and 1 without torchrun).
        step: optimizer steps already done (a resumed run's).
        total: the run's length in steps, None while a time budget's is not estimated yet.
        model: the model being trained (unwrapped and uncompiled): a hook may measure it, under
            torch.no_grad() and with its own random generator so that training stays as it was.
        log: writes a JSON-ready record (with "step" and "tokens") as a line of the run's
            metrics.jsonl (rank 0 writes; elsewhere it does nothing).
    """

    run: Path
    rank: int
    world_size: int
    step: int
    total: int | None
    model: torch.nn.Module | None = None
    log: Callable[[dict[str, Any]], None] | None = None


class TrainCallback:
    """Hooks train() calls as a run goes; each does nothing here: subclass and override what you need.
    Under torchrun every process calls them at the same points, so a hook may run a collective
    (tinygpt.distributed.full_parameters, say) in on_end. An exception in a hook ends the run."""

    def on_start(self, start: RunStart) -> None:
        """Before the first step."""

    def on_batch(self, offsets: torch.Tensor) -> None:
        """Every micro-step's batch as it is drawn: where this process's rows come from in the train split
        (the objective's Batch.positions: window start positions for text, packed rows for chat data)."""

    def on_step(self, record: dict[str, Any], total: int | None) -> None:
        """After every optimizer step (and its evaluation, when one was due) with the step's metrics line
        (step, tokens, loss, lr, grad_norm, the objective's metrics if it logs any, tokens_per_s, time) and
        the run's length as now estimated."""

    def on_eval(self, record: dict[str, Any]) -> None:
        """After every evaluation, with its metrics line (step, tokens and the objective's evaluation: for
        the next-token loss train_loss and val_loss)."""

    def on_end(self, result: TrainResult, model: torch.nn.Module) -> None:
        """Once the run has stopped and its last checkpoint is on disk, with the trained model."""

    def close(self) -> None:
        """Last, whether the run ended or raised."""


class ProgressBar(TrainCallback):
    """A progress bar on stderr (steps, loss, tokens/s) and a line per evaluation on stdout (written
    above the bar), shown by rank 0: what `tinygpt train` shows, and what train(progress=True) installs."""

    def __init__(self) -> None:
        self.bar, self.show = None, False

    def on_start(self, start: RunStart) -> None:
        from tqdm.auto import tqdm

        self.show = start.rank == 0
        self.bar = tqdm(total=start.total, initial=start.step, unit="step", disable=not self.show,
                        file=sys.stderr, dynamic_ncols=True)

    def on_step(self, record: dict[str, Any], total: int | None) -> None:
        self.bar.total = total
        self.bar.update(1)
        rate = record["tokens_per_s"]
        tok_s = f"{rate:,.0f}" if rate is not None else "-"
        self.bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=tok_s, refresh=False)

    def on_eval(self, record: dict[str, Any]) -> None:
        if self.show:  # an objective's evaluation has a val_loss; the next-token loss's, a train_loss too
            train = f"train loss {record['train_loss']:.4f}, " if "train_loss" in record else ""
            self.bar.write(f"step {record['step']}: {train}val loss {record['val_loss']:.4f}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class AllOf(TrainCallback):
    """Several callbacks as one, called in order."""

    def __init__(self, callbacks: Sequence[TrainCallback]) -> None:
        self.callbacks = list(callbacks)

    def on_start(self, start: RunStart) -> None:
        for c in self.callbacks:
            c.on_start(start)

    def on_batch(self, offsets: torch.Tensor) -> None:
        for c in self.callbacks:
            c.on_batch(offsets)

    def on_step(self, record: dict[str, Any], total: int | None) -> None:
        for c in self.callbacks:
            c.on_step(record, total)

    def on_eval(self, record: dict[str, Any]) -> None:
        for c in self.callbacks:
            c.on_eval(record)

    def on_end(self, result: TrainResult, model: torch.nn.Module) -> None:
        for c in self.callbacks:
            c.on_end(result, model)

    def close(self) -> None:
        for c in self.callbacks:
            c.close()
