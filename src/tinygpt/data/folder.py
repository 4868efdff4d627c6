"""A data folder: what `prepare` writes, and `load_data` opens and checks.

A prepared data folder holds:

    train.bin, val.bin   token ids, raw little-endian uint16 (vocab <= 65,536) or uint32, np.memmap-able
    tokenizer.json       the tokenizer, as tinygpt JSON
    meta.json            what the files hold: tokenizer kind, fingerprint (Tokenizer.fingerprint) and
                         vocab size, dtype, tokens / characters / UTF-8 bytes per split (for bits per
                         char or byte), sources, error handling

A dataset prepared with shards holds train_00000.bin, ... val_00000.bin, ... in place of the two
token files (tinygpt.data.shards; meta.json's "shards" index), and a chat data folder also holds,
per split, the loss mask and where each conversation starts (CHAT_FILES); a preference data folder where
each pair's prompt and completions lie (PREFERENCE_FILES).

Everything is written into a hidden temporary folder next to the data folder and renamed into place at
the end (publish): an interrupted prepare leaves no half-written data folder, and a folder that is not a
tinygpt data folder is never overwritten (check_out_dir). A run refuses data prepared with another
tokenizer than its own (check_same_tokenizer).
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import DataError, TokenizerError
from ..fileio import check_folder_path, check_regular_file, read_json, write_json
from ..tokenizer.base import Tokenizer, load_tokenizer, short_fingerprint
from .shards import SHARD_FILE, ShardedTokens

FORMAT = "tinygpt-data"
VERSION = 1
DATA_FILES = ("train.bin", "val.bin", "tokenizer.json", "meta.json")
# a chat data folder (prepare_chat) also holds, per split, the loss mask (uint8, one per token) and
# where each conversation starts (uint64 token offsets)
CHAT_FILES = ("train.mask", "val.mask", "train.starts", "val.starts")
# a preference data folder (data.preference) also holds, per split, each pair's start and the lengths of its
# prompt, chosen and rejected ids (uint64, PAIR_FIELDS a pair), and its margins (float32) where the file gave any
PREFERENCE_FILES = ("train.pairs", "val.pairs", "train.margins", "val.margins")
PAIR_FIELDS = 4


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 while every id fits (vocab_size <= 65,536), else uint32.

    Args:
        vocab_size: the tokenizer's vocabulary.
    """
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def folder_meta(tok: Tokenizer, counts: dict[str, Any], content: str | None = None) -> dict[str, Any]:
    """What every data folder's meta.json begins with: its format, the tokenizer (kind, fingerprint,
    vocabulary, the files' dtype), then `counts`; `content` ("chat") says what else it holds.

    Args:
        tok: the tokenizer the folder was written with.
        counts: the splits' tokens, characters, bytes (and documents or conversations).
        content: "chat" for conversations with a loss mask; None for running text.
    """
    return {"format": FORMAT, "version": VERSION, **({"content": content} if content else {}),
            "tokenizer": tok.kind, "tokenizer_fingerprint": tok.fingerprint(), "vocab_size": tok.vocab_size,
            "dtype": token_dtype(tok.vocab_size).name, **counts}


def check_out_dir(out: Path) -> None:
    """Refuse to write over anything but an empty folder or a tinygpt data folder; refuse a file, or a
    path below one.

    Args:
        out: the data folder a prepare is about to write (resolved).
    """
    check_folder_path(out, DataError)
    if not out.exists():
        return
    entries = set(os.listdir(out))
    if not entries:
        return
    known = DATA_FILES + CHAT_FILES + PREFERENCE_FILES
    if "meta.json" in entries and all(e in known or SHARD_FILE.fullmatch(e) for e in entries):
        try:
            if read_json(out / "meta.json", DataError).get("format") == FORMAT:
                return
        except (DataError, AttributeError, OSError):
            pass
    raise DataError(f"refusing to overwrite {out}: it is not a tinygpt data folder (choose another --out)")


def publish(tmp: Path, out: Path, tok: Tokenizer, meta: dict[str, Any], tokenizer_file: str | Path | None) -> None:
    """Write the tokenizer and meta.json (naming the tokenizer file it came from) into the finished
    folder and move it into place.

    Args:
        tmp: the finished folder, beside `out`.
        out: the data folder.
        tok: the tokenizer the ids were written with.
        meta: meta.json's contents.
        tokenizer_file: the file or folder the tokenizer was read from, if any.
    """
    if tokenizer_file is not None:
        meta["tokenizer_file"] = str(Path(tokenizer_file).expanduser().resolve())
    tok.save(tmp / "tokenizer.json")
    write_json(tmp / "meta.json", meta)
    _replace_folder(tmp, out)


def _replace_folder(new: Path, out: Path) -> None:
    """Move the finished folder into place; an old data folder is moved aside first, then removed."""
    if out.exists():
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        shutil.rmtree(old, ignore_errors=True)
        os.rename(out, old)
        os.rename(new, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(new, out)


@dataclass
class DataSet:
    """A prepared data folder: token arrays (read-only memmaps), the tokenizer and meta.json."""

    path: Path
    meta: dict[str, Any]
    train: np.ndarray
    val: np.ndarray
    tokenizer: Tokenizer
    # chat data only: per split, the loss mask (1 where the model learns the token) and conversation starts
    masks: dict[str, np.ndarray] | None = None
    starts: dict[str, np.ndarray] | None = None
    # preference data only: per split, each pair's (start, prompt, chosen, rejected lengths), and margins
    pairs: dict[str, np.ndarray] | None = None
    margins: dict[str, np.ndarray] | None = None

    @property
    def is_chat(self) -> bool:
        """Conversations with a loss mask (prepare_chat), not running text."""
        return self.masks is not None

    @property
    def is_preference(self) -> bool:
        """Preference pairs (a prompt, a chosen and a rejected completion), not running text."""
        return self.pairs is not None

    @property
    def is_sharded(self) -> bool:
        """Its splits are shards (prepare --shard-tokens), read through ShardedTokens."""
        return "shards" in self.meta

    @property
    def vocab_size(self) -> int:
        return self.meta["vocab_size"]

    @property
    def dtype(self) -> np.dtype:
        return self.train.dtype

    @property
    def fingerprint(self) -> str:
        """The fingerprint of the tokenizer the data was prepared with: meta.json's, or for a folder an
        older prepare wrote without one, its tokenizer.json's."""
        return self.meta.get("tokenizer_fingerprint") or self.tokenizer.fingerprint()

    @property
    def fingerprints(self) -> set[str]:
        """Every fingerprint the data's tokenizer goes by (known_fingerprints)."""
        return known_fingerprints(self.fingerprint, self.tokenizer)


def known_fingerprints(fingerprint: str, tokenizer: Tokenizer | None) -> set[str]:
    """The fingerprints a recorded one stands for: all of its tokenizer's (Tokenizer.fingerprints: those
    an earlier tinygpt gave it too) where it is one of them, else itself alone (its tokenizer is not at
    hand, or a `tokenizers` release spells the rules otherwise).

    Args:
        fingerprint: the fingerprint recorded (meta.json's, train_config.json's) or computed.
        tokenizer: the tokenizer stored beside it, if any.
    """
    names = set(tokenizer.fingerprints()) if tokenizer is not None else set()
    return names if fingerprint in names else {fingerprint}


def check_same_tokenizer(
    dataset: DataSet, tokenizer: Tokenizer | None, owner: str, *, fingerprint: str | None = None,
    remedy: str | None = None,
) -> None:
    """Refuse a data folder prepared with another tokenizer than `tokenizer`: its ids would mean
    other text (a char vocabulary of upper-cased text has the same kind and size, other characters).
    The one check for every place that puts data in front of a model: resuming a run, evaluating
    one on --data, fine-tuning a base model.

    Args:
        dataset: the data folder (load_data).
        tokenizer: the tokenizer the data must have been prepared with (a run's, a base model's);
            None when only its recorded fingerprint is known.
        owner: where that tokenizer lives (a run folder), for the message.
        fingerprint: the fingerprint recorded where the tokenizer lives, if any; else computed
            from `tokenizer`. Fingerprints recorded when they were written are compared as they
            are, so a later `tokenizers` release cannot turn a match into a mismatch; each also
            stands for the others its tokenizer goes by (known_fingerprints: an earlier tinygpt's).
        remedy: what the message tells the user to do (default: prepare with --tokenizer-file owner).

    Raises:
        DataError: one line naming both tokenizers (kind, size, fingerprint).
    """
    theirs = fingerprint or (tokenizer.fingerprint() if tokenizer is not None else None)
    if theirs is None or theirs == dataset.fingerprint:
        return
    if not dataset.fingerprints.isdisjoint(known_fingerprints(theirs, tokenizer)):  # an earlier tinygpt's name
        return

    def label(tok: Tokenizer | None, fp: str) -> str:
        short = short_fingerprint(fp)
        return short if tok is None else f"{tok.kind}, {tok.vocab_size:,} tokens, {short}"

    raise DataError(
        f"{dataset.path} was prepared with another tokenizer than {owner}'s "
        f"({label(dataset.tokenizer, dataset.fingerprint)} against {label(tokenizer, theirs)}): its ids would mean "
        "other text; "
        + (remedy or f"prepare the text again with --tokenizer-file {owner}")
    )


_META_INTS = ("vocab_size", "train_tokens", "val_tokens", "train_chars", "val_chars", "train_bytes", "val_bytes")


def load_data(path: str | os.PathLike) -> DataSet:
    """Open a data folder written by `prepare`, checking that its files agree with meta.json.

    Args:
        path: the data folder.
    """
    p = Path(path).expanduser()
    if not p.is_dir():
        raise DataError(f"data folder not found: {p}" if not p.exists() else f"{p} is not a folder")
    if not (p / "meta.json").is_file():
        raise DataError(
            f"{p} is not a tinygpt data folder (no meta.json); make one with `tinygpt prepare SOURCE --out {p}`"
        )
    meta = read_json(p / "meta.json", DataError)
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise DataError(f'{p / "meta.json"} is not a tinygpt data description (no "format": "{FORMAT}")')
    if not isinstance(meta.get("version"), int) or meta["version"] > VERSION:
        raise DataError(
            f"{p / 'meta.json'}: data format version {meta.get('version')!r} is not supported "
            f"(this tinygpt reads {VERSION})"
        )
    for key in _META_INTS:
        if not isinstance(meta.get(key), int) or isinstance(meta[key], bool) or meta[key] < 0:
            raise DataError(f"{p / 'meta.json'}: {key} must be a non-negative integer, got {meta.get(key)!r}")
    if meta.get("dtype") not in ("uint16", "uint32"):
        raise DataError(f"{p / 'meta.json'}: dtype must be uint16 or uint32, got {meta.get('dtype')!r}")
    dtype = np.dtype(meta["dtype"])
    if meta["vocab_size"] > np.iinfo(dtype).max + 1:
        raise DataError(f"{p / 'meta.json'}: a vocabulary of {meta['vocab_size']:,} does not fit {dtype.name}")
    try:
        tok = load_tokenizer(p)
    except TokenizerError as e:
        raise DataError(str(e)) from None
    stored = meta.get("tokenizer_fingerprint")
    if stored is not None and not (isinstance(stored, str) and re.fullmatch(r"sha256:[0-9a-f]{64}", stored)):
        raise DataError(f"{p / 'meta.json'}: tokenizer_fingerprint must be 'sha256:' and 64 hex digits, got {stored!r}")
    if tok.kind != meta.get("tokenizer") or tok.vocab_size != meta["vocab_size"]:
        raise DataError(
            f"{p}: tokenizer.json ({tok.kind}, {tok.vocab_size:,} tokens) disagrees with meta.json "
            f"({meta.get('tokenizer')}, {meta['vocab_size']:,} tokens)"
        )
    if "shards" in meta:
        arrays = {split: _open_shards(p, meta, split, dtype) for split in ("train", "val")}
    else:
        arrays = {
            split: _open_tokens(p / f"{split}.bin", dtype, meta[f"{split}_tokens"], meta["vocab_size"])
            for split in ("train", "val")
        }
    if meta.get("content") == "preference":
        pairs, margins = _open_pairs(p, meta)
        return DataSet(p, meta, arrays["train"], arrays["val"], tok, pairs=pairs, margins=margins)
    if meta.get("content") != "chat":
        return DataSet(p, meta, arrays["train"], arrays["val"], tok)
    masks, starts = _open_chat(p, meta, tok)
    return DataSet(p, meta, arrays["train"], arrays["val"], tok, masks, starts)


def _open_chat(p: Path, meta: dict[str, Any], tok: Tokenizer) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """A chat folder's masks and conversation starts, checked against meta.json and the token files."""
    if tok.chat_template is None:
        raise DataError(f"{p}: meta.json says chat data but tokenizer.json has no chat template")
    masks, starts = {}, {}
    for split in ("train", "val"):
        n_tokens, n_conv = meta[f"{split}_tokens"], meta.get(f"{split}_conversations")
        if not isinstance(n_conv, int) or n_conv < 0:
            raise DataError(f"{p / 'meta.json'}: {split}_conversations must be a non-negative integer")
        for name, dtype, n in (("mask", np.uint8, n_tokens), ("starts", np.uint64, n_conv)):
            f = p / f"{split}.{name}"
            if not f.is_file() or f.stat().st_size != n * np.dtype(dtype).itemsize:
                raise DataError(f"{f} is missing or does not hold {n:,} entries as meta.json says")
        masks[split] = np.fromfile(p / f"{split}.mask", dtype=np.uint8)
        starts[split] = np.fromfile(p / f"{split}.starts", dtype=np.uint64).astype(np.int64)
        s = starts[split]
        if n_conv and (s[0] != 0 or (np.diff(s) <= 0).any() or s[-1] >= n_tokens):
            raise DataError(f"{p / f'{split}.starts'}: conversation starts are not increasing offsets from 0")
    return masks, starts


def _open_pairs(p: Path, meta: dict[str, Any]) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray] | None]:
    """A preference folder's pair index (and margins), checked against meta.json and the token files: the
    pairs lie one after another from the split's start to its end, each with a prompt and two completions."""
    pairs, margins = {}, {} if meta.get("margins") else None
    for split in ("train", "val"):
        n = meta.get(f"{split}_pairs")
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise DataError(f"{p / 'meta.json'}: {split}_pairs must be a non-negative integer")
        files = [(f"{split}.pairs", np.uint64, n * PAIR_FIELDS)]
        if margins is not None:
            files.append((f"{split}.margins", np.float32, n))
        for name, dtype, count in files:
            f = p / name
            if not f.is_file() or f.stat().st_size != count * np.dtype(dtype).itemsize:
                raise DataError(f"{f} is missing or does not hold {n:,} pairs as meta.json says")
        index = np.fromfile(p / f"{split}.pairs", dtype=np.uint64).astype(np.int64).reshape(n, PAIR_FIELDS)
        ends = index[:, 0] + index[:, 1:].sum(axis=1)
        if n and (index[0, 0] != 0 or (index[1:, 0] != ends[:-1]).any() or ends[-1] != meta[f"{split}_tokens"]
                  or (index[:, 1:] <= 0).any()):
            raise DataError(f"{p / f'{split}.pairs'}: the pairs do not lie one after another through the split, "
                            "each with a prompt and two completions")
        pairs[split] = index
        if margins is not None:
            margins[split] = np.fromfile(p / f"{split}.margins", dtype=np.float32)
    return pairs, margins


def _open_shards(p: Path, meta: dict[str, Any], split: str, dtype: np.dtype) -> ShardedTokens:
    """A split written as shards (meta.json's "shards" index), each checked for its size; ids past the
    vocabulary are refused as they are read, bytes that are not the recorded sha256's as training or
    inspect_data reads each shard (reading every shard here would take minutes at scale)."""
    index = meta["shards"].get(split) if isinstance(meta["shards"], dict) else None
    where = p / "meta.json"
    if not isinstance(index, list):
        raise DataError(f"{where}: shards must map train and val to lists of shards")
    paths, counts, hashes = [], [], []
    for entry in index:
        name, n = (entry.get("file"), entry.get("tokens")) if isinstance(entry, dict) else (None, None)
        if not (isinstance(name, str) and SHARD_FILE.fullmatch(name) and name.startswith(split + "_")):
            raise DataError(f"{where}: {name!r} is not a {split} shard's file name")
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise DataError(f"{where}: the tokens of {name} must be a non-negative integer, got {n!r}")
        digest = entry.get("sha256")
        if not (isinstance(digest, str) and re.fullmatch(r"[0-9a-f]{64}", digest)):
            raise DataError(f"{where}: the sha256 of {name} must be 64 hex digits, got {digest!r}")
        size = check_regular_file(p / name, DataError)
        if size != n * dtype.itemsize:
            raise DataError(f"{p / name} holds {size:,} bytes but meta.json says {n:,} {dtype.name} tokens "
                            f"({n * dtype.itemsize:,} bytes)")
        paths.append(p / name)
        counts.append(n)
        hashes.append(digest)
    if sum(counts) != meta[f"{split}_tokens"]:
        raise DataError(f"{where}: the {split} shards hold {sum(counts):,} tokens, not the {meta[f'{split}_tokens']:,} "
                        f"{split}_tokens says")
    return ShardedTokens(paths, counts, dtype, meta["vocab_size"], hashes)


def _open_tokens(path: Path, dtype: np.dtype, n_tokens: int, vocab_size: int) -> np.ndarray:
    if not path.is_file():
        raise DataError(f"{path} is missing")
    size = path.stat().st_size
    if size != n_tokens * dtype.itemsize:
        other = np.dtype(np.uint32 if dtype == np.uint16 else np.uint16)
        hint = f"; it is the size of {n_tokens:,} {other.name} tokens" if size == n_tokens * other.itemsize else ""
        raise DataError(
            f"{path} holds {size:,} bytes but meta.json says {n_tokens:,} {dtype.name} tokens "
            f"({n_tokens * dtype.itemsize:,} bytes){hint}"
        )
    if n_tokens == 0:
        arr = np.zeros(0, dtype=dtype)
        arr.flags.writeable = False
        return arr
    arr = np.memmap(path, dtype=dtype, mode="r")
    # An id past the vocabulary would crash the embedding later with an obscure index error.
    top = max(int(arr[i : i + (1 << 24)].max()) for i in range(0, len(arr), 1 << 24))
    if top >= vocab_size:
        raise DataError(f"{path} holds token id {top:,}, outside the vocabulary of {vocab_size:,}")
    return arr
