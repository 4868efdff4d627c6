"""Log-probabilities: a token's under the model's own distribution (a generated token's, with the most likely
candidates at its step), and a prompt's tokens scored each with as much left context as the model holds
(`echo` with `logprobs`)."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch

from ..sampling import mask_vocab

# A logprob that does not fit JSON (-inf) is reported as this.
MIN_LOGPROB = -9999.0


@dataclass
class TokenInfo:
    """One generated token with its log-probability and the most likely candidates at that step."""

    id: int
    logprob: float | None  # None for a prompt's first token, which nothing predicts
    top: list[tuple[int, float]] | None
    offset: int = 0  # characters of text before this token's own, counted from the start of its sequence's text


def token_info(logits: torch.Tensor, token: int, top: int, offset: int = 0) -> TokenInfo:
    """The model's own distribution (before temperature, penalties and filters) at this step."""
    return token_infos(torch.log_softmax(logits, dim=-1), [token], top, [offset])[0]


def token_infos(logprobs: torch.Tensor, tokens: list[int], top: int, offsets: list[int]) -> list[TokenInfo]:
    """TokenInfo for each row of logprobs (N, V): the logprob of tokens[i] and the `top` most likely ids."""
    chosen = logprobs.gather(-1, torch.tensor(tokens, device=logprobs.device).view(-1, 1))[:, 0].tolist()
    best: list[list[tuple[int, float]]] = [[] for _ in tokens]
    if top:
        values, ids = torch.topk(logprobs, min(top, logprobs.shape[-1]), dim=-1)
        best = [[(i, _json_logprob(v)) for i, v in zip(row_ids, row_values)]
                for row_ids, row_values in zip(ids.tolist(), values.tolist())]
    return [TokenInfo(t, _json_logprob(lp), b, o) for t, lp, b, o in zip(tokens, chosen, best, offsets)]


def scoring_windows(length: int, block: int) -> list[tuple[int, int]]:
    """How a prompt of `length` tokens is scored so that each token is predicted from as much left
    context as the model holds, min(its position, block) tokens: the first window reads the prompt's
    start and scores every token it predicts; past it, the window slides one token at a time and
    scores only its last prediction. A token's logprob then does not depend on how much text before
    its context the client sent (consecutive windows, as `tinygpt eval` cuts a text, gave the first
    tokens of each window almost no context, and an evaluation harness's answers moved by nats with
    the length it cut its prompts to).

    Returns (end, scored) pairs: a window reads ids[max(0, end - block) : end] and scores the last
    `scored` tokens it predicts, ids[end - scored + 1 : end + 1].
    """
    if length < 2:
        return []
    first = min(block, length - 1)
    return [(first, first)] + [(end, 1) for end in range(first + 1, length)]


def score_windows(model, ids: list[int], windows: list[tuple[int, int]], top: int, offsets: list[int],
                  vocab_size: int | None = None) -> list[TokenInfo]:
    """The logprob of every token the windows score (see scoring_windows), in order.

    Args:
        model: a tinygpt GPT (called on the model thread).
        ids: the whole prompt.
        windows: (end, scored) pairs from scoring_windows, in order.
        top: how many most likely alternatives to report with each token.
        offsets: each token's text offset (see TokenInfo.offset).
        vocab_size: the tokenizer's vocabulary: logprobs are over its ids, as for generated tokens.
    """
    block = model.config.block_size
    device = next(model.parameters()).device
    infos: list[TokenInfo] = []
    with torch.inference_mode():
        # windows of one length that score alike run as one batch: the sliding ones, a full context each
        for (length, scored), group in itertools.groupby(windows, key=lambda w: (min(w[0], block), w[1])):
            ends = [end for end, _ in group]
            x = torch.tensor([ids[end - length : end] for end in ends], device=device)
            logits = model(x, last_only=scored == 1)[:, -scored:].float()  # (B, scored, V)
            logprobs = torch.log_softmax(mask_vocab(logits, vocab_size), dim=-1).reshape(-1, logits.shape[-1])
            targets = [t for end in ends for t in range(end - scored + 1, end + 1)]
            infos += token_infos(logprobs, [ids[t] for t in targets], top, [offsets[t] for t in targets])
    return infos


def _json_logprob(value: float) -> float:
    return value if math.isfinite(value) and value > MIN_LOGPROB else MIN_LOGPROB
