"""Scaling laws as plain data: power laws N_opt = k·C^a and D_opt = k·C^b, and what a sweep fitted.

`tinygpt sweep` measures them (the fitting lives in tinygpt.lab.sweep, with numpy and scipy); this
module only holds and evaluates them, so `tinygpt train --sweep DIR` can size a model from a
sweep's fit.json without importing the fitting code.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError
from .chinchilla import LossFit

# Hoffmann et al.'s three approaches put both exponents near one half: N_opt ∝ C^0.50, D_opt ∝ C^0.50
# (approach 1: 0.50 / 0.50, approach 2: 0.49 / 0.51, approach 3: 0.46 / 0.54).
CHINCHILLA_EXPONENTS = {"a": 0.50, "b": 0.50}


@dataclass(frozen=True)
class PowerLaw:
    """y = coef · x^exponent.

    Args:
        coef: the value at x = 1.
        exponent: the slope on log-log axes.
    """

    coef: float
    exponent: float

    def __call__(self, x: float) -> float:
        return self.coef * x**self.exponent

    def to_dict(self) -> dict[str, float]:
        return {"coef": self.coef, "exponent": self.exponent}

    @classmethod
    def from_dict(cls, data: Any, where: str = "power law") -> PowerLaw:
        values = _numbers(data, ("coef", "exponent"), where)
        if values["coef"] <= 0:
            raise ConfigError(f"{where}: coef must be more than zero, got {values['coef']!r}")
        return cls(**values)


@dataclass(frozen=True)
class ScalingLaw:
    """What a scaling sweep fitted, enough to size a model for a compute budget.

    Args:
        params: N_opt(C), the IsoFLOP minima's power law (None when the sweep could not fit it).
        tokens: D_opt(C), likewise.
        loss: the parametric fit L(N, D) = E + A/N^alpha + B/D^beta (None when not fitted).
        flops_range: the smallest and largest budget the fit saw; beyond it is extrapolation.
        data: the data folder the sweep trained on.
        source: where the fit was read from (a sweep folder), for messages.
    """

    params: PowerLaw | None
    tokens: PowerLaw | None
    loss: LossFit | None
    flops_range: tuple[float, float]
    data: str | None = None
    source: str | None = None

    def optimal_params(self, flops: float) -> float:
        """The compute-optimal N for `flops`: the IsoFLOP power law, else the parametric fit's optimum."""
        if not (isinstance(flops, (int, float)) and 0 < flops < math.inf):
            raise ConfigError(f"flops: must be a finite number more than zero, got {flops!r}")
        if self.params is not None:
            return self.params(flops)
        if self.loss is not None:
            return self.loss.optimal(flops)[0]
        raise ConfigError("the sweep's fit has neither a frontier nor a loss fit to size a model with")

    @property
    def rule(self) -> str:
        """The formula optimal_params uses, for messages."""
        if self.params is not None:
            return f"N_opt = {self.params.coef:.3g}·C^{self.params.exponent:.2f}"
        if self.loss is not None:
            return f"the optimum of L = {self.loss.E:.3g} + {self.loss.A:.3g}/N^{self.loss.alpha:.2f} + " \
                   f"{self.loss.B:.3g}/D^{self.loss.beta:.2f}"
        return "no fit"

    @classmethod
    def from_dict(cls, data: Any, where: str = "fit.json", source: str | None = None) -> ScalingLaw:
        """Read the "frontier", "loss_fit", "flops_range" and "data" of a sweep's fit.json."""
        if not isinstance(data, dict):
            raise ConfigError(f"{where}: expected a JSON object")
        frontier = data.get("frontier") or {}
        if not isinstance(frontier, dict):
            raise ConfigError(f"{where}: frontier must be an object")
        params = frontier.get("params")
        tokens = frontier.get("tokens")
        loss = data.get("loss_fit")
        lo_hi = data.get("flops_range")
        if not (isinstance(lo_hi, list) and len(lo_hi) == 2):
            raise ConfigError(f"{where}: flops_range must be a list [lowest, highest]")
        low, high = (_numbers({"v": v}, ("v",), f"{where}: flops_range")["v"] for v in lo_hi)
        return cls(
            params=None if params is None else PowerLaw.from_dict(params, f"{where}: frontier.params"),
            tokens=None if tokens is None else PowerLaw.from_dict(tokens, f"{where}: frontier.tokens"),
            loss=None if loss is None else LossFit(**_numbers(loss, ("E", "A", "B", "alpha", "beta"), f"{where}: loss_fit")),
            flops_range=(low, high),
            data=data.get("data") if isinstance(data.get("data"), str) else None,
            source=source,
        )


def _numbers(data: Any, keys: tuple[str, ...], where: str) -> dict[str, float]:
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a JSON object")
    out = {}
    for key in keys:
        value = data.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ConfigError(f"{where}: {key} must be a finite number, got {value!r}")
        out[key] = float(value)
    return out
