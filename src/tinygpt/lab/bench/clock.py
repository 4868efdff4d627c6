"""How the bench times things: the best of a few runs of a call, and the clock a generation ticks at
each token (time to the first, then the whole call's wall clock)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import torch


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_time(fn: Callable[[], Any], repeats: int, device: torch.device) -> float:
    """The fastest of `repeats` calls of fn, in seconds, after one untimed call (a GPU's work waited for)."""
    fn()
    _sync(device)
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return best


class Clock:
    """Timestamps of each step of a generation: the first token, then every other one."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.times: list[float] = []

    def tick(self) -> None:
        self.times.append(time.perf_counter() - self.start)

    def result(self, prompt_tokens: int, batch: int, tokens: list[int]) -> dict[str, Any]:
        ttft, wall = self.times[0], self.times[-1]
        # decode: the tokens over the whole call, as a user's wall clock sees it (the prompt, the cache's
        # allocation and every step's stall included), not the median step, which hid a block_size cache
        # zeroed at every call and the steps a busy machine stalls
        return {"ttft_s": ttft, "prefill_tokens_per_s": prompt_tokens * batch / ttft,
                "decode_tokens_per_s": len(self.times) * batch / wall, "wall_s": wall, "tokens": tokens}
