"""Compute-optimal model and data size (Hoffmann et al. 2022, "Chinchilla") and the loss they predict.

The rule of thumb: training costs C = 6 N D FLOPs for N parameters and D tokens, and for a fixed C
the best loss comes with D = 20 N, so N = sqrt(C / 120) and D = 20 N. Gopher's budget of 5.76e23
FLOPs gives 69B parameters and 1.4T tokens: Chinchilla itself, 70B parameters on 1.4T tokens.

The loss comes from the paper's parametric fit L(N, D) = E + A / N^alpha + B / D^beta (approach 3;
E = 1.69, A = 406.4, B = 410.7, alpha = 0.34, beta = 0.28), fitted on their data and tokenizer: a
guide to how loss moves with scale, not a promise of a number on your text. Minimising that fit
under C = 6 N D gives its own optimum, N proportional to C^(beta / (alpha + beta)); `LossFit.optimal`
returns it, and a sweep can fit its own LossFit to compare.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from ..errors import ConfigError

TOKENS_PER_PARAM = 20.0  # Chinchilla's D = 20 N


@dataclass(frozen=True)
class LossFit:
    """A parametric loss L(N, D) = E + A / N^alpha + B / D^beta.

    Args:
        E: the irreducible loss (the entropy of the text, as far as the fit can tell).
        A, alpha: how loss falls with parameters N.
        B, beta: how loss falls with training tokens D.
    """

    E: float
    A: float
    B: float
    alpha: float
    beta: float

    def loss(self, params: float, tokens: float) -> float:
        """The predicted loss (nats per token) of N = `params` trained on D = `tokens`."""
        return self.E + self.A / params**self.alpha + self.B / tokens**self.beta

    def optimal(self, flops: float) -> tuple[float, float]:
        """(N, D) that minimise this fit's loss under C = 6 N D: Hoffmann et al.'s eq. 4."""
        s = self.alpha + self.beta
        G = (self.alpha * self.A / (self.beta * self.B)) ** (1 / s)
        return G * (flops / 6) ** (self.beta / s), (flops / 6) ** (self.alpha / s) / G


CHINCHILLA_FIT = LossFit(E=1.69, A=406.4, B=410.7, alpha=0.34, beta=0.28)


@dataclass(frozen=True)
class ChinchillaPlan:
    """A compute-optimal run by C = 6 N D and D = tokens_per_param x N.

    Args:
        params: N, the model's parameters.
        tokens: D, the training tokens.
        flops: C, the training compute.
        loss: the fit's predicted loss at (N, D).
        tokens_per_param: the D / N ratio used (20 for Chinchilla).
        fit_params, fit_tokens, fit_loss: the fit's own optimum for the same C.
    """

    params: float
    tokens: float
    flops: float
    loss: float
    tokens_per_param: float
    fit_params: float
    fit_tokens: float
    fit_loss: float

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


def _check_positive(value: float | None, what: str, *, required: bool = False) -> None:
    if value is None and not required:
        return
    if isinstance(value, bool) or not (isinstance(value, (int, float)) and 0 < value < math.inf):
        raise ConfigError(f"{what}: must be a finite number more than zero, got {value!r}")


def compute_optimal(
    flops: float | None = None,
    params: float | None = None,
    tokens: float | None = None,
    *,
    tokens_per_param: float = TOKENS_PER_PARAM,
    fit: LossFit = CHINCHILLA_FIT,
    rtol: float = 0.01,
) -> ChinchillaPlan:
    """The compute-optimal run for a budget given as FLOPs, parameters or tokens.

    Any one of the three fixes the other two; give two or three only if they agree (within
    `rtol`) under C = 6 N D and D = tokens_per_param x N.

    Args:
        flops: training compute C in FLOPs.
        params: model size N.
        tokens: training tokens D.
        tokens_per_param: the D / N ratio (20: Chinchilla's rule).
        fit: the parametric loss to predict the loss with.
        rtol: relative tolerance when more than one budget is given.

    Raises:
        ConfigError: no budget, a budget that is not a positive finite number, or budgets that disagree.
    """
    for value, what in ((flops, "flops"), (params, "params"), (tokens, "tokens")):
        _check_positive(value, what)
    _check_positive(tokens_per_param, "tokens_per_param", required=True)
    if flops is not None:
        N = math.sqrt(flops / (6 * tokens_per_param))
    elif params is not None:
        N = float(params)
    elif tokens is not None:
        N = tokens / tokens_per_param
    else:
        raise ConfigError("give a budget: flops, params or tokens")
    D = tokens_per_param * N
    C = 6 * N * D
    source = next(f"{what} {value:.4g}" for value, what in ((flops, "flops"), (params, "params"), (tokens, "tokens"))
                  if value is not None)
    for given, derived, what in ((params, N, "params"), (tokens, D, "tokens")):
        if given is not None and abs(given - derived) > rtol * derived:
            raise ConfigError(
                f"{what} {given:.4g} and {source} disagree: with C = 6·N·D and D = {tokens_per_param:g}·N, "
                f"{source} means {what} {derived:.4g}; give one budget, or another tokens-per-param ratio"
            )
    fit_N, fit_D = fit.optimal(C)
    if not all(math.isfinite(x) and x > 0 for x in (N, D, C, fit_N, fit_D)):
        raise ConfigError(f"{source} with {tokens_per_param:g} tokens per parameter is past what a float can hold "
                          "(the plan's figures overflow); give a smaller budget")
    return ChinchillaPlan(
        params=N, tokens=D, flops=C, loss=fit.loss(N, D), tokens_per_param=float(tokens_per_param),
        fit_params=fit_N, fit_tokens=fit_D, fit_loss=fit.loss(fit_N, fit_D),
    )
