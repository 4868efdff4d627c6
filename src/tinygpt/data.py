"""Text sources -> token files + meta.json, and training batches from them.

A prepared data folder holds:

    train.bin, val.bin   token ids, raw little-endian uint16 (vocab <= 65,536) or uint32, np.memmap-able
    tokenizer.json       the tokenizer, as tinygpt JSON
    meta.json            what the files hold: tokenizer kind, fingerprint (Tokenizer.fingerprint) and
                         vocab size, dtype, tokens / characters / UTF-8 bytes per split (for bits per
                         char or byte), sources, error handling

How text is read:

- A SOURCE is a text file, a folder (every text file below it, in sorted path order; hidden entries
  and binary files, those with a NUL byte in their first 8 KiB, are skipped; symlinked folders are
  followed, each real folder read once, so a link loop ends), or a built-in corpus:
  `python-stdlib` (this interpreter's standard-library .py files, read in place, each decoded as
  Python itself decodes it) or `shakespeare` (tiny-shakespeare, downloaded once into the cache).
  An existing path wins over a built-in name.
- Files are UTF-8. A leading BOM is dropped; line endings are kept as they are (CRLF stays CRLF,
  so the model learns what the files hold). Invalid UTF-8 stops with the file and byte offset
  (errors="strict"), or becomes U+FFFD and is counted (errors="replace").
- Files are streamed in chunks, never read whole: 100 MB of text prepares in under 500 MB of
  memory (benchmarks/prepare_memory.py measures it).
  The character tokenizer takes two passes (collect the alphabet, then encode, vectorized through
  a code-point lookup table); BPE trains from the first pass and encodes in batches in the second.
- Text is cut into pieces only where GPT-2's pre-tokenizer splits anyway (before a space or after a
  lone newline, next to non-space characters), so the tokens equal those of encoding each file whole.
- Documents (files) are separated by `<|endoftext|>` for BPE and GPT-2 (a tokenizer file without
  that token is refused for more than one file); character vocabularies have no separator and
  files follow each other as they are.
- The validation split is the last `val_fraction` of the characters: contiguous text, the same on
  every run. Counts of characters and bytes cover text only, not separators.
- Everything is written into a hidden temporary folder next to `out_dir` and renamed into place at
  the end: an interrupted prepare leaves no half-written data folder, and a folder that is not a
  tinygpt data folder is never overwritten.

Datasets (tinygpt.datasources: `hf:NAME[:CONFIG][/SPLIT]`, parquet, JSONL and CSV files or folders
of them) are streamed in one pass, a row a document, and never held whole:

- Documents are encoded on `workers` threads (tinygpt.shards.Encoder) in order, in batches of at most
  ENCODE_CHARS characters (or one document), so the ids are those of one worker and memory stays a
  few batches; each split's documents are separated by `<|endoftext|>` as files are.
- The validation split is every document k with (k * val_fraction) mod 1 < val_fraction: the
  first, then one in 1/val_fraction, spread over the whole dataset (a stream has no known end to
  hold out the last share of). `max_tokens` stops at that many ids (train and val together).
- With `shard_tokens` each split is written as train_00000.bin, ... val_00000.bin, ... of that many
  ids (meta.json's "shards" index: file, tokens, documents and sha256 of each); without it as
  train.bin and val.bin. The work folder (`.NAME.prepare` beside `out_dir`) records after each full
  shard where in the dataset it was, so `resume` continues from the last complete shard and writes
  the same files an uninterrupted run writes.
"""

from __future__ import annotations

import codecs
import math
from array import array
from fractions import Fraction
import os
import re
import shutil
import sysconfig
import tokenize
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from .calc.units import plural
from .errors import ChatError, DataError, TokenizerError
from .datasources import DatasetSource, data_kind, dataset_source, is_dataset_folder, is_hub_name
from .fileio import (check_folder_path, check_regular_file, parse_json, printable_path, read_json,
                     temp_folder, write_json)
from .shards import SHARD_FILE, Encoder, ShardedTokens, ShardWriter, default_workers
from .tokenizer.base import EOT, KINDS, Tokenizer, load_tokenizer
from .tokenizer.bpe import DEFAULT_BPE_VOCAB, BPETokenizer, check_bpe_vocab_size
from .tokenizer.char import CharTokenizer
from .tokenizer.chat import check_messages, render_chat, with_chat_template
from .tokenizer.chat_template import ChatTemplate
from .tokenizer.gpt2 import GPT2Tokenizer

if TYPE_CHECKING:
    import torch

FORMAT = "tinygpt-data"
VERSION = 1
DATA_FILES = ("train.bin", "val.bin", "tokenizer.json", "meta.json")
# a chat data folder (prepare_chat) also holds, per split, the loss mask (uint8, one per token) and
# where each conversation starts (uint64 token offsets)
CHAT_FILES = ("train.mask", "val.mask", "train.starts", "val.starts")
CHAT_ERRORS = ("strict", "skip")
SHOW_BAD_LINES = 5  # the bad lines of a chat file an error or prepare's summary spells out; the rest are counted
CHAT_BUFFER_TOKENS = 1 << 20  # rendered chat tokens held before they are written
BUILTIN_CORPORA = ("python-stdlib", "shakespeare")
SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
DOWNLOAD_TIMEOUT_S = 10.0
MAX_VAL_FRACTION = 0.5

READ_BYTES = 1 << 20  # bytes per read from a file
PIECE_CHARS = 1 << 16  # text is re-cut into pieces of about this many characters at safe token boundaries
ENCODE_CHARS = 1 << 21  # characters per batch handed to the tokenizer (BPE encodes a batch's pieces in parallel)
MAX_CARRY_CHARS = 1 << 24  # a piece with no safe boundary is cut anyway past this length
BINARY_SNIFF_BYTES = 8192

ProgressFn = Callable[[str, int, int], None]  # (phase, bytes done, bytes total)


# ---------------------------------------------------------------------------------------------
# Sources


@dataclass(frozen=True)
class Document:
    """One file of a source; `encoding` is its declared encoding (UTF-8 except for some stdlib files)."""

    path: Path
    size: int
    encoding: str = "utf-8"


@dataclass
class Source:
    """A resolved SOURCE argument: the files it stands for."""

    name: str
    path: Path
    documents: list[Document] = field(default_factory=list)
    skipped: int = 0  # binary files (folders) or files Python cannot decode (python-stdlib)

    @property
    def size(self) -> int:
        return sum(d.size for d in self.documents)

    def to_meta(self) -> dict[str, Any]:
        return {
            "name": printable_path(self.name),
            "path": printable_path(self.path),
            "files": len(self.documents),
            "skipped": self.skipped,
            "bytes": self.size,
        }


def resolve_sources(sources: Iterable[str | os.PathLike], *, exclude: Iterable[Path] = ()) -> list[Source]:
    """Turn SOURCE arguments into lists of files.

    Args:
        sources: text files, folders, or built-in corpus names (python-stdlib, shakespeare).
        exclude: folders never to read from (prepare passes its output folder).
    """
    if isinstance(sources, (str, os.PathLike)):
        sources = [sources]  # one source, not a sequence of one-letter names
    sources = [str(s) for s in sources]
    if not sources:
        raise DataError(
            "no source given: name a text file, a folder, or a built-in corpus (python-stdlib, shakespeare)"
        )
    exclude = [Path(p).resolve() for p in exclude]
    out = []
    for name in sources:
        path = Path(name).expanduser()
        inside = next((e for e in exclude if path.exists() and e in (path.resolve(), *path.resolve().parents)), None)
        if inside is not None:  # it would read the folder being replaced, and lose its token files
            raise DataError(f"source {name} is the output folder {inside} or inside it: give another --out")
        if path.is_file():
            out.append(Source(name, path.resolve(), [Document(path.resolve(), path.stat().st_size)]))
        elif path.is_dir():
            out.append(_folder_source(name, path.resolve(), exclude))
        elif path.exists():
            raise DataError(f"source is neither a file nor a folder: {name}")
        elif name == "python-stdlib":
            out.append(_python_stdlib_source())
        elif name == "shakespeare":
            p = shakespeare_path()
            out.append(Source(name, p, [Document(p, p.stat().st_size)]))
        else:
            raise DataError(
                f"source not found: {name} (a text file, a folder, or a built-in corpus: {', '.join(BUILTIN_CORPORA)})"
            )
    return out


def _walk_files(
    root: Path, exclude: list[Path], skip_dirs: tuple[str, ...] = (), *, follow_links: bool = True
) -> list[Path]:
    """Regular files below root, in sorted path order, skipping hidden entries and excluded folders.

    Symlinked folders are followed (unless follow_links is False), each real folder once: a link
    back to a folder above it, or a second link to one already read, is skipped, so a loop ends.
    """
    found = []
    seen = {_folder_id(root)}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=follow_links):
        here = Path(dirpath)
        kept = []
        for d in sorted(dirnames):  # sorted: which of two links to one folder is read does not depend on the disk
            if d.startswith(".") or d in skip_dirs or (here / d).resolve() in exclude:
                continue
            if follow_links:
                key = _folder_id(here / d)
                if key is None or key in seen:
                    continue
                seen.add(key)
            kept.append(d)
        dirnames[:] = kept
        found += [here / f for f in filenames if not f.startswith(".") and (here / f).is_file()]
    return sorted(found, key=lambda p: p.relative_to(root).parts)


def _folder_id(path: Path) -> tuple[int, int] | None:
    """The folder a path leads to (device and inode, after links), or None when it leads nowhere."""
    try:
        st = path.stat()
    except OSError:  # a dangling link, or a link loop
        return None
    return st.st_dev, st.st_ino


def _is_binary(path: Path) -> bool:
    with open(path, "rb") as f:
        return b"\0" in f.read(BINARY_SNIFF_BYTES)


def _folder_source(name: str, root: Path, exclude: list[Path]) -> Source:
    src = Source(name, root)
    for p in _walk_files(root, exclude):
        size = p.stat().st_size
        if size == 0:
            continue
        if _is_binary(p):
            src.skipped += 1
        else:
            src.documents.append(Document(p, size))
    if not src.documents:
        raise DataError(f"no text files in {name}" + (f" ({src.skipped} binary files skipped)" if src.skipped else ""))
    return src


def python_stdlib_root() -> Path:
    """The running interpreter's standard library folder."""
    return Path(sysconfig.get_paths()["stdlib"]).resolve()


def _python_stdlib_source() -> Source:
    # Each file decoded as Python decodes it (PEP 263: a few test modules are latin-1 or koi8-r);
    # files Python itself refuses (deliberately broken test fixtures) are skipped.
    root = python_stdlib_root()
    src = Source("python-stdlib", root)
    for p in _walk_files(root, [], skip_dirs=("site-packages", "dist-packages", "__pycache__"), follow_links=False):
        if p.suffix != ".py" or p.stat().st_size == 0:
            continue
        try:
            with open(p, "rb") as f:
                encoding, _ = tokenize.detect_encoding(f.readline)
        except SyntaxError:
            src.skipped += 1
            continue
        encoding = codecs.lookup(encoding).name
        src.documents.append(Document(p, p.stat().st_size, "utf-8" if encoding == "utf-8-sig" else encoding))
    if not src.documents:
        raise DataError(f"no .py files found in the standard library folder {root}")
    return src


def cache_dir() -> Path:
    """Where downloaded corpora are kept: $TINYGPT_CACHE, else $XDG_CACHE_HOME/tinygpt, else ~/.cache/tinygpt."""
    if os.environ.get("TINYGPT_CACHE"):
        return Path(os.environ["TINYGPT_CACHE"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "tinygpt"


def shakespeare_path(timeout: float = DOWNLOAD_TIMEOUT_S) -> Path:
    """tiny-shakespeare (1.1 MB), from the cache or downloaded into it once."""
    path = cache_dir() / "shakespeare.txt"
    if path.is_file():
        return path
    try:
        with urllib.request.urlopen(SHAKESPEARE_URL, timeout=timeout) as r:
            text = r.read()
    except (OSError, ValueError) as e:
        raise DataError(
            f"cannot download tiny-shakespeare ({getattr(e, 'reason', None) or e}); offline, fetch it elsewhere "
            f"from {SHAKESPEARE_URL} and run `tinygpt prepare path/to/shakespeare.txt --out data/shakespeare`"
        ) from None
    if not text.startswith(b"First Citizen"):
        raise DataError(f"the download from {SHAKESPEARE_URL} is not tiny-shakespeare; prepare a local copy instead")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_bytes(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


# ---------------------------------------------------------------------------------------------
# Reading text


def _read_chunks(
    doc: Document,
    errors: str,
    on_bytes: Callable[[int], None] | None = None,
    on_replaced: Callable[[int], None] | None = None,
) -> Iterator[str]:
    """Decoded text of one file, chunk by chunk; a UTF-8 BOM is dropped.

    With errors="replace" each invalid sequence becomes one U+FFFD, as Python's own "replace" makes
    it, and on_replaced(n) hears how many a chunk got: a chunk holding U+FFFD is decoded a second
    time from the same state with errors="ignore", which resumes where "replace" does, so the U+FFFD
    still there are the file's own and the difference is the substitutions.
    """
    decoder = codecs.getincrementaldecoder(doc.encoding)(errors)
    genuine = codecs.getincrementaldecoder(doc.encoding)("ignore") if errors == "replace" else None
    offset = 0  # file position of the next byte to read
    with open(doc.path, "rb") as f:
        while True:
            data = f.read(READ_BYTES)
            if offset == 0 and doc.encoding == "utf-8" and data.startswith(codecs.BOM_UTF8):
                data, offset = data[3:], 3
            state = decoder.getstate()
            pending = len(state[0]) if isinstance(state[0], bytes) else 0  # bytes held from the last chunk
            try:
                text = decoder.decode(data, final=not data)
            except UnicodeDecodeError as e:
                at = offset - pending + e.start
                bad = e.object[e.start : e.start + 4].hex(" ")
                raise DataError(
                    f"{doc.path}: invalid {_codec_label(doc.encoding)} at byte {at:,} ({bad}); "
                    "use --errors replace to substitute U+FFFD"
                ) from None
            if genuine is not None and "\ufffd" in text:
                genuine.setstate(state)
                replaced = text.count("\ufffd") - genuine.decode(data, final=not data).count("\ufffd")
                if replaced and on_replaced is not None:
                    on_replaced(replaced)
            offset += len(data)
            if on_bytes is not None:
                on_bytes(len(data))
            if text:
                yield text
            if not data:
                return


def _codec_label(encoding: str) -> str:
    return "UTF-8" if encoding == "utf-8" else encoding


# A cut is safe where GPT-2's pre-tokenizer splits no matter what follows or precedes: just before
# a space that precedes a non-space, or just after a newline that sits between two non-spaces.
_SAFE_CUT = re.compile(r" (?=\S)|(?<=\S\n)(?=\S)")


def _safe_cut(text: str, lo: int, hi: int) -> int:
    """The last safe cut c with lo < c <= hi, or -1. Looks in the last 4 KiB first (the usual case)."""
    for start in dict.fromkeys((max(lo + 1, hi - 4096), lo + 1)):
        cuts = [m.start() for m in _SAFE_CUT.finditer(text, start, hi + 1)]
        if cuts:
            return cuts[-1]
    return -1


def _pieces(chunks: Iterable[str], size: int | None = None) -> Iterator[str]:
    """Re-cut a document's text chunks into pieces of about `size` characters at safe token boundaries."""
    size = size or PIECE_CHARS
    buf = ""
    for chunk in chunks:
        buf = buf + chunk if buf else chunk
        pos = 0
        while len(buf) - pos > size:
            cut = _safe_cut(buf, pos, pos + size)
            if cut < 0:  # no safe cut before pos + size: take the first one after it, if the buffer has one
                m = _SAFE_CUT.search(buf, pos + size)
                cut = m.start() if m else -1
            if cut < 0:
                if len(buf) - pos < MAX_CARRY_CHARS:
                    break  # wait for more text
                cut = pos + size
            yield buf[pos:cut]
            pos = cut
        buf = buf[pos:]
    if buf:
        yield buf


# ---------------------------------------------------------------------------------------------
# Writing token files


class _SplitWriter:
    """Encodes text in batches and appends the ids to train.bin, then (after switch_to_val) val.bin."""

    def __init__(self, tokenizer: Tokenizer, dtype: np.dtype, folder: Path) -> None:
        self.tokenizer = tokenizer
        self.dtype = dtype
        self.folder = folder
        self.split = "train"
        self.counts = {f"{s}_{k}": 0 for s in ("train", "val") for k in ("tokens", "chars", "bytes")}
        self._file = open(folder / "train.bin", "wb")
        self._pending: list[str] = []
        self._pending_chars = 0

    def add_text(self, text: str) -> None:
        if not text:
            return
        self._pending.append(text)
        self._pending_chars += len(text)
        self.counts[f"{self.split}_chars"] += len(text)
        self.counts[f"{self.split}_bytes"] += len(text.encode("utf-8"))
        if self._pending_chars >= ENCODE_CHARS:
            self.flush()

    def add_separator(self, token_id: int) -> None:
        self.flush()
        self._write(np.array([token_id], dtype=np.uint32))

    def flush(self) -> None:
        if self._pending:
            self._write(self.tokenizer.encode_to_array(self._pending))
            self._pending, self._pending_chars = [], 0

    def _write(self, ids: np.ndarray) -> None:
        ids.astype(self.dtype, copy=False).tofile(self._file)
        self.counts[f"{self.split}_tokens"] += len(ids)

    def switch_to_val(self) -> None:
        self._close_file()
        self.split = "val"
        self._file = open(self.folder / "val.bin", "wb")

    def _close_file(self) -> None:
        self.flush()
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()

    def close(self) -> None:
        if self.split == "train":
            self.switch_to_val()  # an empty val.bin (val_fraction 0)
        self._close_file()

    def abort(self) -> None:
        self._file.close()


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 while every id fits (vocab_size <= 65,536), else uint32."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def _check_tokenizer_args(
    kind: str | Tokenizer | None, vocab_size: int | None, tokenizer_file: str | os.PathLike | None
) -> None:
    """Refuse impossible tokenizer settings before any file is read."""
    if kind is not None and not isinstance(kind, str):
        if not isinstance(kind, Tokenizer):
            raise DataError(f"tokenizer must be one of {', '.join(KINDS)} or a Tokenizer, got {type(kind).__name__}")
        if vocab_size is not None or tokenizer_file is not None:
            raise DataError("vocab_size and tokenizer_file do not apply to a ready tokenizer object")
        return
    if kind is not None and kind not in KINDS:
        raise DataError(f"unknown tokenizer {kind!r} (expected one of {', '.join(KINDS)})")
    if vocab_size is not None:
        if kind != "bpe" or tokenizer_file is not None:
            raise DataError("--vocab-size applies only when training a BPE tokenizer (--tokenizer bpe)")
        try:
            check_bpe_vocab_size(vocab_size)
        except TokenizerError as e:
            raise DataError(str(e)) from None


def _make_tokenizer(kind: str | Tokenizer | None, tokenizer_file: str | os.PathLike | None) -> Tokenizer | str:
    """A ready tokenizer, or "char"/"bpe" when one must be learned from the corpus first."""
    if kind is not None and not isinstance(kind, str):
        return kind
    if tokenizer_file is None:
        if kind == "gpt2":
            return GPT2Tokenizer.from_tiktoken()
        return kind or "char"
    if kind == "gpt2":
        return GPT2Tokenizer.from_file(tokenizer_file)
    path = Path(tokenizer_file).expanduser()
    hf = _hf_folder_tokenizer(path)
    if hf is not None:
        if kind is not None and hf.kind != kind:
            raise DataError(f"{tokenizer_file} holds a {hf.kind} tokenizer, not {kind}")
        return hf
    is_tinygpt = (
        (path / "tokenizer.json").is_file() if path.is_dir() else path.suffix == ".json" and _is_tinygpt_json(path)
    )
    if kind is None and not is_tinygpt:
        return GPT2Tokenizer.from_file(path)  # GPT-2's own files
    tok = load_tokenizer(path)
    if kind is not None and tok.kind != kind:
        raise DataError(f"{tokenizer_file} holds a {tok.kind} tokenizer, not {kind}")
    return tok


def _check_separator(tok: Tokenizer | str, tokenizer_file: str | os.PathLike | None, documents: int) -> None:
    """Refuse a BPE or GPT-2 tokenizer without <|endoftext|> for two or more documents: the files would
    run into each other (the last word of one joined to the first of the next), which a separator
    exists to prevent. A character vocabulary has none by design, and one document needs none."""
    if isinstance(tok, str) or tok.kind == "char" or tok.eot_id is not None or documents < 2:
        return
    where = f"{tokenizer_file}: the" if tokenizer_file is not None else "the"
    raise DataError(f"{where} {tok.kind} tokenizer has no {EOT} token to separate the {documents:,} files; add it "
                    "to its vocabulary (as the last id, as GPT-2's vocab.json has it) or prepare one file")


def _hf_folder_tokenizer(path: Path) -> Tokenizer | None:
    """The tokenizer of a Hugging Face GPT-2 folder (what fine-tuning one needs its data prepared
    with, and what `tinygpt load` reads there), or None when `path` is not such a folder."""
    if not path.is_dir() or not (path / "config.json").is_file():
        return None
    from .interop.hf import is_hf_folder
    from .interop.hf_tokenizer import load_hf_tokenizer

    if not is_hf_folder(path):
        return None
    tok = load_hf_tokenizer(path)
    if tok is None:
        raise DataError(f"{path}: a Hugging Face folder without a tokenizer (tokenizer.json, or vocab.json + merges.txt)")
    return tok


def _is_tinygpt_json(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return b'"tinygpt-tokenizer"' in f.read(256)
    except OSError:
        return False


# ---------------------------------------------------------------------------------------------
# prepare


def prepare(
    sources: list[str],
    out_dir: str | os.PathLike,
    *,
    tokenizer: str | Tokenizer | None = "char",
    vocab_size: int | None = None,
    val_fraction: float = 0.1,
    errors: str = "strict",
    tokenizer_file: str | os.PathLike | None = None,
    progress: ProgressFn | None = None,
    text_column: str = "text",
    max_tokens: int | None = None,
    shard_tokens: int | None = None,
    workers: int | None = None,
    resume: bool = False,
) -> dict[str, Any]:
    """Tokenize text sources into a data folder for training. Returns the meta.json contents.

    Args:
        sources: text files, folders, or built-in corpora ("python-stdlib", "shakespeare"); or
            datasets: `hf:NAME[:CONFIG][/SPLIT]`, parquet / JSONL / CSV files or folders of them
            (not mixed with text sources).
        out_dir: the data folder to write; an existing one is replaced only if it is a tinygpt data folder.
        tokenizer: "char" (learned from the corpus), "bpe" (byte-level BPE trained on the corpus),
            "gpt2" (GPT-2's BPE), a ready Tokenizer, or None to take the kind from `tokenizer_file`.
        vocab_size: the BPE vocabulary to train (default 4096).
        val_fraction: the share of characters, from the end, held out for validation (0 to 0.5).
        errors: "strict" stops at invalid UTF-8 naming the file and byte offset (a dataset's: its line);
            "replace" substitutes U+FFFD and counts the substitutions; "skip", for a dataset, leaves a
            row that is not UTF-8 out and counts it.
        tokenizer_file: GPT-2's vocab.json + merges.txt or .tiktoken file (gpt2), a tinygpt
            tokenizer.json / data or run folder to reuse its tokenizer (char, bpe), or a Hugging
            Face GPT-2 folder (its tokenizer, as `tinygpt.load` reads the folder).
        progress: called as progress(phase, bytes_done, bytes_total) while files are read.
        text_column: a dataset's column of text.
        max_tokens: a dataset: stop after this many ids (a prefix of it).
        shard_tokens: a dataset: write each split as shards of this many ids.
        workers: a dataset: threads encoding (default: this machine's cores).
        resume: a dataset written as shards: continue an interrupted prepare from its last full shard.
    """
    _check_prepare_args(val_fraction, errors)
    out = Path(out_dir).expanduser().resolve()
    _check_out_dir(out)
    _check_tokenizer_args(tokenizer, vocab_size, tokenizer_file)
    names = [str(sources)] if isinstance(sources, (str, os.PathLike)) else [str(s) for s in sources]
    datasets = [is_dataset(n) for n in names]
    if any(datasets):
        if not all(datasets):
            text = names[datasets.index(False)]
            raise DataError(f"{text} is text and {names[datasets.index(True)]} a dataset: prepare them apart")
        return _prepare_dataset(names, out, tokenizer, vocab_size, val_fraction, tokenizer_file, progress,
                                _DatasetArgs(text_column, max_tokens, shard_tokens, workers, resume, errors))
    for flag, value in (("--max-tokens", max_tokens), ("--shard-tokens", shard_tokens), ("--workers", workers),
                        ("--resume", resume or None), ("--errors skip", errors if errors == "skip" else None)):
        if value is not None:
            raise DataError(f"{flag} applies to datasets (hf:NAME, parquet, JSONL or CSV files); {names[0]} is text")
    srcs = resolve_sources(names, exclude=[out])
    tok_or_kind = _make_tokenizer(tokenizer, tokenizer_file)
    reader = _Reader([d for s in srcs for d in s.documents], errors, progress)
    _check_separator(tok_or_kind, tokenizer_file, len(reader.docs))
    bpe_vocab = vocab_size or DEFAULT_BPE_VOCAB
    tok, scan = _first_pass(srcs, reader, tok_or_kind, bpe_vocab)
    replacements = reader.replaced  # the second pass reads the same bytes again
    split_at = _split_point(sum(scan.chars), val_fraction)
    tmp = temp_folder(out)  # renamed into place once complete
    try:
        counts = _second_pass(reader, tok, split_at, tmp)
        meta = {
            "format": FORMAT,
            "version": VERSION,
            "tokenizer": tok.kind,
            "tokenizer_fingerprint": tok.fingerprint(),
            "vocab_size": tok.vocab_size,
            "dtype": token_dtype(tok.vocab_size).name,
            **counts,
            "val_fraction": val_fraction,
            "documents": len(reader.docs),
            "eot_id": tok.eot_id,
            "sources": [s.to_meta() for s in srcs],
            "errors": errors,
            "replacements": replacements,
        }
        if tok_or_kind == "bpe":
            meta["requested_vocab_size"] = bpe_vocab
        _publish(tmp, out, tok, meta, tokenizer_file)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return meta


def _check_prepare_args(val_fraction: float, errors: str) -> None:
    if (
        not isinstance(val_fraction, (int, float))
        or not 0 <= val_fraction <= MAX_VAL_FRACTION
        or math.isnan(val_fraction)
    ):
        raise DataError(f"val fraction must be between 0 and {MAX_VAL_FRACTION}, got {val_fraction}")
    if errors not in ("strict", "replace", "skip"):
        raise DataError(f"errors must be 'strict' or 'replace' (or 'skip', for a dataset), got {errors!r}")


class _Reader:
    """The documents of one prepare call, read as pieces: progress reported, substitutions counted.

    The count belongs to this call alone; the BPE trainer may pull pieces from another thread, which
    is why it is kept here and not per thread.
    """

    def __init__(self, docs: list[Document], errors: str, progress: ProgressFn | None) -> None:
        self.docs = docs
        self.errors = errors
        self.progress = progress
        self.total_bytes = sum(d.size for d in docs)
        self.replaced = 0  # U+FFFD substituted so far (errors="replace")

    def pieces(self, doc: Document, phase: str, done: list[int]) -> Iterator[str]:
        """The document's text cut into pieces; done[0] counts the bytes read in this phase."""

        def on_bytes(n: int) -> None:
            done[0] += n
            if self.progress is not None:
                self.progress(phase, done[0], self.total_bytes)

        return _pieces(_read_chunks(doc, self.errors, on_bytes, self._count_replaced))

    def _count_replaced(self, n: int) -> None:
        self.replaced += n


@dataclass
class _Scan:
    """What the first pass finds in each source, and the corpus alphabet when a char vocabulary
    is learned or checked (a flag per code point)."""

    chars: list[int]
    has_text: list[bool]  # a character that is not whitespace
    seen: np.ndarray | None


def _scanned(srcs: list[Source], reader: _Reader, phase: str, scan: _Scan) -> Iterator[str]:
    """Every piece of every source, noted in `scan` as it goes by."""
    done = [0]
    for i, src in enumerate(srcs):
        for doc in src.documents:
            for piece in reader.pieces(doc, phase, done):
                scan.chars[i] += len(piece)
                if scan.seen is not None:
                    scan.seen[np.frombuffer(piece.encode("utf-32-le"), dtype=np.uint32)] = True
                if not scan.has_text[i] and not piece.isspace():
                    scan.has_text[i] = True
                yield piece


def _first_pass(
    srcs: list[Source], reader: _Reader, tok_or_kind: Tokenizer | str, bpe_vocab: int
) -> tuple[Tokenizer, _Scan]:
    """Pass 1: count characters (for the split), check there is text, and learn the vocabulary (char,
    or BPE trained on the pieces as they stream by) or check a reused char vocabulary against it."""
    checks_alphabet = tok_or_kind == "char" or isinstance(tok_or_kind, CharTokenizer)
    scan = _Scan([0] * len(srcs), [False] * len(srcs), np.zeros(0x110000, dtype=bool) if checks_alphabet else None)
    pieces = _scanned(srcs, reader, "train bpe" if tok_or_kind == "bpe" else "read", scan)
    if tok_or_kind == "bpe":
        tok = BPETokenizer.train(pieces, bpe_vocab, show_progress=reader.progress is not None)
    else:
        for _ in pieces:
            pass
    for i, src in enumerate(srcs):
        if not scan.has_text[i]:
            raise DataError(
                f"source {src.name} is empty" if scan.chars[i] == 0 else f"source {src.name} holds only whitespace"
            )
    if tok_or_kind == "char":
        tok = CharTokenizer(map(chr, np.flatnonzero(scan.seen).tolist()))
    elif tok_or_kind != "bpe":
        tok = tok_or_kind
    if isinstance(tok, CharTokenizer) and scan.seen is not None and (tok.table[scan.seen] < 0).any():
        missing = [chr(c) for c in np.flatnonzero(scan.seen & (tok.table < 0)).tolist()]
        shown = ", ".join(f"{c!r} (U+{ord(c):04X})" for c in missing[:8]) + (
            f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        )
        raise DataError(f"the corpus has {len(missing)} characters outside the reused tokenizer's vocabulary: {shown}")
    return tok, scan


def _split_point(total_chars: int, val_fraction: float) -> int:
    """How many characters, from the start, go to train: the rest is the validation split (at least
    one character when val_fraction > 0 and there are two)."""
    n_val = round(val_fraction * total_chars)
    if val_fraction > 0 and n_val == 0 and total_chars > 1:
        n_val = 1
    return total_chars - n_val


def _second_pass(reader: _Reader, tok: Tokenizer, split_at: int, folder: Path) -> dict[str, int]:
    """Pass 2: encode every document into folder/train.bin, then val.bin from character split_at on,
    with eot_id between documents. Returns the tokens, characters and bytes of each split."""
    writer = _SplitWriter(tok, token_dtype(tok.vocab_size), folder)
    try:
        pos, done = 0, [0]
        for k, doc in enumerate(reader.docs):
            if k and tok.eot_id is not None:
                writer.add_separator(tok.eot_id)  # between documents only
            for token in tok.added_ids[0]:  # a pretrained model's BOS begins each document, as its tokenizer has it
                writer.add_separator(token)
            for piece in reader.pieces(doc, "encode", done):
                if writer.split == "train" and pos + len(piece) > split_at:
                    writer.add_text(piece[: split_at - pos])
                    writer.switch_to_val()
                    writer.add_text(piece[split_at - pos :])
                else:
                    writer.add_text(piece)
                pos += len(piece)
        writer.close()
    except TokenizerError as e:  # text a reused tokenizer cannot take (checked in pass 1 for char; a safety net)
        writer.abort()
        raise DataError(f"the tokenizer cannot encode this corpus: {e}") from None
    except BaseException:
        writer.abort()
        raise
    return writer.counts


def _check_out_dir(out: Path) -> None:
    """Refuse to write over anything but an empty folder or a tinygpt data folder; refuse a file, or a
    path below one."""
    check_folder_path(out, DataError)
    if not out.exists():
        return
    entries = set(os.listdir(out))
    if not entries:
        return
    if "meta.json" in entries and all(e in DATA_FILES + CHAT_FILES or SHARD_FILE.fullmatch(e) for e in entries):
        try:
            if read_json(out / "meta.json", DataError).get("format") == FORMAT:
                return
        except (DataError, AttributeError, OSError):
            pass
    raise DataError(f"refusing to overwrite {out}: it is not a tinygpt data folder (choose another --out)")


def _publish(tmp: Path, out: Path, tok, meta: dict, tokenizer_file: str | Path | None) -> None:
    """Write the tokenizer and meta.json (naming the tokenizer file it came from) into the finished
    folder and move it into place."""
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


# ---------------------------------------------------------------------------------------------
# prepare from datasets (see the module docstring)

STATE_FILE = "prepare-state.json"  # in the work folder: where an interrupted prepare got to
# the smallest --shard-tokens: each shard is a file synced to disk, and --shard-tokens 10 set out to write ~44,000
# of them without a word; 65,536 uint16 tokens are a shard of 128 KiB (tests patch it to cut small shards)
MIN_SHARD_TOKENS = 1 << 16


@dataclass(frozen=True)
class _DatasetArgs:
    column: str
    max_tokens: int | None
    shard_tokens: int | None
    workers: int | None
    resume: bool
    errors: str

    def check(self) -> None:
        for flag, value in (("--max-tokens", self.max_tokens), ("--shard-tokens", self.shard_tokens),
                            ("--workers", self.workers)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise DataError(f"{flag} must be an integer >= 1, got {value!r}")
        if self.shard_tokens is not None and self.shard_tokens < MIN_SHARD_TOKENS:
            files = -(-1_000_000 // self.shard_tokens)
            raise DataError(f"--shard-tokens {self.shard_tokens:,} is below the floor of {MIN_SHARD_TOKENS:,} tokens a "
                            f"shard: each shard is a file synced to disk, {files:,} files a million tokens")
        if self.resume and self.shard_tokens is None:
            raise DataError("--resume continues from the last complete shard: give --shard-tokens")


def is_dataset(source: str) -> bool:
    """Whether a SOURCE is a dataset: hf:NAME, a parquet / JSONL / CSV file, or a folder of them."""
    if is_hub_name(source):
        return True
    path = Path(source).expanduser()
    if path.is_file():
        return data_kind(path) is not None
    return path.is_dir() and is_dataset_folder(_walk_files(path.resolve(), []))


def _dataset_sources(names: list[str], out: Path, column: str, errors: str) -> list[DatasetSource]:
    srcs = []
    for name in names:
        if is_hub_name(name):
            srcs.append(dataset_source(name, None, [], column, errors))
            continue
        path = Path(name).expanduser().resolve()
        if out in (path, *path.parents):
            raise DataError(f"source {name} is the output folder {out} or inside it: give another --out")
        files = [path] if path.is_file() else [f for f in _walk_files(path, [out]) if data_kind(f)]
        srcs.append(dataset_source(name, path, files, column, errors))
    for src in srcs:
        src.check()
    return srcs


def _dataset_texts(srcs: list[DatasetSource]) -> Iterator[str]:
    for src in srcs:
        for batch in src.rows():
            yield from (t for t in batch.texts if t)


def _dataset_tokenizer(srcs: list[DatasetSource], tok_or_kind: Tokenizer | str, bpe_vocab: int,
                       progress: ProgressFn | None) -> Tokenizer:
    """A ready tokenizer, or one learned in a first pass over the dataset (char: its alphabet; bpe)."""
    if tok_or_kind == "bpe":
        return BPETokenizer.train(_dataset_texts(srcs), bpe_vocab, show_progress=progress is not None)
    if tok_or_kind == "char":
        seen = np.zeros(0x110000, dtype=bool)
        for text in _dataset_texts(srcs):
            seen[np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)] = True
        return CharTokenizer(map(chr, np.flatnonzero(seen).tolist()))
    return tok_or_kind


def _work_folder(out: Path) -> Path:
    return out.parent / f".{out.name}.prepare"


def _prepare_dataset(names: list[str], out: Path, tokenizer: str | Tokenizer | None, vocab_size: int | None,
                     val_fraction: float, tokenizer_file: str | os.PathLike | None, progress: ProgressFn | None,
                     args: _DatasetArgs) -> dict[str, Any]:
    """prepare() for datasets: one streaming pass (after a first one that learns a char or BPE vocabulary)."""
    args.check()
    srcs = _dataset_sources(names, out, args.column, args.errors)
    work = _work_folder(out)
    settings = {"sources": [s.describe_files() for s in srcs], "column": args.column, "tokenizer": str(tokenizer),
                "vocab_size": vocab_size, "tokenizer_file": None if tokenizer_file is None else str(tokenizer_file),
                "val_fraction": val_fraction, "max_tokens": args.max_tokens, "shard_tokens": args.shard_tokens,
                "errors": args.errors}
    state = None
    if args.resume and (work / STATE_FILE).is_file():
        state = read_json(work / STATE_FILE, DataError)
        if not isinstance(state, dict) or state.get("settings") != json_round_trip(settings):
            raise DataError(f"{work} holds an interrupted prepare of other sources or settings: run it with those, "
                            "or without --resume to start over")
        tok = load_tokenizer(work / "tokenizer.json")
    else:
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(work, ignore_errors=True)
        tok_or_kind = _make_tokenizer(tokenizer, tokenizer_file)
        _check_separator(tok_or_kind, tokenizer_file, 2)
        tok = _dataset_tokenizer(srcs, tok_or_kind, vocab_size or DEFAULT_BPE_VOCAB, progress)
        work.mkdir()
        tok.save(work / "tokenizer.json")
    try:
        counts = _DatasetPass(srcs, tok, work, val_fraction, args, settings, state).run(progress)
    except BaseException:
        if not (work / STATE_FILE).is_file():  # no shard to resume from: nothing worth keeping
            shutil.rmtree(work, ignore_errors=True)
        raise
    meta = {
        "format": FORMAT, "version": VERSION, "tokenizer": tok.kind, "tokenizer_fingerprint": tok.fingerprint(),
        "vocab_size": tok.vocab_size, "dtype": token_dtype(tok.vocab_size).name, **counts,
        "val_fraction": val_fraction, "eot_id": tok.eot_id, "sources": [s.to_meta() for s in srcs],
    }
    if tokenizer == "bpe" and tokenizer_file is None:
        meta["requested_vocab_size"] = vocab_size or DEFAULT_BPE_VOCAB
    (work / STATE_FILE).unlink(missing_ok=True)
    _check_out_dir(out)  # again: something may have appeared there while the dataset was read
    _publish(work, out, tok, meta, tokenizer_file)
    return meta


def json_round_trip(obj: Any) -> Any:
    """`obj` as it reads back from JSON (tuples become lists), to compare with what a file holds."""
    import json

    return json.loads(json.dumps(obj))


class _DatasetPass:
    """The encoding pass over a dataset: documents in order, to their split's shards, with the
    counters an interrupted pass is resumed from (recorded after each full shard)."""

    def __init__(self, srcs: list[DatasetSource], tok: Tokenizer, work: Path, val_fraction: float,
                 args: _DatasetArgs, settings: dict[str, Any], state: dict[str, Any] | None) -> None:
        self.srcs, self.tok, self.work, self.args, self.settings = srcs, tok, work, args, settings
        frac = Fraction(val_fraction).limit_denominator(1_000_000)
        self.val_num, self.val_den = frac.numerator, frac.denominator
        self.at: dict[str, Any] = state["at"] if state else {
            "position": [0, 0, 0], "emitted": 0, "documents": 0, "tokens": 0,
            **{f"{split}_{k}": 0 for split in ("train", "val") for k in ("documents", "chars", "bytes")},
            # per source: documents, empty rows, text bytes, rows not UTF-8, their invalid sequences
            "read": [[0, 0, 0, 0, 0] for _ in srcs], "invalid_lines": [],  # where the first rows not UTF-8 are
        }
        self.snapshot = dict(self.at)
        self.writer = ShardWriter(work, token_dtype(tok.vocab_size), args.shard_tokens, on_shard=self._record,
                                  resume=state["writer"] if state else None)
        self.writer.emitted = self.at["emitted"]
        self.writer.skip = state["emitted"] - self.at["emitted"] if state else 0

    def _record(self) -> None:
        """After a full shard: where the batch being written began, and what the files hold now."""
        write_json(self.work / STATE_FILE, {"settings": self.settings, "at": self.snapshot,
                                            "emitted": self.writer.emitted, "writer": self.writer.state()})

    def _batches(self) -> Iterator[tuple[int, int, int, list[Any], list[tuple[int, str, int]]]]:
        """(source, part, first row, texts, invalid as Rows has it) in order, a batch at most ENCODE_CHARS
        characters (or one document): a source's batch is rows, and 1,024 rows of long documents (books,
        source files) at once would hold gigabytes of encodings in each worker."""
        s0, p0, r0 = self.at["position"]
        for i in range(s0, len(self.srcs)):
            for part, row, texts, invalid in self.srcs[i].rows((p0, r0) if i == s0 else (0, 0)):
                start = 0
                while start < len(texts):
                    end, chars = start + 1, len(texts[start] or "")
                    while end < len(texts) and chars + len(texts[end] or "") <= ENCODE_CHARS:
                        chars += len(texts[end] or "")
                        end += 1
                    yield i, part, row + start, texts[start:end], [(k - start, *rest) for k, *rest in invalid
                                                                   if start <= k < end]
                    start = end

    def _count_rows(self, i: int, texts: list[Any], invalid: list[tuple[int, str, int]]) -> None:
        """A batch's rows without text, and its rows that were not UTF-8 (left out: not counted as empty)."""
        read, lines = self.at["read"][i], self.at["invalid_lines"]
        read[1] += sum(1 for t in texts if not t) - (len(invalid) if self.args.errors == "skip" else 0)
        read[3] += len(invalid)
        read[4] += sum(n for _, _, n in invalid)
        lines += [where for _, where, _ in invalid][: SHOW_BAD_LINES - len(lines)]

    def run(self, progress: ProgressFn | None) -> dict[str, Any]:
        tok, at, writer = self.tok, self.at, self.writer
        lead = np.array(tok.added_ids[0], dtype=np.uint32)  # a pretrained model's BOS begins each document
        eot = np.array([tok.eot_id], dtype=np.uint32) if tok.eot_id is not None else np.zeros(0, np.uint32)
        limit = self.args.max_tokens
        workers = self.args.workers or default_workers()
        total = sum(s.size for s in self.srcs if s.hub is None)
        try:
            with Encoder(tok, workers) as encoder:
                batches = encoder.map(self._batches(), lambda b: [t for t in b[3] if t])
                for (i, part, row, texts, invalid), arrays in batches:
                    at["position"] = [i, part, row]
                    at["emitted"] = writer.emitted
                    self.snapshot = json_round_trip(at)
                    self._count_rows(i, texts, invalid)
                    read = at["read"][i]
                    for text, ids in zip((t for t in texts if t), arrays):
                        k = at["documents"]
                        split = "val" if (k * self.val_num) % self.val_den < self.val_num else "train"
                        ids = np.concatenate([eot if at[f"{split}_documents"] else eot[:0], lead, ids])
                        if limit is not None:
                            ids = ids[: limit - at["tokens"]]
                        writer.start_document(split)
                        writer.write(split, ids)
                        size = len(text.encode("utf-8"))
                        at["documents"] += 1
                        at["tokens"] += len(ids)
                        at[f"{split}_documents"] += 1
                        at[f"{split}_chars"] += len(text)
                        at[f"{split}_bytes"] += size
                        read[0] += 1
                        read[2] += size
                        if limit is not None and at["tokens"] >= limit:
                            break
                    if progress is not None and total:
                        progress("encode", sum(r[2] for r in at["read"]), total)
                    if limit is not None and at["tokens"] >= limit:
                        break
        except TokenizerError as e:  # text a reused tokenizer cannot take (a char vocabulary without it)
            writer.abort()
            raise DataError(f"the tokenizer cannot encode this dataset: {e}") from None
        except BaseException:
            writer.abort()
            raise
        if not at["documents"]:
            writer.abort()
            raise DataError(f"{', '.join(s.name for s in self.srcs)} holds no text: every {self.args.column!r} "
                            "is empty")
        index = writer.close()
        for src, (docs, empty, size, invalid, replaced) in zip(self.srcs, at["read"]):
            src.documents, src.empty, src.text_bytes, src.invalid, src.replaced = docs, empty, size, invalid, replaced
        counts = {f"{split}_{k}": at[f"{split}_{k}"] for split in ("train", "val") for k in ("chars", "bytes")}
        counts.update({f"{split}_tokens": sum(s["tokens"] for s in index[split]) for split in ("train", "val")})
        counts.update(documents=at["documents"], train_documents=at["train_documents"],
                      val_documents=at["val_documents"], max_tokens=limit,
                      truncated=limit is not None and at["tokens"] >= limit, errors=self.args.errors,
                      replacements=sum(r[4] for r in at["read"]), invalid_rows=sum(r[3] for r in at["read"]),
                      invalid_lines=at["invalid_lines"])
        if self.args.shard_tokens is not None:
            counts.update(shard_tokens=self.args.shard_tokens, shards=index)
        return counts


# ---------------------------------------------------------------------------------------------
# Chat data: conversations -> token files + loss masks


class _ChatFile:
    """A JSONL file of {"messages": [{"role": ..., "content": ...}, ...]}, one conversation a line, read
    line by line on every pass, so a large file is never held in memory whole."""

    def __init__(self, path: Path, roles: Iterable[str]) -> None:
        if not path.is_file():
            raise DataError(f"chat file not found: {path}")
        self.path = path
        self.roles = tuple(roles)

    def __iter__(self) -> Iterator[tuple[int, list[dict[str, str]] | None, str]]:
        """(line number, messages, "") for a conversation; (line number, None, why) for a line that is not
        one (not UTF-8, bad JSON, an unknown role, empty content, no assistant turn). Blank lines are skipped."""
        with open(self.path, "rb") as f:  # decoded line by line: a line that is not UTF-8 is malformed like any other
            for n, raw in enumerate(f, start=1):
                try:
                    line = raw.decode("utf-8-sig" if n == 1 else "utf-8")
                except UnicodeDecodeError as e:
                    yield n, None, f"not UTF-8 ({e.reason} at byte {e.start} of the line)"
                    continue
                if not line.strip():
                    continue
                try:
                    record = parse_json(line)
                except ValueError as e:
                    yield n, None, f"not JSON ({e})"
                    continue
                messages = record.get("messages") if isinstance(record, dict) else None
                try:
                    check_messages(messages, self.roles)
                except ChatError as e:
                    yield n, None, str(e) if messages is not None else 'no "messages" list'
                    continue
                yield n, [{"role": m["role"], "content": m["content"]} for m in messages], ""

    def contents(self) -> Iterator[str]:
        """Every message's content, in order: what a char or BPE vocabulary is built from."""
        for _, messages, _ in self:
            for m in messages or ():
                yield m["content"]


def _bad_lines(bad: list[tuple[int, str]]) -> list[str]:
    """The first few bad lines, each with why, then how many more and their numbers: what an error or
    prepare's summary lists so that one pass can fix them all."""
    notes = [f"line {n}: {why}" for n, why in bad[:SHOW_BAD_LINES]]
    rest = [str(n) for n, _ in bad[SHOW_BAD_LINES:]]
    if rest:
        notes.append(f"and {len(rest):,} more (line{'s' if len(rest) > 1 else ''} {', '.join(rest[:10])}"
                     f"{', ...' if len(rest) > 10 else ''})")
    return notes


def _bad_lines_error(path: Path, bad: list[tuple[int, str]], noun: str, why: str = "") -> DataError:
    return DataError(f"{path}: {plural(len(bad), noun)}{why}: {' | '.join(_bad_lines(bad))}; fix them, or pass "
                     "--errors skip to leave such lines out")


def _why_unencodable(tok: Tokenizer, messages: list[dict[str, str]], error: TokenizerError) -> str:
    """Which messages of a conversation the tokenizer cannot encode, and their characters (render_chat
    encodes them together, so its error does not say which message)."""
    parts = []
    for i, m in enumerate(messages, start=1):
        try:
            tok.encode(m["content"])
        except TokenizerError as e:
            parts.append(f"message {i} ({m['role']}): {e}")
    return "; ".join(parts) or str(error)


def _chat_tokenizer(
    kind: str | Tokenizer | None, tokenizer_file: str | os.PathLike | None, chats: _ChatFile,
    vocab_size: int | None, template: ChatTemplate | None,
) -> Tokenizer:
    """The tokenizer chat data is written with: a char vocabulary of the conversations' characters, BPE
    trained on them, GPT-2's, or a reused one; with the chat template's special tokens (unless it has them)."""
    tok = _make_tokenizer(kind, tokenizer_file)
    if tok == "char":
        chars: set[str] = set()
        for content in chats.contents():
            chars.update(content)
        tok = CharTokenizer(sorted(chars))
    elif tok == "bpe":
        tok = BPETokenizer.train(chats.contents(), vocab_size or DEFAULT_BPE_VOCAB)
    if tok.chat_template is not None and (template is None or template == tok.chat_template):
        return tok
    return with_chat_template(tok, template)


def prepare_chat(
    path: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    tokenizer: str | Tokenizer | None = "char",
    vocab_size: int | None = None,
    tokenizer_file: str | os.PathLike | None = None,
    val_fraction: float = 0.1,
    errors: str = "strict",
    template: ChatTemplate | None = None,
) -> dict[str, Any]:
    """Render the conversations of a JSONL file into a chat data folder for supervised fine-tuning.
    Returns the meta.json contents.

    Each conversation becomes its template's tokens (tinygpt.tokenizer.render_chat) and a loss mask
    beside them, 1 on the assistant's content and end-of-turn token, 0 elsewhere; the last
    `val_fraction` of the conversations are the validation split. meta.json counts conversations,
    tokens and trained tokens (the mask's sum) per split. The file is read line by line, a few times
    (check, build the vocabulary, write), never held in memory whole.

    Args:
        path: one conversation per line: {"messages": [{"role": "system"|"user"|"assistant", "content": "..."}]}.
        out_dir: the data folder to write (an existing one is replaced only if it is a tinygpt data folder).
        tokenizer: "char" (the conversations' characters), "bpe" (trained on them), "gpt2", a ready
            Tokenizer, or None to take the kind from `tokenizer_file`. The template's special tokens
            are added to it unless it carries that template already.
        vocab_size: the BPE vocabulary to train.
        tokenizer_file: GPT-2's files, or a tinygpt tokenizer.json / data or run folder to reuse.
        val_fraction: the share of conversations, from the end, held out (0 to 0.5).
        errors: "strict" stops at malformed lines, or else at conversations the tokenizer cannot encode,
            listing the first few with why and counting the others; "skip" leaves both out and counts
            them in meta.json (skipped, unencodable, skipped_lines, skipped_why).
        template: the chat template (ChatTemplate() when the tokenizer has none).

    Raises:
        DataError: malformed lines or content the tokenizer cannot encode (strict), or no conversation left.
    """
    if errors not in CHAT_ERRORS:
        raise DataError(f"errors must be one of {', '.join(CHAT_ERRORS)} for chat data, got {errors!r}")
    _check_prepare_args(val_fraction, "strict")
    src = Path(path).expanduser().resolve()
    out = Path(out_dir).expanduser().resolve()
    _check_out_dir(out)
    _check_tokenizer_args(tokenizer, vocab_size, tokenizer_file)
    chats = _ChatFile(src, template.roles if template is not None else ("system", "user", "assistant"))
    malformed, conversations = [], 0
    for n, messages, why in chats:
        if messages is None:
            malformed.append((n, why))
        else:
            conversations += 1
    if malformed and errors == "strict":
        raise _bad_lines_error(src, malformed, "malformed line")
    if not conversations:
        raise DataError(f"{src}: no conversations" + (f" ({len(malformed)} malformed lines)" if malformed else ""))
    tok = _chat_tokenizer(tokenizer, tokenizer_file, chats, vocab_size, template)
    tmp = temp_folder(out)
    try:
        counts, unencodable = _write_chat(tok, chats, tmp, val_fraction)
        if unencodable and errors == "strict":
            raise _bad_lines_error(src, unencodable, "conversation", " the tokenizer cannot encode")
        if len(unencodable) == conversations:
            raise DataError(f"{src}: no conversation the tokenizer can encode: {' | '.join(_bad_lines(unencodable))}")
        skipped = sorted(malformed + unencodable)
        meta = {
            "format": FORMAT, "version": VERSION, "content": "chat",
            "tokenizer": tok.kind, "tokenizer_fingerprint": tok.fingerprint(), "vocab_size": tok.vocab_size,
            "dtype": token_dtype(tok.vocab_size).name, **counts,
            "conversations": counts["train_conversations"] + counts["val_conversations"],
            "trained_tokens": counts["train_trained_tokens"] + counts["val_trained_tokens"],
            "val_fraction": val_fraction, "eot_id": tok.eot_id, "chat_template": tok.chat_template.to_dict(),
            "sources": [{"name": printable_path(path), "path": printable_path(src),
                         "bytes": src.stat().st_size}],
            "errors": errors, "skipped": len(skipped), "skipped_lines": [n for n, _ in skipped[:100]],
            "unencodable": len(unencodable), "skipped_why": _bad_lines(skipped),
        }
        _publish(tmp, out, tok, meta, tokenizer_file)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return meta


def _write_chat(
    tok: Tokenizer, chats: _ChatFile, folder: Path, val_fraction: float
) -> tuple[dict[str, int], list[tuple[int, str]]]:
    """Render each conversation into folder's train.bin and train.mask, then move the last val_fraction
    of them to val.bin and val.mask (how many go there is known only once every line is rendered, since
    a conversation the tokenizer cannot encode is left out). Returns the counts for meta.json and the
    conversations left out, (line number, why)."""
    dtype = token_dtype(tok.vocab_size)
    # per conversation written: where it starts, its characters, bytes and trained tokens
    starts, chars, text_bytes, trained = array("Q"), array("Q"), array("Q"), array("Q")
    unencodable: list[tuple[int, str]] = []
    ids: list[int] = []
    mask: list[int] = []
    total = 0
    with open(folder / "train.bin", "wb") as ids_file, open(folder / "train.mask", "wb") as mask_file:
        for n, messages, _ in chats:
            if messages is None:
                continue
            try:
                rendered = render_chat(tok, messages)
            except TokenizerError as e:
                unencodable.append((n, _why_unencodable(tok, messages, e)))
                continue
            starts.append(total)
            total += len(rendered.ids)
            ids += rendered.ids
            mask += rendered.mask
            chars.append(sum(len(m["content"]) for m in messages))
            text_bytes.append(sum(len(m["content"].encode("utf-8")) for m in messages))
            trained.append(sum(rendered.mask))
            if len(ids) >= CHAT_BUFFER_TOKENS:
                np.asarray(ids, dtype=dtype).tofile(ids_file)
                np.asarray(mask, dtype=np.uint8).tofile(mask_file)
                ids, mask = [], []
        np.asarray(ids, dtype=dtype).tofile(ids_file)
        np.asarray(mask, dtype=np.uint8).tofile(mask_file)
    n = len(starts)
    n_train = _split_point(n, val_fraction)
    cut = starts[n_train] if n_train < n else total  # the first validation token
    _move_tail(folder / "train.bin", folder / "val.bin", cut * dtype.itemsize)
    _move_tail(folder / "train.mask", folder / "val.mask", cut)
    offsets = np.array(starts, dtype=np.uint64)
    offsets[:n_train].tofile(folder / "train.starts")
    (offsets[n_train:] - np.uint64(cut)).tofile(folder / "val.starts")
    counts: dict[str, int] = {}
    for split, part, tokens in (("train", slice(0, n_train), cut), ("val", slice(n_train, n), total - cut)):
        counts.update({f"{split}_tokens": tokens, f"{split}_chars": sum(chars[part]),
                       f"{split}_bytes": sum(text_bytes[part]), f"{split}_conversations": len(starts[part]),
                       f"{split}_trained_tokens": sum(trained[part])})
    return counts, unencodable


def _move_tail(path: Path, tail: Path, offset: int) -> None:
    """Move the bytes of `path` from `offset` on into a new file `tail`, cutting `path` there."""
    with open(path, "r+b") as head, open(tail, "wb") as out:
        head.seek(offset)
        shutil.copyfileobj(head, out)
        head.truncate(offset)


# ---------------------------------------------------------------------------------------------
# Loading and batches


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

    @property
    def is_chat(self) -> bool:
        """Conversations with a loss mask (prepare_chat), not running text."""
        return self.masks is not None

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
    from .tokenizer.base import short_fingerprint

    def label(tok: Tokenizer | None, fp: str) -> str:
        return short_fingerprint(fp) if tok is None else f"{tok.kind}, {tok.vocab_size:,} tokens, {short_fingerprint(fp)}"

    raise DataError(
        f"{dataset.path} was prepared with another tokenizer than {owner}'s ({label(dataset.tokenizer, dataset.fingerprint)}"
        f" against {label(tokenizer, theirs)}): its ids would mean other text; "
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


# ---------------------------------------------------------------------------------------------
# Looking inside a data folder (tinygpt inspect data)

SCAN_TOKENS = 1 << 24  # ids read at a time while a folder is surveyed: memory stays a chunk whatever its size
LENGTH_BINS = 64  # document lengths by powers of two: bin 0 holds empty documents, bin k 2**(k-1) .. 2**k - 1


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
        elif ds.is_chat:  # one file per split
            documents = len(ds.starts[split])
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
    document's length leaves its separator out); a chat folder's documents are its conversations. A
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
    eot = None if ds.is_chat else tok.eot_id
    lengths = _Lengths() if ds.is_chat or eot is not None else None
    splits = {split: _scan_split(ds, split, eot, lengths) for split in ("train", "val")}
    split = "train" if len(ds.train) or not len(ds.val) else "val"
    ids = np.asarray(getattr(ds, split)[:first_tokens]).tolist()
    first: dict[str, Any] = {"split": split, "ids": ids, "text": tok.decode(ids)}
    if ds.is_chat:
        mask = ds.masks[split][: len(ids)]
        first["trained_text"] = tok.decode([i for i, m in zip(ids, mask) if m])
    return {
        "path": str(ds.path), "content": "chat" if ds.is_chat else "text", "tokenizer": tok.kind,
        "vocab_size": ds.vocab_size, "dtype": ds.dtype.name, "eot_id": eot,
        "eot_token": None if eot is None else tok.decode([eot]), "shard_tokens": meta.get("shard_tokens"),
        "documents": meta.get("documents") if lengths is None else lengths.count, "splits": splits,
        "lengths": None if lengths is None else lengths.to_dict(), "first": first,
    }


def get_batch(tokens: np.ndarray, offsets: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-token targets at the given offsets: x = tokens[o:o+T], y = tokens[o+1:o+T+1].

    Args:
        tokens: a split's token ids (a memmap from `load_data`).
        offsets: (B,) start positions, each in [0, len(tokens) - block_size - 1].
        block_size: T, the sequence length.

    Returns:
        x, y: int64 tensors of shape (B, T) on the CPU.
    """
    import torch  # here, not at the top: preparing data needs no torch (a smaller memory floor)

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
