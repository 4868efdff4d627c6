"""The sampling config: how generation chooses each next token from the logits (tinygpt.sampling applies it)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .fields import check, check_bools, check_int, is_number

@dataclass
class SampleConfig:
    """How the next token is chosen from the logits.

    Args:
        temperature: logits are divided by it; 0 means greedy (and so does anything below 1e-5,
            where dividing would overflow the logits to inf).
        top_k: keep only the k most likely tokens.
        top_p: keep the smallest set of tokens whose probability reaches p (always the top one).
        repetition_penalty: alpha > 0; for tokens already in the sequence, positive logits are
            divided by alpha and negative ones multiplied by it. 1.0 turns it off.
        greedy: take the argmax (after the repetition penalty).
    """

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    repetition_penalty: float = 1.0
    greedy: bool = False

    def __post_init__(self) -> None:
        t = self.temperature
        check(is_number(t) and not math.isnan(t) and 0 <= t < math.inf, "temperature",
              f"must be a finite number >= 0, got {t!r}")
        if self.top_k is not None:
            check_int(self.top_k, "top_k", 1)
        if self.top_p is not None:
            check(is_number(self.top_p) and 0 < self.top_p <= 1, "top_p",
                  f"must be a number in (0, 1], got {self.top_p!r}")
        a = self.repetition_penalty
        check(is_number(a) and not math.isnan(a) and 0 < a < math.inf, "repetition_penalty",
              f"must be a finite number > 0, got {a!r}")
        check_bools(self, ("greedy",))

    @property
    def is_greedy(self) -> bool:
        return self.greedy or self.temperature < 1e-5
