"""Training batches from a data folder's splits: windows of running text at given offsets (get_batch),
whole conversations packed into rows with their loss weights (pack_conversations, get_chat_batch),
where a batch's positions come from (Batches draws them at random, Stream in order, resumably) and
which of the two orders a run takes (data_order).

torch is imported where a batch is made, not at the top: preparing data needs no torch (a smaller
memory floor).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import DataError, TrainingError
from .folder import DataSet
from .shards import ShardedTokens

if TYPE_CHECKING:
    import torch

    from ..config.train import TrainConfig


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


def sample_offsets(n_tokens: int, block_size: int, batch_size: int, generator: torch.Generator) -> torch.Tensor:
    """Random start positions of `batch_size` windows of block_size + 1 tokens.

    Args:
        n_tokens: the split's length.
        block_size: T, the sequence length.
        batch_size: how many windows.
        generator: the draw.
    """
    import torch

    return torch.randint(0, n_tokens - block_size, (batch_size,), generator=generator)


def share(offsets: torch.Tensor, rank: int, batch_size: int) -> torch.Tensor:
    """Process `rank`'s slice of a global batch drawn for all processes (batch_size each).

    Args:
        offsets: the global batch's positions, every process's in rank order.
        rank: this process.
        batch_size: each process's share.
    """
    return offsets[rank * batch_size : (rank + 1) * batch_size]


class Batches:
    """Where a split's training batches come from: `sample` draws a batch's positions from a
    generator, `get` builds it. Running text gives windows at random offsets (x, y); chat data gives
    packed rows of whole conversations (x, y, target weights, document ids), so the loss counts the
    assistant's tokens only and nothing is learned across a conversation's boundary."""

    def __init__(self, tokens: np.ndarray, block_size: int, mask: np.ndarray | None = None,
                 starts: np.ndarray | None = None) -> None:
        """Args:
        tokens: a split's token ids.
        block_size: the model's context.
        mask, starts: chat data's loss mask and conversation starts (None for text).
        """
        self.tokens, self.block, self.mask = tokens, block_size, mask
        self.rows = pack_conversations(starts, len(tokens), block_size) if starts is not None else None

    @classmethod
    def of(cls, dataset: DataSet, split: str, block_size: int) -> Batches:
        """A data folder's split ("train" or "val"), chat or text as it was prepared."""
        if not dataset.is_chat:
            return cls(getattr(dataset, split), block_size)
        return cls(getattr(dataset, split), block_size, dataset.masks[split], dataset.starts[split])

    def sample(self, n: int, generator: torch.Generator) -> torch.Tensor:
        """n window offsets (text) or packed-row indices (chat)."""
        import torch

        if self.rows is None:
            return sample_offsets(len(self.tokens), self.block, n, generator)
        return torch.randint(0, len(self.rows), (n,), generator=generator)

    def get(self, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The batch at `positions`: (x, y) for text, (x, y, weights, documents) for chat."""
        if self.rows is None:
            return get_batch(self.tokens, positions, self.block)
        return get_chat_batch(self.tokens, self.mask, self.rows, positions, self.block)


class Stream:
    """The sequential data order (TrainConfig.data_order): global batches of consecutive windows, each
    drawn `rows` windows of block_size + 1 tokens starting block_size apart from `position` (a row's
    last target is the next row's first input, as llm.c's loader cuts them), so every token of the
    split is trained on once per pass; the next draw starts where this one's rows end, and back at
    the start (the next epoch) when a whole draw no longer fits. The same tokens in one file or in
    shards give the same windows: shard boundaries are invisible. Every process draws the same global
    offsets and reads only its own rows (share), from the shard(s) holding them.

    `state()` is what a checkpoint keeps: the position as (shard, offset) too, checked on resume
    against the data folder's shards."""

    def __init__(self, tokens: np.ndarray, block_size: int) -> None:
        self.tokens, self.block = tokens, block_size
        self.position, self.epoch = 0, 0

    def draw(self, rows: int) -> torch.Tensor:
        """The start offsets of the next `rows` windows (the global batch of one micro-step)."""
        import torch

        self._wrap(rows)
        offsets = self.position + torch.arange(rows, dtype=torch.int64) * self.block
        self.position += rows * self.block
        self._wrap(rows)  # the position saved is where the next unseen tokens begin
        return offsets

    def _wrap(self, rows: int) -> None:
        if self.position + rows * self.block + 1 > len(self.tokens):
            self.position, self.epoch = 0, self.epoch + 1

    def _locate(self, position: int) -> tuple[int, int]:
        if isinstance(self.tokens, ShardedTokens):
            return self.tokens.locate(position)
        return 0, position

    def state(self) -> dict[str, Any]:
        shard, offset = self._locate(self.position)
        return {"order": "sequential", "position": self.position, "epoch": self.epoch, "shard": shard,
                "offset": offset}

    def restore(self, saved: dict[str, Any], where: Path) -> None:
        position = saved["position"]
        if not 0 <= position < len(self.tokens) or self._locate(position) != (saved["shard"], saved["offset"]):
            raise TrainingError(f"{where}: the run stopped at token {position:,} of the train split (shard "
                                f"{saved['shard']}, offset {saved['offset']:,}), which this data folder's shards do "
                                "not hold there: resume with the data it trained on")
        self.position, self.epoch = position, saved["epoch"]


def data_order(cfg: TrainConfig, dataset: DataSet) -> str:
    """The run's data order: cfg.data_order, or by default sequential for shards and random for one file.

    Args:
        cfg: the run's settings.
        dataset: the data it trains on.
    """
    order = cfg.data_order or ("sequential" if dataset.is_sharded else "random")
    if order == "sequential" and dataset.is_chat:
        raise TrainingError(f"{dataset.path} is chat data, trained on packed conversations in random order: "
                            "drop --data-order sequential")
    return order

