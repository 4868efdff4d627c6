"""Training batches from a data folder's splits: windows of running text at given offsets (get_batch),
whole conversations packed into rows with their loss weights (pack_conversations, get_chat_batch),
where a batch's positions come from (Batches draws them at random, Stream in order, resumably) and
which of the two orders a run takes (data_order); preference pairs fitted to a window and batched for
their log-probs or their scores (Pairs).

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



class Pairs:
    """A preference split's pairs (data.preference) fitted to a window of `max_length` tokens, drawn at random
    and made into batches: both sides of each pair as rows for the log-probs of their completions (get,
    DPO's), or each side's whole sequence to score (scored, a reward model's).

    A sequence longer than the window loses tokens from the start of its prompt (TRL's keep_end: the
    completions stay whole), the same ones for both sides, so the two are compared on the same context; a
    pair whose longer completion leaves no room for one prompt token is dropped (`dropped` counts them).

    Args:
        tokens: the split's ids.
        index: the split's (start, prompt, chosen, rejected lengths), one row a pair.
        max_length: the longest sequence, prompt and completion.
        margins: the split's margins (TRL's reward margin), if the data has them.
        closing: "eos" where each completion ends with the end of text (standard pairs), which a scored
            sequence leaves out, or "turn" (conversational: the template's end of turn is part of the text).
    """

    def __init__(self, tokens: np.ndarray, index: np.ndarray, max_length: int, margins: np.ndarray | None = None,
                 closing: str = "eos") -> None:
        self.tokens, self.index, self.margins, self.closing = tokens, index, margins, closing
        longer = np.maximum(index[:, 2], index[:, 3])
        keep = longer < max_length
        self.rows = np.flatnonzero(keep)
        self.dropped = int((~keep).sum())
        self.cut = np.maximum(0, index[:, 1] + longer - max_length)  # prompt tokens left out, from its start

    @classmethod
    def of(cls, dataset: DataSet, split: str, max_length: int) -> Pairs:
        """A preference data folder's split ("train" or "val")."""
        margins = dataset.margins[split] if dataset.margins is not None else None
        return cls(getattr(dataset, split), dataset.pairs[split], max_length, margins, dataset.meta["closing"])

    def __len__(self) -> int:
        return len(self.rows)

    def sample(self, n: int, generator: torch.Generator) -> torch.Tensor:
        """n positions among the kept pairs, drawn with replacement."""
        import torch

        return torch.randint(0, len(self.rows), (n,), generator=generator)

    def sides(self, position: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The prompt (as the window keeps it), chosen and rejected ids of the kept pair at `position`."""
        start, prompt, chosen, rejected = self.index[self.rows[position]].tolist()
        cut = int(self.cut[self.rows[position]])
        ids = self.tokens[start : start + prompt + chosen + rejected]
        return ids[cut:prompt], ids[prompt : prompt + chosen], ids[prompt + chosen :]

    def count(self, positions: torch.Tensor) -> int:
        """The tokens the pairs at `positions` put into a batch's rows: each pair's prompt (as the window keeps
        it) twice, and its two completions."""
        rows = self.rows[positions.numpy()]
        index = self.index[rows]
        return int((2 * (index[:, 1] - self.cut[rows]) + index[:, 2] + index[:, 3]).sum())

    def get(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """DPO's batch of the pairs at `positions` (B), as TRL's collator lays it out: each pair's prompt and
        chosen completion as a row, then each one's prompt and rejected completion, right-padded.

        Returns:
            ids (2B, T) int64 and the completion mask (2B, T) int64, 1 on the completions' tokens.
        """
        prompts, chosen, rejected = zip(*(self.sides(p) for p in positions.tolist()))
        rows = [(p, c) for p, c in zip(prompts, chosen)] + [(p, r) for p, r in zip(prompts, rejected)]
        return _padded([np.concatenate(row) for row in rows], [len(p) for p, _ in rows])

    def scored(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A reward model's batch of the pairs at `positions` (B): each pair's prompt and chosen completion,
        then each one's prompt and rejected completion, right-padded, a standard completion without the end
        of text that closes it (the score is read at the text's last token, as transformers reads it with
        the end of text as padding).

        Returns:
            ids (2B, T) int64, the last token's index of each row (2B,), and the margins (B,) (zeros where
            the data has none).
        """
        import torch

        drop = 1 if self.closing == "eos" else 0
        prompts, chosen, rejected = zip(*(self.sides(p) for p in positions.tolist()))
        rows = [np.concatenate((p, c[: len(c) - drop])) for p, c in zip(prompts * 2, chosen + rejected)]
        ids, _ = _padded(rows, [0] * len(rows))
        last = torch.tensor([len(r) - 1 for r in rows])
        kept = self.rows[positions.numpy()]
        margins = torch.from_numpy(self.margins[kept].astype(np.float32)) if self.margins is not None \
            else torch.zeros(len(kept))
        return ids, last, margins


def _padded(rows: list[np.ndarray], prompts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of ids right-padded with 0 into one (N, T) tensor, and the mask of what follows each row's prompt."""
    import torch

    width = max(len(r) for r in rows)
    ids = np.zeros((len(rows), width), dtype=np.int64)
    mask = np.zeros((len(rows), width), dtype=np.int64)
    for i, (row, prompt) in enumerate(zip(rows, prompts)):
        ids[i, : len(row)] = row
        mask[i, prompt : len(row)] = 1
    return torch.from_numpy(ids), torch.from_numpy(mask)
