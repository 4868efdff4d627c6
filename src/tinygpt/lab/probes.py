"""Probes: what a model's heads do, measured while it trains (induction heads, previous-token heads).

An induction head (Olsson et al., "In-context Learning and Induction Heads", 2022) completes a
repeat: at a token seen before, it attends to the position just after that token's earlier
occurrence and copies what came next. It needs a previous-token head in an earlier layer, which
writes into each position which token preceded it, so that the induction head's query (the current
token) can match a key (the token before the key's position). The probes measure both on sequences
of distinct random tokens repeated once, where the second copy can only be predicted by looking back:

- induction score of a head: its mean attention, from each query in the second copy, on the key
  just after the query token's earlier occurrence (1.0 for a perfect induction head);
- previous-token score: its mean attention on the position just before the query (1.0 for a
  perfect previous-token head);
- second-copy loss and accuracy: the model's next-token loss and greedy accuracy on the second copy;
- in-context learning score (on validation text): the loss late in the context minus the loss early
  in it (negative when the context helps).

`Probes` is a TrainCallback that logs them to metrics.jsonl every N steps under torch.no_grad(),
with its own random generator, so the run trains exactly as it would without them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ..data.batches import get_batch
from ..data.folder import load_data
from ..errors import ConfigError, TrainingError
from ..train.callbacks import RunStart, TrainCallback, TrainResult

PROBE_SEQUENCES = 32  # repeated sequences per probe: the scores' noise is about 1/sqrt(32 x period)
ICL_WINDOWS = 16  # validation windows per in-context learning score


def repeated_tokens(vocab_size: int, period: int, n: int, generator: torch.Generator, *, copies: int = 2) -> torch.Tensor:
    """n sequences, each `period` distinct random token ids repeated `copies` times: (n, copies x period)."""
    if not 2 <= period <= vocab_size:
        raise ConfigError(f"a repeated sequence needs 2..{vocab_size} distinct tokens (the vocabulary), got {period}")
    rows = torch.stack([torch.randperm(vocab_size, generator=generator)[:period] for _ in range(n)])
    return rows.repeat(1, copies)


def _check_weights(weights: torch.Tensor) -> int:
    if weights.dim() < 2 or weights.shape[-1] != weights.shape[-2]:
        raise ConfigError(f"expected attention weights (..., T, T), got shape {tuple(weights.shape)}")
    return weights.shape[-1]


def induction_scores(weights: torch.Tensor, period: int) -> torch.Tensor:
    """Each head's induction score on sequences that repeat every `period` tokens.

    Args:
        weights: attention weights (..., T, T), rows the queries, on such sequences.
        period: the repeat's length (2 <= period < T).

    Returns:
        (...): the mean weight, over the queries i >= period, on the key i - period + 1 (the token
        after the query token's latest earlier occurrence).
    """
    t = _check_weights(weights)
    if not 2 <= period < t:
        raise ConfigError(f"the period must be 2..{t - 1} for sequences of {t} tokens, got {period}")
    return weights.diagonal(offset=-(period - 1), dim1=-2, dim2=-1)[..., 1:].float().mean(-1)


def previous_token_scores(weights: torch.Tensor) -> torch.Tensor:
    """Each head's previous-token score: the mean weight, over the queries i >= 1, on the key i - 1.

    Args:
        weights: attention weights (..., T, T), T >= 2.
    """
    if _check_weights(weights) < 2:
        raise ConfigError("a previous-token score needs sequences of 2 tokens or more")
    return weights.diagonal(offset=-1, dim1=-2, dim2=-1).float().mean(-1)


def second_copy(logits: torch.Tensor, tokens: torch.Tensor, period: int) -> tuple[float, float]:
    """The next-token loss (nats) and greedy accuracy on the second copy of repeated sequences.

    The targets are the second copy's tokens after its first (whose arrival no model can know from
    sequences of distinct tokens), each predicted from the position before it.

    Args:
        logits: (B, T, vocab) for `tokens` (B, T), T >= period + 2.
        period: the repeat's length.
    """
    if tokens.shape[1] < period + 2:
        raise ConfigError(f"sequences of {tokens.shape[1]} tokens hold no second copy of a period {period}")
    pred = logits[:, period:-1].float()
    target = tokens[:, period + 1:]
    loss = F.cross_entropy(pred.reshape(-1, pred.shape[-1]), target.reshape(-1)).item()
    accuracy = (pred.argmax(-1) == target).float().mean().item()
    return loss, accuracy


def probe_tokens(block_size: int, vocab_size: int, period: int | None, sequences: int,
                 generator: torch.Generator) -> tuple[int, torch.Tensor]:
    """The repeat's length (default: half the context, at most the vocabulary) and `sequences`
    repeated sequences of it (repeated_tokens) for a model of this context and vocabulary."""
    period = period or min(block_size // 2, vocab_size)
    if period < 2 or 2 * period > block_size or period > vocab_size:
        raise ConfigError(f"probe period {period}: two copies must fit the context of {block_size} tokens and "
                          f"its tokens be distinct among the vocabulary's {vocab_size} (2 or more each)")
    return period, repeated_tokens(vocab_size, period, sequences, generator)


@torch.no_grad()
def probe(model: torch.nn.Module, tokens: torch.Tensor, period: int, icl: torch.Tensor | None = None) -> dict[str, Any]:
    """Measure a model on repeated sequences (and validation windows): one probe record.

    Args:
        model: a tinygpt GPT (put in eval mode for the measurement, then back as it was).
        tokens: (B, T) repeated sequences of distinct tokens (repeated_tokens), T <= block_size.
        period: their repeat's length.
        icl: (B, T') validation windows of T' + 1 tokens for the in-context learning score, or None.

    Returns:
        {"period", "induction": [[per head] per layer], "previous_token": [[...]], "second_copy_loss",
        "second_copy_accuracy", "icl_score" (None without windows)}, JSON-ready.
    """
    was_training = model.training
    model.eval()
    try:
        device = next(model.parameters()).device
        tokens = tokens.to(device)
        logits, weights = model(tokens, return_attention=True)
        att = torch.stack(weights, dim=1)  # (B, n_layer, n_head, T, T)
        induction = induction_scores(att, period).mean(0)
        previous = previous_token_scores(att).mean(0)
        loss, accuracy = second_copy(logits, tokens, period)
        icl_score = None
        if icl is not None:
            x, y = icl[:, :-1].to(device), icl[:, 1:].to(device)
            out = model(x).float()
            per_position = F.cross_entropy(out.transpose(1, 2), y, reduction="none").mean(0)  # (T,)
            quarter = max(1, per_position.shape[0] // 4)
            icl_score = (per_position[-quarter:].mean() - per_position[:quarter].mean()).item()
    finally:
        model.train(was_training)
    return {
        "period": period,
        "induction": [[round(v, 5) for v in row] for row in induction.tolist()],
        "previous_token": [[round(v, 5) for v in row] for row in previous.tolist()],
        "second_copy_loss": loss,
        "second_copy_accuracy": accuracy,
        "icl_score": icl_score,
    }


def probe_heads(model: torch.nn.Module, vocab_size: int, period: int | None = None, *,
                sequences: int = PROBE_SEQUENCES, seed: int = 0) -> tuple[dict[str, Any], torch.Tensor]:
    """Probe a trained model once (what `tinygpt inspect heads` shows): the probe record and the
    repeated sequences it measured (probe_tokens, drawn from `seed`), ids below vocab_size."""
    vocab_size = min(vocab_size, model.config.vocab_size)
    period, tokens = probe_tokens(model.config.block_size, vocab_size, period, sequences,
                                  torch.Generator().manual_seed(seed))
    return probe(model, tokens, period), tokens


def best_head(scores: list[list[float]]) -> tuple[int, int, float]:
    """(layer, head, score) of the highest per-head score in a probe's "induction" or "previous_token"."""
    layer, head = max(((li, hi) for li, row in enumerate(scores) for hi in range(len(row))),
                      key=lambda lh: scores[lh[0]][lh[1]])
    return layer, head, scores[layer][head]


class Probes(TrainCallback):
    """Probe the model every `every` steps (and before the first and after the last) and log each
    probe as a metrics.jsonl line {"step", "tokens", "probe": probe(...)}.

    The probe sequences are drawn once, from a generator of their own, so every probe measures the
    same sequences and the run's random streams are untouched: with and without probes a run
    trains bitwise alike (CPU, float32).

    Args:
        every: steps between probes.
        data: the run's data folder: the in-context learning score's validation windows come from
            it, and the probe tokens from its vocabulary. None: no ICL score, the model's vocabulary.
        period: the repeat's length (default: half the context; probe_tokens).
        sequences: repeated sequences per probe.
        seed: the probe's generator.
    """

    def __init__(self, every: int, *, data: str | Path | None = None, period: int | None = None,
                 sequences: int = PROBE_SEQUENCES, seed: int = 0) -> None:
        if every < 1:
            raise ConfigError(f"the probe interval must be >= 1 step, got {every}")
        self.every, self.period, self.sequences, self.seed = every, period, sequences, seed
        self.dataset = load_data(data) if data is not None else None
        self.model = self.log = None
        self.last = -1

    def on_start(self, start: RunStart) -> None:
        if start.model is None or start.log is None:
            raise TrainingError("Probes needs a RunStart with the model and the metrics log")
        self.model, self.log = start.model, start.log
        config = self.model.config
        vocab = self.dataset.vocab_size if self.dataset is not None else config.vocab_size
        vocab = min(vocab, config.vocab_size)
        generator = torch.Generator().manual_seed(self.seed)
        self.period, self.tokens = probe_tokens(config.block_size, vocab, self.period, self.sequences, generator)
        self.icl = None
        if self.dataset is not None and not self.dataset.is_chat and len(self.dataset.val) > config.block_size:
            offsets = torch.randint(0, len(self.dataset.val) - config.block_size, (ICL_WINDOWS,), generator=generator)
            x, y = get_batch(self.dataset.val, offsets, config.block_size)
            self.icl = torch.cat([x, y[:, -1:]], dim=1)
        if start.step == 0:
            self._probe(0, 0)

    def on_step(self, record: dict[str, Any], total: int | None) -> None:
        if record["step"] % self.every == 0:
            self._probe(record["step"], record["tokens"])

    def on_end(self, result: TrainResult, model: torch.nn.Module) -> None:
        if result.step != self.last:
            self._probe(result.step, result.tokens)

    def _probe(self, step: int, tokens: int) -> None:
        self.log({"step": step, "tokens": tokens, "probe": probe(self.model, self.tokens, self.period, self.icl)})
        self.last = step


def summarize(probes: list[tuple[int, dict[str, Any]]], threshold: float = 0.5) -> dict[str, Any]:
    """A run's probes as curves: steps, second-copy loss and accuracy, the best head's induction and
    previous-token scores at each step, and the phase change: the first step where the best induction
    score reaches `threshold` (None if it never does).

    Args:
        probes: (step, probe record) pairs in step order, as tinygpt.lab.viz.read_metrics reads them.
    """
    steps = [s for s, _ in probes]
    induction = [best_head(p["induction"])[2] for _, p in probes]
    crossed = [s for s, v in zip(steps, induction) if v >= threshold]
    return {
        "steps": steps,
        "second_copy_loss": [p["second_copy_loss"] for _, p in probes],
        "second_copy_accuracy": [p["second_copy_accuracy"] for _, p in probes],
        "induction_score": induction,
        "previous_token_score": [best_head(p["previous_token"])[2] for _, p in probes],
        "icl_score": [p.get("icl_score") for _, p in probes],
        "phase_change_step": crossed[0] if crossed else None,
    }


__all__ = ["Probes", "best_head", "probe_tokens", "induction_scores", "previous_token_scores", "probe",
           "probe_heads", "repeated_tokens", "second_copy", "summarize"]
