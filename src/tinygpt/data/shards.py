"""Token files as `prepare` writes them and training reads them: one file per split, or shards.

Writing (ShardWriter): token ids are appended to the split's file as they come. With shard_tokens
each split is cut into `train_00000.bin`, `train_00001.bin`, ... of exactly that many ids (the last
one of each split shorter): a shard is written as `NAME.part`, synced, and renamed once full, and
each full shard is reported (on_shard) so that prepare can record how far it got. Memory stays a
few encode batches whatever the data's size. `state()` and `ShardWriter(resume=...)` carry a
writer across an interruption: the shards done, and how much of each split's open shard was synced.

Reading (ShardedTokens): a split's shards seen as one array: len, slices and windows that cross
shard boundaries, so training on shards samples exactly the batches the same tokens in one file give.
`check_windows` holds the shards some windows read to the sha256 prepare recorded, once each.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import DataError
from ..fileio import fsync_dir, hash_file

SPLITS = ("train", "val")
PART = ".part"
OPEN_SHARDS = 4  # shards a reader keeps mapped: a window crosses at most two
SHARD_FILE = re.compile(r"(train|val)_(\d{5,})\.bin")


def shard_name(split: str, index: int) -> str:
    return f"{split}_{index:05d}.bin"


# ---------------------------------------------------------------------------------------------
# Writing


class _Open:
    """The open file of one split: what it holds so far and its running checksum."""

    def __init__(self, path: Path, index: int, tokens: int = 0, documents: int = 0) -> None:
        self.path, self.index, self.tokens, self.documents = path, index, tokens, documents
        # resuming: the synced part of the shard, its checksum recomputed from the file
        self.hash = hash_file(path) if tokens else hashlib.sha256()
        self.file = open(path, "r+b" if tokens else "wb")
        self.file.seek(0, os.SEEK_END)

    def write(self, data: bytes) -> None:
        self.file.write(data)
        self.hash.update(data)

    def sync(self) -> None:
        self.file.flush()
        os.fsync(self.file.fileno())


class ShardWriter:
    """Appends each split's token ids to its file(s) in `folder` (see the module docstring).

    Args:
        folder: where the files go (prepare's work folder).
        dtype: the token dtype (uint16 or uint32).
        shard_tokens: ids per shard; None writes one file per split, train.bin and val.bin.
        on_shard: called after each full shard is in place (synced and renamed).
        resume: a state() from an interrupted writer: its shards, and each split's open shard
            truncated back to what was synced then.
    """

    def __init__(self, folder: Path, dtype: np.dtype, shard_tokens: int | None = None,
                 on_shard: Callable[[], None] | None = None, resume: dict[str, Any] | None = None) -> None:
        self.folder, self.dtype, self.shard_tokens, self.on_shard = folder, np.dtype(dtype), shard_tokens, on_shard
        self.done: dict[str, list[dict[str, Any]]] = {s: [] for s in SPLITS}
        self.emitted = 0  # ids handed to write() so far, skipped ones included
        self.skip = 0  # ids still to drop: a resumed prepare replays what the files already hold
        self.open: dict[str, _Open] = {}
        if resume is not None:
            self._resume(resume)
        for split in SPLITS:
            if split not in self.open:
                self.open[split] = self._new(split, len(self.done[split]))

    def _path(self, split: str, index: int) -> Path:
        if self.shard_tokens is None:
            return self.folder / f"{split}.bin"
        return self.folder / (shard_name(split, index) + PART)

    def _new(self, split: str, index: int) -> _Open:
        return _Open(self._path(split, index), index)

    def _resume(self, state: dict[str, Any]) -> None:
        keep = set()
        for split in SPLITS:
            entry = state[split]
            self.done[split] = [dict(s) for s in entry["shards"]]
            for s in self.done[split]:
                keep.add(s["file"])
                if (self.folder / s["file"]).stat().st_size != s["tokens"] * self.dtype.itemsize:
                    raise DataError(f"{self.folder / s['file']}: not the shard the interrupted prepare recorded; "
                                    "run without --resume to start over")
            index, tokens = len(self.done[split]), int(entry["open_tokens"])
            part = self._path(split, index)
            full = self.folder / shard_name(split, index)
            if not part.exists() and full.exists():  # the kill came after the shard's rename, before the record
                os.replace(full, part)
            if tokens and (not part.exists() or part.stat().st_size < tokens * self.dtype.itemsize):
                raise DataError(f"{part}: shorter than the interrupted prepare recorded; run without --resume")
            if part.exists():
                with open(part, "r+b") as f:
                    f.truncate(tokens * self.dtype.itemsize)
            keep.add(part.name)
            self.open[split] = _Open(part, index, tokens, int(entry["open_documents"]))
        for f in self.folder.iterdir():  # shards written after the record: they are written again
            if (SHARD_FILE.fullmatch(f.name) or f.name.endswith(PART)) and f.name not in keep:
                f.unlink()

    def start_document(self, split: str) -> None:
        """A document begins in `split` with the next ids written (counted in the shard holding its first id)."""
        if not self.skip:
            self.open[split].documents += 1

    def write(self, split: str, ids: np.ndarray) -> None:
        """Append ids to the split, cutting shards where they fill."""
        ids = np.asarray(ids)
        n = len(ids)
        if self.skip:
            drop = min(self.skip, n)
            self.skip -= drop
            self.emitted += drop
            ids = ids[drop:]
        while len(ids):
            current = self.open[split]
            room = len(ids) if self.shard_tokens is None else self.shard_tokens - current.tokens
            head, ids = ids[:room], ids[room:]
            current.write(head.astype(self.dtype, copy=False).tobytes())
            current.tokens += len(head)
            self.emitted += len(head)
            if self.shard_tokens is not None and current.tokens == self.shard_tokens:
                self._finish(split)
                self.open[split] = self._new(split, current.index + 1)
                if self.on_shard is not None:
                    self.on_shard()

    def _finish(self, split: str) -> None:
        current = self.open[split]
        current.sync()
        current.file.close()
        name = current.path.name if self.shard_tokens is None else shard_name(split, current.index)
        if self.shard_tokens is not None:
            os.replace(current.path, self.folder / name)
            fsync_dir(self.folder)
        self.done[split].append({"file": name, "tokens": current.tokens, "documents": current.documents,
                                 "sha256": current.hash.hexdigest()})

    def state(self) -> dict[str, Any]:
        """What an interrupted writer would resume from: each split's full shards and its open one (synced now)."""
        out = {}
        for split in SPLITS:
            current = self.open[split]
            current.sync()
            out[split] = {"shards": [dict(s) for s in self.done[split]], "open_tokens": current.tokens,
                          "open_documents": current.documents}
        return out

    def close(self) -> dict[str, list[dict[str, Any]]]:
        """Finish each split's last file (an empty last shard is dropped, an empty val.bin kept); returns
        each split's index: file, tokens, documents and sha256 per shard."""
        for split in SPLITS:
            current = self.open[split]
            if self.shard_tokens is not None and current.tokens == 0 and current.documents == 0:
                current.file.close()
                current.path.unlink()
                continue
            self._finish(split)
        self.open = {}
        return self.done

    def abort(self) -> None:
        for current in self.open.values():
            with contextlib.suppress(OSError):
                current.file.close()


# ---------------------------------------------------------------------------------------------
# Reading


class ShardedTokens:
    """A split written as shards, read as one array of token ids (each shard a read-only memmap,
    opened when first touched, and at most OPEN_SHARDS of them mapped at once: streaming through
    the split keeps the pages of a few shards in memory, not the split's). Supports len(), [i],
    [a:b], np.asarray() and windows(); ids past the vocabulary are refused as they are read, and
    check()/check_windows() refuse a shard whose bytes are not those prepare recorded (its sha256).

    Args:
        paths: the shard files, in order.
        counts: ids in each.
        dtype: the token dtype.
        vocab_size: ids must be below it.
        sha256: each shard's recorded sha256 (hex), or None to check none.
    """

    def __init__(self, paths: list[Path], counts: list[int], dtype: np.dtype, vocab_size: int,
                 sha256: list[str] | None = None) -> None:
        self.paths, self.counts, self.dtype, self.vocab_size = list(paths), list(counts), np.dtype(dtype), vocab_size
        self.sha256 = sha256
        self.starts = np.concatenate([[0], np.cumsum(self.counts, dtype=np.int64)])  # (S+1,)
        self._maps: collections.OrderedDict[int, np.ndarray] = collections.OrderedDict()  # least recent first
        self._checked: set[int] = set()  # the shards whose bytes were found to be prepare's

    def __len__(self) -> int:
        return int(self.starts[-1])

    @property
    def shape(self) -> tuple[int]:
        return (len(self),)

    def shard(self, i: int) -> np.ndarray:
        """Shard i's ids (a memmap)."""
        if i in self._maps:
            self._maps.move_to_end(i)
            return self._maps[i]
        while len(self._maps) >= OPEN_SHARDS:  # unmapped once the last view of it goes (reads copy)
            self._maps.popitem(last=False)
        self._maps[i] = np.memmap(self.paths[i], dtype=self.dtype, mode="r", shape=(self.counts[i],))
        return self._maps[i]

    def check(self, i: int) -> None:
        """Refuse shard i unless its bytes hash to the sha256 prepare recorded: a changed byte that keeps
        every id inside the vocabulary would otherwise pass unseen. Read once for this object (a process
        opening the folder, and so a resume, reads it again), the first time it is asked."""
        if i in self._checked or self.sha256 is None:
            return
        if hash_file(self.paths[i]).hexdigest() != self.sha256[i]:
            raise DataError(f"{self.paths[i]} is not the file prepare wrote: its sha256 is not meta.json's; "
                            "prepare the data again")
        self._checked.add(i)

    def check_windows(self, offsets: np.ndarray, width: int) -> None:
        """check() every shard the windows tokens[o:o+width] read, lowest first. Training calls it on its
        batches: streamed in order, a shard is read once more as the stream reaches it (what it trains
        on, not the whole split at the start, nor the shards an evaluation's random windows touch)."""
        offsets = np.asarray(offsets, dtype=np.int64)
        first = np.searchsorted(self.starts, offsets, side="right") - 1
        last = np.searchsorted(self.starts, offsets + width - 1, side="right") - 1
        for i in sorted({i for a, b in zip(first.tolist(), last.tolist()) for i in range(a, b + 1)}):
            self.check(i)

    @property
    def open_shards(self) -> list[int]:
        """The shards mapped now, least recently read first."""
        return list(self._maps)

    def locate(self, offset: int) -> tuple[int, int]:
        """(shard, offset inside it) of the id at `offset`."""
        i = int(np.searchsorted(self.starts, offset, side="right")) - 1
        return i, int(offset - self.starts[i])

    def _read(self, start: int, stop: int) -> np.ndarray:
        start, stop = max(0, start), min(len(self), stop)
        if stop <= start:
            return np.zeros(0, dtype=self.dtype)
        first, _ = self.locate(start)
        last, _ = self.locate(stop - 1)
        parts = [self.shard(i)[max(start - self.starts[i], 0): stop - self.starts[i]] for i in range(first, last + 1)]
        out = parts[0].copy() if len(parts) == 1 else np.concatenate(parts)
        if out.size and int(out.max()) >= self.vocab_size:
            bad = int(out.max())
            where = self.paths[first] if first == last else f"{self.paths[first]} .. {self.paths[last].name}"
            raise DataError(f"{where} holds token id {bad:,}, outside the vocabulary of {self.vocab_size:,}")
        return out

    def __getitem__(self, key: int | slice) -> np.ndarray | np.integer:
        if isinstance(key, slice):
            start, stop, step = key.indices(len(self))
            if step != 1:
                return self._read(0, len(self))[key]
            return self._read(start, stop)
        i = int(key)
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"index {key} is out of range for {len(self):,} tokens")
        return self._read(i, i + 1)[0]

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        whole = self._read(0, len(self))
        return whole if dtype is None else whole.astype(dtype)

    def windows(self, offsets: np.ndarray, width: int) -> np.ndarray:
        """(B, width) rows tokens[o:o+width], each copied from the shard(s) holding it."""
        rows = np.empty((len(offsets), width), dtype=self.dtype)
        for b, o in enumerate(np.asarray(offsets, dtype=np.int64).tolist()):
            rows[b] = self._read(o, o + width)
        return rows
