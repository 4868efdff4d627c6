"""The lesson's worked examples, computed with tinygpt's own objects.

Each function returns what the lesson prints, so tests can compare against the lesson's code and
`tinygpt lesson` can show it step by step. The seeds and sizes are the lesson's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import GPTConfig
from .generate import generate_stream
from .model import GPT, attention, lm_loss

LESSON_SEED = 42


def causal_mask(T: int = 5) -> torch.Tensor:
    """The lower-triangular mask: row t has ones at the positions token t may attend to."""
    return torch.tril(torch.ones(T, T)).int()


@dataclass
class AttentionTrace:
    scores: torch.Tensor  # (T, T) raw scores Q K^T / sqrt(d_k), before the mask
    weights: torch.Tensor  # (T, T) after the mask and the softmax
    out: torch.Tensor  # (T, d_k) weights @ V


def attention_trace(seed: int = 7, d_k: int = 4, T: int = 4) -> AttentionTrace:
    """One head's causal attention on random Q, K, V drawn in the lesson's order (Q, then K, then V)."""
    torch.manual_seed(seed)
    q, k, v = torch.randn(T, d_k), torch.randn(T, d_k), torch.randn(T, d_k)
    out, weights = attention(q, k, v, explicit=True)
    scores = (q @ k.T) / d_k**0.5
    return AttentionTrace(scores=scores, weights=weights, out=out)


def lesson_model(seed: int = LESSON_SEED, **overrides) -> GPT:
    """TinyGPT: the `lesson` preset (vocab 50, d 64, 4 heads, 2 layers, context 8) built under `seed`."""
    torch.manual_seed(seed)
    return GPT(GPTConfig.from_preset("lesson", **overrides))


def clm_training(steps: int = 20, seed: int = LESSON_SEED, lr: float = 1e-3) -> list[float]:
    """The lesson's CLM loop: 8 random sequences of 8 tokens, input = x[:, :-1], target = x[:, 1:], Adam.

    Returns the loss of every step (the lesson prints steps 1, 5, 10 and 20).
    """
    model = lesson_model(seed)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    cfg = model.config
    data = torch.randint(0, cfg.vocab_size, (8, cfg.block_size))
    inp, tgt = data[:, :-1], data[:, 1:]
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = lm_loss(model(inp), tgt)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@dataclass
class GenerationStep:
    context: list[int]  # what the model saw (the last block_size tokens)
    token: int  # the argmax of the last position's logits


def greedy_steps(start: list[int] = [5, 12, 3], max_new: int = 5, seed: int = LESSON_SEED) -> list[GenerationStep]:
    """Greedy generation from `start` with a freshly built TinyGPT, one record per step."""
    model = lesson_model(seed)
    tokens = list(start)
    steps = []
    for token in generate_stream(model, torch.tensor([start]), max_new, greedy=True):
        steps.append(GenerationStep(context=tokens[-model.config.block_size :], token=int(token[0])))
        tokens.append(int(token[0]))
    return steps
