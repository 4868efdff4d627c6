"""Training batches from a data folder's splits: windows of running text at given offsets (get_batch),
whole conversations packed into rows with their loss weights (pack_conversations, get_chat_batch).

torch is imported where a batch is made, not at the top: preparing data needs no torch (a smaller
memory floor).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ..errors import DataError
from .shards import ShardedTokens

if TYPE_CHECKING:
    import torch


def get_batch(tokens: np.ndarray, offsets: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-token targets at the given offsets: x = tokens[o:o+T], y = tokens[o+1:o+T+1].

    Args:
        tokens: a split's token ids (a memmap from `load_data`).
        offsets: (B,) start positions, each in [0, len(tokens) - block_size - 1].
        block_size: T, the sequence length.

    Returns:
        x, y: int64 tensors of shape (B, T) on the CPU.
    """
    import torch

    offs = offsets.numpy(force=True) if isinstance(offsets, torch.Tensor) else np.asarray(offsets)
    offs = offs.astype(np.int64, copy=False).reshape(-1)
    n = len(tokens)
    if n < block_size + 1:
        raise DataError(
            f"a batch of block size {block_size} needs at least {block_size + 1} tokens; this split has {n:,}"
        )
    if offs.size and (offs.min() < 0 or offs.max() > n - block_size - 1):
        raise DataError(f"batch offsets must lie in [0, {n - block_size - 1}], got {offs.min()}..{offs.max()}")
    if isinstance(tokens, ShardedTokens):  # rows that cross a shard's end are joined, as in one file
        windows = tokens.windows(offs, block_size + 1)  # (B, T+1)
    else:  # row o of the window view is tokens[o:o+T+1]; indexing it copies just the B rows
        windows = np.lib.stride_tricks.sliding_window_view(tokens, block_size + 1)[offs]  # (B, T+1)
    chunk = torch.from_numpy(windows.astype(np.int64))  # (B, T+1)
    return chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()


def pack_conversations(starts: np.ndarray, n_tokens: int, block_size: int) -> list[list[tuple[int, int]]]:
    """Rows of a chat batch: whole conversations, in order, packed while they fit one row.

    A row holds at most block_size + 1 tokens (block_size inputs, each with its next token as the
    target). A conversation that fits is never cut; one longer than a row is cut into pieces of
    block_size + 1 tokens that overlap by one, each alone in a row, so each of its tokens is still
    a target once.

    Args:
        starts: where each conversation begins in the split's tokens.
        n_tokens: the split's length (the last conversation ends there).
        block_size: the model's context.

    Returns:
        Per row, its (start, end) token spans, one per conversation or piece.
    """
    room = block_size + 1
    ends = [*starts[1:].tolist(), n_tokens]
    rows: list[list[tuple[int, int]]] = []
    row: list[tuple[int, int]] = []
    used = 0
    for start, end in zip(starts.tolist(), ends):
        if end - start > room:
            rows += [[(s, min(s + room, end))] for s in range(start, end - 1, block_size)]
            continue
        if used + end - start > room:
            rows.append(row)
            row, used = [], 0
        row.append((start, end))
        used += end - start
    if row:
        rows.append(row)
    return rows


def get_chat_batch(
    tokens: np.ndarray, mask: np.ndarray, rows: list[list[tuple[int, int]]], indices: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inputs, targets, target weights and document ids of the packed rows `indices` (pack_conversations).

    A target counts (weight 1) where the loss mask says the model learns that token and it belongs
    to the same conversation as its input; the last token of one conversation never learns the first
    of the next, and padding counts for nothing. `documents` numbers the conversations of a row
    (padding -1), for the model's attention to stay inside each (GPT.forward's documents).

    Returns:
        x, y, weights (float32), documents: tensors of shape (B, T) on the CPU.
    """
    import torch

    room = block_size + 1
    idx = indices.tolist() if hasattr(indices, "tolist") else list(indices)
    x = np.zeros((len(idx), room), dtype=np.int64)
    w = np.zeros((len(idx), room), dtype=np.float32)
    doc = np.full((len(idx), room), -1, dtype=np.int64)
    for b, r in enumerate(idx):
        at = 0
        for d, (start, end) in enumerate(rows[r]):
            x[b, at : at + end - start] = tokens[start:end]
            w[b, at : at + end - start] = mask[start:end]
            doc[b, at : at + end - start] = d
            at += end - start
    same = (doc[:, 1:] == doc[:, :-1]) & (doc[:, 1:] >= 0)
    weights = w[:, 1:] * same
    return (torch.from_numpy(x[:, :-1].copy()), torch.from_numpy(x[:, 1:].copy()),
            torch.from_numpy(weights.astype(np.float32)), torch.from_numpy(doc[:, :-1].copy()))
