"""Logits -> next token. Pure tensor code: the tokenizer's vocabulary, repetition penalty, temperature,
top-k, top-p, sampling."""

from __future__ import annotations

import torch

from .config.sampling import SampleConfig


def apply_repetition_penalty(logits: torch.Tensor, tokens: torch.Tensor, alpha: float) -> torch.Tensor:
    """For ids present in `tokens` (B, T): positive logits / alpha, negative logits * alpha."""
    if alpha == 1.0 or tokens.numel() == 0:
        return logits
    # Past 1e6 either way a seen token is already as good as banned (or forced); clamping keeps
    # extreme settings from overflowing the logits to inf (or 0 * inf = NaN) in float32.
    alpha = min(max(alpha, 1e-6), 1e6)
    seen = torch.gather(logits, 1, tokens)
    seen = torch.where(seen > 0, seen / alpha, seen * alpha)
    return logits.scatter(1, tokens, seen)


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the k largest logits of each row (ties with the k-th kept too); the rest become -inf."""
    if k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Nucleus filter: keep the most likely tokens until their probability reaches p (the top one always)."""
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    drop_sorted = mass_before >= p
    # The first token has no mass before it, but a p below float32's smallest value (1e-300) rounds to
    # 0 in the comparison and would drop it too: keep it explicitly.
    drop_sorted[..., 0] = False
    drop = drop_sorted.scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def mask_vocab(logits: torch.Tensor, vocab_size: int | None) -> torch.Tensor:
    """Ids at or past `vocab_size` become -inf: a model's vocabulary may be padded past its tokenizer's
    (`train --vocab-size 64` on 28 characters), and an id the tokenizer cannot decode must never be chosen.

    Args:
        logits: (B, V) logits.
        vocab_size: the tokenizer's vocabulary size; None (or >= V) changes nothing.
    """
    if vocab_size is None or vocab_size >= logits.shape[-1]:
        return logits
    if vocab_size < 1:
        raise ValueError(f"vocab_size: must be >= 1, got {vocab_size}")
    return torch.cat([logits[..., :vocab_size], torch.full_like(logits[..., vocab_size:], float("-inf"))], dim=-1)


def process_logits(
    logits: torch.Tensor, tokens: torch.Tensor | None, cfg: SampleConfig, vocab_size: int | None = None
) -> torch.Tensor:
    """The logits the choice is made from: the vocabulary mask, penalty, then (unless greedy) temperature,
    top-k, top-p.

    Args:
        logits: (B, V) raw logits.
        tokens: (B, T) ids so far (for the repetition penalty), or None.
        cfg: the sampling settings.
        vocab_size: the tokenizer's vocabulary size: ids at or past it are never chosen (see mask_vocab).
    """
    logits = mask_vocab(logits.float(), vocab_size)
    if tokens is not None:
        logits = apply_repetition_penalty(logits, tokens, cfg.repetition_penalty)
    if cfg.is_greedy:
        return logits
    logits = logits / cfg.temperature
    if cfg.top_k is not None:
        logits = top_k_filter(logits, cfg.top_k)
    if cfg.top_p is not None:
        logits = top_p_filter(logits, cfg.top_p)
    return logits


def sample(
    logits: torch.Tensor,
    tokens: torch.Tensor | None,
    cfg: SampleConfig,
    generator: torch.Generator | None = None,
    vocab_size: int | None = None,
) -> torch.Tensor:
    """Choose the next token of each row. logits (B, V), tokens so far (B, T) -> (B,) ids below vocab_size."""
    return choose(process_logits(logits, tokens, cfg, vocab_size), cfg, generator)


def choose(processed: torch.Tensor, cfg: SampleConfig, generator: torch.Generator | None = None) -> torch.Tensor:
    """The choice itself, from logits process_logits already shaped: argmax when greedy, else a draw."""
    if cfg.is_greedy:
        return processed.argmax(dim=-1)
    probs = processed.softmax(dim=-1)
    # On a CPU multinomial refuses such probabilities with a RuntimeError, so they are checked only then (no
    # work per token); CUDA's checks them inside its kernel, where a NaN is a device-side assert that ends
    # the process's use of the GPU: there they are checked first
    if probs.device.type != "cpu" and not bool(torch.isfinite(probs).all()):
        raise ValueError(NONFINITE)
    try:
        return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    except RuntimeError:
        if not bool(torch.isfinite(probs).all()):
            raise ValueError(NONFINITE) from None
        raise


NONFINITE = ("the next-token probabilities are NaN or infinite: the model's output is not finite "
             "(non-finite weights, loaded with allow_nonfinite?)")


def noise(width: int, generator: torch.Generator | None = None, device: torch.device | None = None) -> torch.Tensor:
    """The random numbers `choose` draws for one row of `width` ids, (1, width): an Exp(1) number an id, taken
    from the generator as torch.multinomial takes them for one sample."""
    return torch.empty(1, width, device=device).exponential_(1, generator=generator)


def choose_with(processed: torch.Tensor, drawn: torch.Tensor) -> torch.Tensor:
    """`choose`'s draws from rows of logits (R, V) with their random numbers given, (R, V) from `noise`: the id
    of the largest p / e, the exponential race torch.multinomial runs for one sample (the Gumbel-max trick), so
    a draw made ahead of its step (a speculative round's) is the one the step makes from the same generator
    (a test holds them equal). Returns (R,)."""
    probs = processed.softmax(dim=-1)
    if not bool(torch.isfinite(probs).all()):
        raise ValueError(NONFINITE)
    return (probs / drawn).argmax(dim=-1)
