"""Logits -> next token. Pure tensor code: repetition penalty, temperature, top-k, top-p, sampling."""

from __future__ import annotations

import torch

from .config import SampleConfig


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
    drop_sorted = mass_before >= p  # the first token has nothing before it, so it always stays
    drop = drop_sorted.scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def process_logits(logits: torch.Tensor, tokens: torch.Tensor | None, cfg: SampleConfig) -> torch.Tensor:
    """The logits the choice is made from: penalty, then (unless greedy) temperature, top-k, top-p."""
    logits = logits.float()
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
) -> torch.Tensor:
    """Choose the next token of each row. logits (B, V), tokens so far (B, T) -> (B,) ids."""
    return choose(process_logits(logits, tokens, cfg), cfg, generator)


def choose(processed: torch.Tensor, cfg: SampleConfig, generator: torch.Generator | None = None) -> torch.Tensor:
    """The choice itself, from logits process_logits already shaped: argmax when greedy, else a draw."""
    if cfg.is_greedy:
        return processed.argmax(dim=-1)
    probs = processed.softmax(dim=-1)
    try:
        return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    except RuntimeError:
        if not bool(torch.isfinite(probs).all()):  # checked only on failure: no extra work per token
            raise ValueError("the next-token probabilities are NaN or infinite: the model's output is not finite "
                             "(non-finite weights, loaded with allow_nonfinite?)") from None
        raise
