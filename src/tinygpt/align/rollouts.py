"""Rollouts: groups of completions sampled from a policy, batched, on tinygpt's own decoding, and the
log-probabilities a policy-gradient loss takes of them.

    sample_groups(model, prompts, group, max_new_tokens, ...)   every prompt's group of completions, all
                                                                 rows decoding together with one KV cache
    completion_logps(model, rollouts, temperature)              each completion token's log-probability under
                                                                 a model, with its gradient (one forward pass)

A prompt is prefilled once (generate.prefill, the prompts of one length together) and its keys and values
copied into its group's rows; then every row takes its decode steps together (generate.decode_step), at
one position when the prompts share a length (the decoding fast path) or each at its own. The choice is
sampling's own (process_logits, choose). A completion ends at a stop token, which it keeps and its mask
counts (TRL's completion mask), or after max_new_tokens (truncated).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from ..config.sampling import SampleConfig
from ..errors import ConfigError
from ..generate import decode_step, prefill
from ..kv_cache import KVCache
from ..sampling import choose, process_logits


@dataclass
class Rollouts:
    """Completions of prompts, a group of rows per prompt, next to each other.

    Args:
        prompts: each row's prompt ids (a group's rows share one list).
        completions: (N, L) the ids each row wrote; after its stop token, the stop token again.
        mask: (N, L) 1 on a row's tokens up to and including its stop token, 0 after.
        logps: (N, L) each token's log-probability under the sampling policy (its logits over the
            temperature, as TRL scores them), 0 where the mask is.
        truncated: (N,) the rows that reached max_new_tokens without a stop token.
    """

    prompts: list[list[int]]
    completions: torch.Tensor
    mask: torch.Tensor
    logps: torch.Tensor
    truncated: torch.Tensor

    def __len__(self) -> int:
        return len(self.prompts)

    def ids(self, row: int) -> list[int]:
        """Row `row`'s completion, its stop token included."""
        return self.completions[row, : int(self.mask[row].sum())].tolist()

    @property
    def lengths(self) -> torch.Tensor:
        """(N,) each completion's tokens, its stop token counted."""
        return self.mask.sum(dim=1)


def check_room(model, prompts: Iterable[list[int]], max_new_tokens: int) -> None:
    """Refuse a prompt that leaves no room for max_new_tokens in the model's context.

    Args:
        model: the policy (its config's block_size).
        prompts: prompt ids.
        max_new_tokens: the completion's most tokens.

    Raises:
        ConfigError: naming the longest prompt.
    """
    longest = max((len(p) for p in prompts), default=0)
    block = model.config.block_size
    if longest + max_new_tokens > block:
        raise ConfigError(f"a prompt of {longest} tokens and {max_new_tokens} new ones exceed the model's context of "
                          f"{block} tokens: a lower --max-completion-length, or shorter prompts")
    if any(len(p) == 0 for p in prompts):
        raise ConfigError("a prompt of no tokens: every prompt needs at least one")


@torch.no_grad()
def sample_groups(model, prompts: list[list[int]], group: int, max_new_tokens: int, *,
                  config: SampleConfig = SampleConfig(), stop_tokens: Iterable[int] = (),
                  generator: torch.Generator | None = None, vocab_size: int | None = None) -> Rollouts:
    """Sample `group` completions of each prompt, every row decoding in one batch with the KV cache.

    Args:
        model: a tinygpt GPT (it decodes in eval mode and is put back in the mode it was in).
        prompts: the prompts' ids, each at least one token.
        group: completions per prompt (num_generations).
        max_new_tokens: the most tokens a completion has.
        config: the sampling settings (temperature, top_k, top_p; greedy for an evaluation).
        stop_tokens: ids that end a completion (EOS, a task's end of answer).
        generator: the draws' generator (a seeded one repeats the rollouts).
        vocab_size: the tokenizer's vocabulary: ids at or past it are never chosen.

    Returns:
        Rollouts of len(prompts) x group rows, prompt i's completions at rows i x group .. (i + 1) x group - 1.

    Raises:
        ConfigError: a prompt that leaves no room for max_new_tokens in the context.
    """
    check_room(model, prompts, max_new_tokens)
    training = model.training
    model.eval()  # no dropout: a seeded rollout repeats
    try:
        return _sample(model, prompts, group, max_new_tokens, config, stop_tokens, generator, vocab_size)
    finally:
        model.train(training)


def _sample(model, prompts: list[list[int]], group: int, max_new_tokens: int, config: SampleConfig,
            stop_tokens: Iterable[int], generator: torch.Generator | None, vocab_size: int | None) -> Rollouts:
    device = model.wte.weight.device
    rows = len(prompts) * group
    lengths = torch.tensor([len(p) for p in prompts], device=device).repeat_interleave(group)  # (N,)
    cache = KVCache.for_model(model, rows, int(lengths.max()) + max_new_tokens)
    logits = _prefill_groups(model, prompts, group, cache)  # (N, V)
    stops = torch.tensor(sorted(set(stop_tokens)), dtype=torch.long, device=device)
    same = bool((lengths == lengths[0]).all())
    tokens, logps = [], []
    finished = torch.zeros(rows, dtype=torch.bool, device=device)
    for step in range(max_new_tokens):
        if step > 0:
            pos = int(lengths[0]) + step - 1 if same else lengths + step - 1
            logits = decode_step(model, tokens[-1], cache, pos)
        token = choose(process_logits(logits, None, config, vocab_size), config, generator)
        token = torch.where(finished, tokens[-1], token) if step > 0 else token  # an ended row repeats its stop
        scaled = logits.float() if config.is_greedy else logits.float() / config.temperature
        logps.append(torch.log_softmax(scaled, dim=-1).gather(1, token.unsqueeze(1)).squeeze(1))
        tokens.append(token)
        was_finished = finished
        finished = finished | torch.isin(token, stops)
        logps[-1] = torch.where(was_finished, 0.0, logps[-1])
        if bool(finished.all()):
            break
    completions = torch.stack(tokens, dim=1)
    ended = torch.isin(completions, stops)
    # 1 up to and including the first stop token (TRL's completion mask)
    mask = (ended.long().cumsum(dim=1) - ended.long()) == 0
    return Rollouts([p for p in prompts for _ in range(group)], completions, mask.long(),
                    torch.stack(logps, dim=1) * mask, ~ended.any(dim=1))


def _prefill_groups(model, prompts: list[list[int]], group: int, cache: KVCache) -> torch.Tensor:
    """Each prompt's forward pass once, the prompts of one length together, its keys and values copied into
    its group's rows of `cache`; the logits (N, V) after each row's prompt."""
    device = cache.k.device
    by_length: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        by_length.setdefault(len(p), []).append(i)
    out = None
    for length, which in by_length.items():
        ids = torch.tensor([prompts[i] for i in which], dtype=torch.long, device=device)
        part = KVCache.for_model(model, len(which), length)
        logits = prefill(model, ids, part)  # (P, V)
        rows = (torch.tensor(which, device=device).unsqueeze(1) * group + torch.arange(group, device=device)).view(-1)
        cache.k[:, rows, :, :length] = part.k.repeat_interleave(group, dim=1)
        cache.v[:, rows, :, :length] = part.v.repeat_interleave(group, dim=1)
        if out is None:
            out = logits.new_empty(len(prompts) * group, logits.shape[-1])
        out[rows] = logits.repeat_interleave(group, dim=0)
    return out


def completion_logps(model, rollouts: Rollouts, temperature: float = 1.0) -> torch.Tensor:
    """Each completion token's log-probability under `model` (N, L), its logits over the temperature as
    the sampling policy's are, in one forward pass of every row's prompt and completion (right-padded:
    a causal model's positions never see the padding after them). Gradients flow where the caller allows.

    Args:
        model: a tinygpt GPT (or a wrapper that calls one).
        rollouts: what sample_groups returned.
        temperature: the sampling temperature (1 for greedy rollouts).
    """
    completions = rollouts.completions
    n, width = completions.shape
    device = completions.device
    starts = torch.tensor([len(p) for p in rollouts.prompts], device=device)  # (N,)
    seq = int(starts.max()) + width - 1  # the last completion token is a target, never an input
    inputs = torch.zeros(n, seq, dtype=torch.long, device=device)
    for i, p in enumerate(rollouts.prompts):
        inputs[i, : len(p)] = torch.tensor(p, device=device)
    at = starts.unsqueeze(1) + torch.arange(width - 1, device=device)  # where completion tokens 0..L-2 go
    inputs.scatter_(1, at, completions[:, :-1])
    logits = model(inputs)  # (N, seq, V)
    where = (starts - 1).unsqueeze(1) + torch.arange(width, device=device)  # the position predicting token t
    picked = logits.gather(1, where.unsqueeze(-1).expand(-1, -1, logits.shape[-1])).float() / temperature
    return torch.log_softmax(picked, dim=-1).gather(2, completions.unsqueeze(-1)).squeeze(-1)
