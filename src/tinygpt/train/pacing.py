"""How a run keeps time and hears a signal: a time budget's pace (Pace: step and evaluation times, the
steps left, what the last evaluation can afford) and SIGINT/SIGTERM turned into a stop after the step
(Stop, signals)."""

from __future__ import annotations

import math
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from ..config.train import TrainConfig

CALIBRATION_STEPS = 5  # steps timed before a --max-time run first estimates its schedule's length
SPEED_WINDOW = 20  # a time budget's step time: the median of this many most recent steps


class Stop:
    """SIGINT/SIGTERM set a flag; the loop finishes its step, saves and returns."""

    def __init__(self) -> None:
        self.signal: str | None = None

    def __call__(self, signum: int, frame: Any) -> None:
        if self.signal is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now
        self.signal = signal.Signals(signum).name


@contextmanager
def signals(stop: Stop) -> Iterator[None]:
    """For the block, `stop` handles SIGINT and SIGTERM, and the handlers before it are put back after. Only
    the main thread may set handlers: elsewhere nothing changes (a signal does what it did before).

    Args:
        stop: the flag the loop reads after each step.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


class Pace:
    """How fast a run with a time budget goes, measured as it goes: the median of the last
    SPEED_WINDOW step times (the first step, which warms caches and kernels up, left out unless it
    is all there is), and the time an evaluation with its checkpoint takes (estimated from
    eval_iters until one has run)."""

    def __init__(self, cfg: TrainConfig, started: float) -> None:
        self.cfg, self.started = cfg, started
        self.first: float | None = None
        self.times: list[float] = []
        self.steps = 0
        self.eval_seconds: list[float] = []

    def step(self, seconds: float) -> None:
        self.steps += 1
        if self.steps == 1:
            self.first = seconds
        else:
            self.times = (self.times + [seconds])[-SPEED_WINDOW:]

    def evaluation(self, seconds: float) -> None:
        self.eval_seconds = (self.eval_seconds + [seconds])[-3:]

    def per_step(self) -> float:
        return float(np.median(self.times)) if self.times else (self.first or 0.0)

    def per_eval(self) -> float:
        """An evaluation's seconds: as measured, else 2 x eval_iters forward passes at a third of a step each."""
        if self.eval_seconds:
            return float(np.mean(self.eval_seconds))
        return self.per_step() * 2 * self.cfg.eval_iters / (3 * self.cfg.grad_accum)

    def time_left(self, now: float) -> float:
        """Seconds of the budget left once the last evaluation is paid for. It is given at most a
        tenth of the budget: when a whole evaluation costs more, it takes fewer batches (final_eval_iters)."""
        return self.cfg.max_time - (now - self.started) - min(self.per_eval(), self.cfg.max_time / 10)

    def steps_left(self, now: float) -> float | None:
        """Steps the rest of the budget buys, after the evaluations they bring and the last one
        (None until CALIBRATION_STEPS steps have been timed)."""
        if self.steps <= CALIBRATION_STEPS or not self.times:
            return None
        return max(0.0, self.time_left(now) / (self.per_step() + self.per_eval() / self.cfg.eval_interval))

    def final_eval_iters(self, now: float) -> int:
        """Batches per split the last evaluation can afford in what is left of the budget: eval_iters
        when it fits, fewer (at least one) when the budget is nearly spent, so the run ends on time."""
        per_batch = self.per_eval() / self.cfg.eval_iters
        affordable = (self.cfg.max_time - (now - self.started)) / per_batch if per_batch > 0 else math.inf
        return int(max(1, min(self.cfg.eval_iters, affordable)))
