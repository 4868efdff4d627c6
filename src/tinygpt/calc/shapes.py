"""A model shape for a parameter budget: (n_layer, n_head, n_embd) with a sensible aspect ratio.

Kaplan et al. (2020) found the loss of a GPT depends on its size far more than on its shape: at a
fixed parameter count, width / depth ratios from about 20 to 200 land within a few percent. Real
models sit between 32 and 100: GPT-2 small is 768 wide and 12 deep (64), GPT-2 large and XL 36 and
33, nanoGPT's 4 x 128 and the lesson's 2 x 64 character models 32, Chinchilla 70B 102. tinygpt aims
at 32: its models are small, and at 64 a 100K-parameter model would be a single layer, which
cannot form the two-layer circuits (induction heads) that small transformers learn early.

The depth comes first: the one at which a model of exactly that ratio reaches the target, give or
take a layer. At those depths the widths on either side of the target are counted exactly, and the
shape that best balances the miss in the count against the miss in the ratio wins. So depth grows
smoothly with N (about as N^(1/3)), which keeps a sweep's models one family. Where the embeddings
dominate (a 30K-parameter char model) the ratio cannot be kept and one or two layers it is.

Widths are multiples of 8 below 128, of 16 below 512, of 64 below 4096 and of 128 beyond (the
count of a small model moves a lot with each step of width); heads are about 64 wide
from 256 up (GPT-2's head size) and about 32 below, so that even a 96-wide model gets a few.
"""

from __future__ import annotations

import dataclasses
import math

from ..config.model import GPTConfig
from ..errors import ConfigError
from .params import count_params

ASPECT_RATIO = 32.0  # n_embd / n_layer: GPT-2 large and XL, the 4 x 128 char models laptops train
# a 10% miss in the parameter count costs as much as a 2x miss in the aspect ratio
PARAM_WEIGHT = math.log(2.0) / math.log(1.1)
MAX_LAYERS = 256
MAX_MISS = 1.5  # a shape more than 1.5x off the target is refused


def _widths() -> list[int]:
    widths = list(range(16, 128, 8)) + list(range(128, 512, 16)) + list(range(512, 4096, 64))
    return widths + list(range(4096, 16384 + 1, 128))


WIDTHS = _widths()


def heads_for(n_embd: int) -> int:
    """Attention heads for a width: about 64 wide from 256 up (GPT-2's head size), about 32 below,
    16 for the narrowest; always a divisor of n_embd."""
    head = 64 if n_embd >= 256 else 32 if n_embd >= 64 else 16
    divisors = [h for h in range(1, n_embd + 1) if n_embd % h == 0]
    return min(divisors, key=lambda h: (abs(h - n_embd / head), -h))


def shape_for_params(
    params: float,
    *,
    vocab_size: int,
    block_size: int,
    aspect_ratio: float = ASPECT_RATIO,
    base: GPTConfig | None = None,
) -> GPTConfig:
    """The GPTConfig whose parameter count is about `params`, with n_embd / n_layer near `aspect_ratio`.

    Depths within a layer of where a model of exactly that ratio reaches the target are tried, each
    with the widths on either side of it (counted exactly with count_params, embeddings included,
    as Chinchilla counts N); the smallest PARAM_WEIGHT * |log(count / params)| +
    |log(ratio / aspect_ratio)| wins.

    Args:
        params: the target parameter count N (total, as `count_params(...).total`).
        vocab_size: the vocabulary the model must cover.
        block_size: its context length.
        aspect_ratio: the width / depth ratio to aim for (ASPECT_RATIO, 32).
        base: the other settings (bias, tied head, dropout, activation, init) to keep; GPT-2's by default.

    Raises:
        ConfigError: a target that is not a positive finite number, or one no shape comes within
            1.5x of (below the smallest model this vocabulary and context allow, or beyond the largest).
    """
    if isinstance(params, bool) or not (isinstance(params, (int, float)) and 0 < params < math.inf):
        raise ConfigError(f"params: must be a finite number more than zero, got {params!r}")
    if isinstance(aspect_ratio, bool) or not (isinstance(aspect_ratio, (int, float)) and 0 < aspect_ratio < math.inf):
        raise ConfigError(f"aspect_ratio: must be a finite number more than zero, got {aspect_ratio!r}")
    template = dataclasses.replace(base or GPTConfig(), vocab_size=vocab_size, block_size=block_size)

    def shaped(n_layer: int, n_embd: int) -> GPTConfig:
        return dataclasses.replace(template, n_layer=n_layer, n_embd=n_embd, n_head=heads_for(n_embd))

    def count(n_layer: int, n_embd: int) -> int:
        return count_params(shaped(n_layer, n_embd)).total

    def at_ratio(n_layer: int) -> int:
        """The width nearest to aspect_ratio x n_layer."""
        return min(WIDTHS, key=lambda w: abs(w - aspect_ratio * n_layer))

    # the first depth whose ideal-ratio model reaches the target (its count rises with depth)
    lo, hi = 1, MAX_LAYERS
    while lo < hi:
        mid = (lo + hi) // 2
        if count(mid, at_ratio(mid)) >= params:
            hi = mid
        else:
            lo = mid + 1
    candidates: list[tuple[int, GPTConfig]] = []
    for n_layer in range(max(1, lo - 1), min(MAX_LAYERS, lo + 1) + 1):
        # the count rises with width: the widths on either side of the target
        i, j = 0, len(WIDTHS)
        while i < j:
            mid = (i + j) // 2
            if count(n_layer, WIDTHS[mid]) <= params:
                i = mid + 1
            else:
                j = mid
        for k in {max(0, i - 1), min(i, len(WIDTHS) - 1)}:
            cfg = shaped(n_layer, WIDTHS[k])
            candidates.append((count_params(cfg).total, cfg))

    def miss(n: int) -> float:
        return abs(math.log(n / params))

    def score(candidate: tuple[int, GPTConfig]) -> float:
        n, cfg = candidate
        return PARAM_WEIGHT * miss(n) + abs(math.log(cfg.n_embd / cfg.n_layer / aspect_ratio))

    n, best = min(candidates, key=score)
    if miss(n) > math.log(MAX_MISS):
        smallest = count_params(smallest_shape(vocab_size=vocab_size, block_size=block_size, base=template)).total
        raise ConfigError(
            f"params: no GPT shape with vocab {vocab_size:,} and context {block_size:,} has about {params:,.0f} "
            f"parameters (the smallest has {smallest:,}, the largest tried {count(MAX_LAYERS, WIDTHS[-1]):,})"
        )
    return best


def smallest_shape(*, vocab_size: int, block_size: int, base: GPTConfig | None = None) -> GPTConfig:
    """The smallest model shape_for_params considers: one layer, 16 wide, one head."""
    template = base or GPTConfig()
    return dataclasses.replace(template, vocab_size=vocab_size, block_size=block_size, n_layer=1, n_embd=WIDTHS[0],
                               n_head=heads_for(WIDTHS[0]))
