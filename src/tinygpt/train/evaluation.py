"""Scoring a model on held-out text for the commands and reports (`tinygpt eval`, a fine-tune's before
and after): the loss over a whole token stream (evaluate), over a chat split's assistant tokens
(evaluate_chat), and what a loss comes to in perplexity and bits (eval_report). A run's own
evaluation, on sampled batches as it trains, is its objective's (tinygpt.train.objectives)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from ..data.batches import Batches
from ..data.folder import DataSet
from ..device import autocast
from ..errors import TrainingError
from ..model import GPT
from .objectives import batch_loss


@torch.no_grad()
def evaluate(
    model: GPT,
    tokens: np.ndarray,
    *,
    batch_size: int = 8,
    device=None,
    dtype=torch.float32,
    segments: list[tuple[int, int]] | None = None,
    block_size: int | None = None,
) -> dict:
    """Loss over a whole token stream, cut into consecutive windows of block_size + 1 tokens.

    Args:
        model: the GPT.
        tokens: the token ids.
        batch_size: windows per forward pass.
        device, dtype: where and in which autocast dtype to run (the model's device, float32).
        segments: (start, end) ranges of `tokens` to score as separate texts: no window crosses
            from one into the next, and each one's first token is not predicted (it has no
            context). Default: the whole stream as one text.
        block_size: the windows' length (a fine-tune's training window); default the model's context.

    Returns {"loss": mean nats per predicted token, "tokens": predicted tokens, "nll": total nats}.
    """
    device = device or next(model.parameters()).device
    block = block_size or model.config.block_size
    n = len(tokens)
    segments = [(0, n)] if segments is None else segments
    # (start, length) of each window: `length` inputs tokens[s:s+length], targets one token later
    windows = [(s, min(block, end - 1 - s)) for start, end in segments for s in range(start, end - 1, block)]
    if not windows:
        what = f"got {n}" if len(segments) == 1 else "in a row between the characters left out"
        raise TrainingError(f"need at least 2 tokens to evaluate, {what}")
    total, count = 0.0, 0
    for i in range(0, len(windows), batch_size):
        # the last window of a text may be shorter: evaluate same-length windows together
        for length, group in _group_by_length(windows[i : i + batch_size]):
            x = torch.stack([torch.from_numpy(np.asarray(tokens[s : s + length], dtype=np.int64)) for s in group])
            y = torch.stack([torch.from_numpy(np.asarray(tokens[s + 1 : s + length + 1], dtype=np.int64))
                             for s in group])
            with autocast(device, dtype):
                logits = model(x.to(device))
            total += torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]).float(), y.to(device).reshape(-1), reduction="sum"
            ).item()
            count += y.numel()
    return {"loss": total / count, "tokens": count, "nll": total}


@torch.no_grad()
def evaluate_chat(
    model: GPT, dataset: DataSet, split: str = "val", *, batch_size: int = 8, device=None, dtype=torch.float32,
    conversations: int | None = None, block_size: int | None = None,
) -> dict:
    """Loss on chat data's assistant tokens only (the loss mask), as training's evaluation counts it:
    each conversation alone (packed rows, Batches), every trained target of the split once.

    Args:
        model: the GPT.
        dataset: a chat data folder (load_data).
        split: "train" or "val".
        batch_size: packed rows per forward pass.
        device, dtype: as for evaluate().
        conversations: score only the split's first N conversations (default all).
        block_size: the packed rows' length (a fine-tune's training window); default the model's context.

    Returns {"loss": mean nats per trained token, "tokens": trained tokens, "nll": total nats,
    "bytes" and "chars": the UTF-8 bytes and characters of the assistant's text those tokens spell
    (special tokens left out)}.
    """
    if not dataset.is_chat:
        raise TrainingError(f"{dataset.path} is not chat data (prepare it with --format chat)")
    device = device or next(model.parameters()).device
    tokens, mask, starts = getattr(dataset, split), dataset.masks[split], dataset.starts[split]
    if conversations is not None and conversations < len(starts):
        end = int(starts[conversations])
        tokens, mask, starts = tokens[:end], mask[:end], starts[:conversations]
    batches = Batches(tokens, block_size or model.config.block_size, mask, starts)
    special = set(dataset.tokenizer.special_ids().values())
    total, count, text = 0.0, 0, b""
    for i in range(0, len(batches.rows), batch_size):
        x, y, w, documents = batches.get(torch.arange(i, min(i + batch_size, len(batches.rows))))
        with autocast(device, dtype):  # the training loss: the mean over the batch's trained targets
            loss = batch_loss(model, (x, y, w, documents), device)
        keep = w.reshape(-1) > 0
        total += loss.item() * int(keep.sum())
        count += int(keep.sum())
        text += dataset.tokenizer.decode_bytes([t for t in y.reshape(-1)[keep].tolist() if t not in special])
    if not count:
        raise TrainingError(f"the {split} split of {dataset.path} has no assistant tokens to score")
    return {"loss": total / count, "tokens": count, "nll": total, "bytes": len(text),
            "chars": len(text.decode("utf-8", errors="replace"))}


def conversations_within(dataset: DataSet, n_tokens: int, split: str = "val") -> int:
    """How many of a chat split's first conversations fit whole in its first n_tokens tokens (at least
    one): what evaluate_chat's `conversations` takes to score about n_tokens tokens."""
    starts = dataset.starts[split]
    ends = np.append(starts[1:], len(getattr(dataset, split)))
    return max(1, int((ends <= n_tokens).sum()))


def _group_by_length(windows: list[tuple[int, int]]):
    groups: dict[int, list[int]] = {}
    for s, length in windows:
        groups.setdefault(length, []).append(s)
    return groups.items()


def eval_report(result: dict[str, Any], n_tokens: int, *, chars: int, nbytes: int, kind: str) -> dict[str, Any]:
    """What an evaluation of a text comes to: loss, perplexity, bits per character (what compares
    models across tokenizers) and, for a tokenizer other than char, bits per UTF-8 byte (its tokens
    need not end on a character).

    The first token of each text is never predicted (it has no context), so the characters or bytes
    are counted for the predicted share of the tokens only.

    Args:
        result: what evaluate() returned for the tokens.
        n_tokens: how many tokens evaluate() was given.
        chars, nbytes: the characters and the UTF-8 bytes those tokens decode to.
        kind: the tokenizer's kind ("char", "bpe", "gpt2").

    Returns {"loss", "perplexity", "bits_per_char", "tokens"} and, but for char, "bits_per_byte".
    """
    share = result["tokens"] / max(1, n_tokens)
    bits = result["nll"] / math.log(2)
    report = {"loss": result["loss"], "perplexity": math.exp(result["loss"]),
              "bits_per_char": bits / (chars * share), "tokens": result["tokens"]}
    if kind != "char":
        report["bits_per_byte"] = bits / (nbytes * share)
    return report
