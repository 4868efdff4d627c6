"""Looking inside a data folder (`tinygpt inspect data`): each split's files with their tokens and
documents, the documents' lengths as a histogram, and the first tokens decoded; every file read a
chunk at a time and checked against meta.json as it goes. file_rows lists the files as the command's
table does.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from ..calc.units import plural
from ..errors import DataError
from .folder import DataSet, load_data
from .shards import ShardedTokens

SCAN_TOKENS = 1 << 24  # ids read at a time while a folder is surveyed: memory stays a chunk whatever its size
LENGTH_BINS = 64  # document lengths by powers of two: bin 0 holds empty documents, bin k 2**(k-1) .. 2**k - 1
SHARD_ROWS = 6  # file_rows lists a split of more shards as its first and last three, the rest on one row


def length_bin(k: int) -> tuple[int, int]:
    """The lowest and highest document length (tokens) that histogram bin k counts."""
    return (0, 0) if k == 0 else (1 << (k - 1), (1 << k) - 1)


def length_label(low: int, high: int) -> str:
    """A histogram bin's lengths as the histograms print them: "7" or "8-15"."""
    return f"{low:,}" if low == high else f"{low:,}-{high:,}"


class _Lengths:
    """Document lengths counted into power-of-two bins as they come, with their count, sum, min and max:
    a folder of billions of tokens has millions of documents, which are never held all at once."""

    def __init__(self) -> None:
        self.bins = np.zeros(LENGTH_BINS, dtype=np.int64)
        self.count = self.total = 0
        self.min: int | None = None
        self.max: int | None = None

    def add(self, lengths: np.ndarray) -> None:
        if not len(lengths):
            return
        # frexp's exponent of n is its bit length: 0 -> 0, 1 -> 1, 2..3 -> 2, 4..7 -> 3 (exact below 2**53)
        self.bins += np.bincount(np.frexp(lengths.astype(np.float64))[1], minlength=LENGTH_BINS)
        self.count += len(lengths)
        self.total += int(lengths.sum())
        low, high = int(lengths.min()), int(lengths.max())
        self.min = low if self.min is None else min(self.min, low)
        self.max = high if self.max is None else max(self.max, high)

    def to_dict(self) -> dict[str, Any]:
        used = np.flatnonzero(self.bins)
        bins = [] if not len(used) else [
            {"low": length_bin(k)[0], "high": length_bin(k)[1], "documents": int(self.bins[k])}
            for k in range(int(used[0]), int(used[-1]) + 1)]
        return {"documents": self.count, "min": self.min, "max": self.max,
                "mean": self.total / self.count if self.count else None, "bins": bins}


def _split_files(ds: DataSet, split: str) -> Iterator[tuple[Path, np.ndarray, dict[str, Any] | None]]:
    """A split's files in order: (path, its ids as a memmap, its meta.json shard entry or None), each shard
    checked against its sha256 first."""
    tokens = getattr(ds, split)
    if not isinstance(tokens, ShardedTokens):
        yield ds.path / f"{split}.bin", tokens, None
        return
    for i, path in enumerate(tokens.paths):
        tokens.check(i)
        yield path, tokens.shard(i), ds.meta["shards"][split][i]


def _scan_split(ds: DataSet, split: str, eot: int | None, lengths: _Lengths | None) -> dict[str, Any]:
    """inspect_data's reading of one split: its files' tokens and documents (checked against meta.json),
    its document lengths added to `lengths`."""
    meta = ds.meta
    n, files = 0, []
    last = -1  # where the split's last separator is
    for file, ids, entry in _split_files(ds, split):
        separators = 0
        for lo in range(0, len(ids), SCAN_TOKENS):
            chunk = ids[lo : lo + SCAN_TOKENS]
            if int(chunk.max()) >= ds.vocab_size:
                raise DataError(f"{file} holds token id {int(chunk.max()):,}, outside the vocabulary of "
                                f"{ds.vocab_size:,}")
            if eot is not None:
                at = np.flatnonzero(chunk == eot) + (n + lo)
                if len(at):
                    lengths.add(np.diff(at, prepend=last) - 1)
                    last, separators = int(at[-1]), separators + len(at)
        if eot is not None:  # a document counts in the file holding its first id, its separator, as prepare counts
            documents = separators + int(n == 0 and len(ids) > 0)
        elif ds.is_chat or ds.is_preference:  # one file per split
            documents = len(ds.starts[split]) if ds.is_chat else len(ds.pairs[split])
        else:
            documents = (entry or {}).get("documents")
        if entry is not None and eot is not None and documents != entry.get("documents"):
            raise DataError(f"{file} holds {documents:,} documents but meta.json says {entry.get('documents')!r}")
        files.append({"file": file.name, "tokens": len(ids), "documents": documents})
        n += len(ids)
    info: dict[str, Any] = {"tokens": n, "files": files}
    if ds.is_chat:
        starts = ds.starts[split]
        lengths.add(np.diff(np.append(starts, n)) if len(starts) else starts)
        info.update(documents=len(starts), trained_tokens=meta[f"{split}_trained_tokens"])
    elif ds.is_preference:  # a pair's length: its prompt and both completions
        lengths.add(ds.pairs[split][:, 1:].sum(axis=1))
        info["documents"] = len(ds.pairs[split])
    elif eot is not None:
        if n:
            lengths.add(np.array([n - last - 1]))
        info["documents"] = sum(f["documents"] for f in files)
        if f"{split}_documents" in meta and info["documents"] != meta[f"{split}_documents"]:
            raise DataError(f"{ds.path}: the {split} files hold {info['documents']:,} documents but meta.json's "
                            f"{split}_documents says {meta[f'{split}_documents']!r}")
    else:
        info["documents"] = meta.get(f"{split}_documents")
    return info


def inspect_data(path: str | os.PathLike, *, first_tokens: int = 32) -> dict[str, Any]:
    """What a data folder holds (`tinygpt inspect data`): each split's files (one file, or its shards)
    with their tokens and documents, the documents' lengths in tokens as a histogram of power-of-two
    bins, and the first tokens of the train split decoded.

    Documents are what the end-of-text token separates (a split's first begins at its start, and a
    document's length leaves its separator out); a chat folder's documents are its conversations, a
    preference folder's its pairs (with the first one's prompt, chosen and rejected completion decoded). A
    character vocabulary has no separator: documents are meta.json's counts, lengths unknown (None).

    Files are read SCAN_TOKENS ids at a time through memory maps (a shard at a time), so memory stays
    bounded whatever the folder's size, and what they hold is checked against meta.json: each shard's
    sha256 and documents, each split's documents, every id inside the vocabulary.

    Args:
        path: the data folder.
        first_tokens: how many ids to decode from the start.

    Raises:
        DataError: not a data folder, a missing file, or files that disagree with meta.json.
    """
    ds = load_data(path)
    meta, tok = ds.meta, ds.tokenizer
    eot = None if ds.is_chat or ds.is_preference else tok.eot_id
    lengths = _Lengths() if ds.is_chat or ds.is_preference or eot is not None else None
    splits = {split: _scan_split(ds, split, eot, lengths) for split in ("train", "val")}
    split = "train" if len(ds.train) or not len(ds.val) else "val"
    ids = np.asarray(getattr(ds, split)[:first_tokens]).tolist()
    first: dict[str, Any] = {"split": split, "ids": ids, "text": tok.decode(ids)}
    if ds.is_chat:
        mask = ds.masks[split][: len(ids)]
        first["trained_text"] = tok.decode([i for i, m in zip(ids, mask) if m])
    if ds.is_preference and len(ds.pairs[split]):
        start, *sizes = ds.pairs[split][0].tolist()
        ends = np.cumsum([start, *sizes]).tolist()
        first["pair"] = {side: tok.decode(np.asarray(getattr(ds, split)[a:b]).tolist())
                         for side, a, b in zip(("prompt", "chosen", "rejected"), ends, ends[1:])}
    return {
        "path": str(ds.path), "content": meta.get("content", "text"), "tokenizer": tok.kind,
        "vocab_size": ds.vocab_size, "dtype": ds.dtype.name, "eot_id": eot,
        "eot_token": None if eot is None else tok.decode([eot]), "shard_tokens": meta.get("shard_tokens"),
        "documents": meta.get("documents") if lengths is None else lengths.count, "splits": splits,
        "lengths": None if lengths is None else lengths.to_dict(), "first": first,
    }


def file_rows(info: dict[str, Any]) -> list[tuple[str, str, int, int | None]]:
    """inspect_data's files as `tinygpt inspect data` lists them, (split, file, tokens, documents) a row: a
    split of more than SHARD_ROWS shards as its first and last SHARD_ROWS // 2 with the shards between summed
    on one row, and a split of several shards followed by its totals.

    Args:
        info: what inspect_data returned.
    """
    rows = []
    for split, s in info["splits"].items():
        files, cut = s["files"], SHARD_ROWS // 2
        if len(files) > SHARD_ROWS:
            middle = files[cut:-cut]
            docs = None if middle[0]["documents"] is None else sum(f["documents"] for f in middle)
            files = [*files[:cut], {"file": f"... {len(middle):,} more", "tokens": sum(f["tokens"] for f in middle),
                                    "documents": docs}, *files[-cut:]]
        rows += [(split, f["file"], f["tokens"], f["documents"]) for f in files]
        if len(s["files"]) > 1:
            rows.append((split, plural(len(s["files"]), "shard"), s["tokens"], s["documents"]))
    return rows
