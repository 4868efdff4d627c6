"""prepare: text SOURCEs (tinygpt.data.sources) -> a data folder of token files + meta.json; datasets are
handed to tinygpt.data.datasets, conversations are prepare_chat's (tinygpt.data.chat).

How text is read:

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
  the end (tinygpt.data.folder.publish).
"""

from __future__ import annotations

import codecs
import os
import re
import shutil
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import DataError, TokenizerError
from ..fileio import temp_folder
from ..tokenizer.base import Tokenizer
from ..tokenizer.bpe import DEFAULT_BPE_VOCAB, BPETokenizer
from ..tokenizer.char import CharTokenizer
from .datasets import DatasetArgs, prepare_dataset
from .datasources import is_dataset
from .folder import check_out_dir, folder_meta, publish, token_dtype
from .settings import (ENCODE_CHARS, Alphabet, ProgressFn, check_prepare_args, check_separator,
                       check_tokenizer_args, make_tokenizer, split_point)
from .sources import Document, Source, resolve_sources

READ_BYTES = 1 << 20  # bytes per read from a file
PIECE_CHARS = 1 << 16  # text is re-cut into pieces of about this many characters at safe token boundaries
MAX_CARRY_CHARS = 1 << 24  # a piece with no safe boundary is cut anyway past this length


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
    check_prepare_args(val_fraction, errors)
    out = Path(out_dir).expanduser().resolve()
    check_out_dir(out)
    check_tokenizer_args(tokenizer, vocab_size, tokenizer_file)
    names = [str(sources)] if isinstance(sources, (str, os.PathLike)) else [str(s) for s in sources]
    dataset = DatasetArgs(text_column, max_tokens, shard_tokens, workers, resume, errors)
    if _are_datasets(names):
        return prepare_dataset(names, out, tokenizer, vocab_size, val_fraction, tokenizer_file, progress, dataset)
    dataset.refuse_for_text(names)
    return _prepare_text(names, out, tokenizer, vocab_size, val_fraction, errors, tokenizer_file, progress)


def _are_datasets(names: list[str]) -> bool:
    """Whether the SOURCEs are datasets, all of them, or text, all of them: the two are prepared apart."""
    datasets = [is_dataset(n) for n in names]
    if any(datasets) and not all(datasets):
        raise DataError(f"{names[datasets.index(False)]} is text and {names[datasets.index(True)]} a dataset: "
                        "prepare them apart")
    return any(datasets)


def _prepare_text(names: list[str], out: Path, tokenizer: str | Tokenizer | None, vocab_size: int | None,
                  val_fraction: float, errors: str, tokenizer_file: str | os.PathLike | None,
                  progress: ProgressFn | None) -> dict[str, Any]:
    """prepare() for text: the sources resolved, read twice (the vocabulary and the split, then the ids),
    the folder published. Returns the meta.json contents."""
    srcs = resolve_sources(names, exclude=[out])
    tok_or_kind = make_tokenizer(tokenizer, tokenizer_file)
    reader = _Reader([d for s in srcs for d in s.documents], errors, progress)
    check_separator(tok_or_kind, tokenizer_file, len(reader.docs))
    bpe_vocab = vocab_size or DEFAULT_BPE_VOCAB
    tok, scan = _first_pass(srcs, reader, tok_or_kind, bpe_vocab)
    replacements = reader.replaced  # the second pass reads the same bytes again
    split_at = split_point(sum(scan.chars), val_fraction)
    tmp = temp_folder(out)  # renamed into place once complete
    try:
        counts = _second_pass(reader, tok, split_at, tmp)
        meta = {**folder_meta(tok, counts), "val_fraction": val_fraction, "documents": len(reader.docs),
                "eot_id": tok.eot_id, "sources": [s.to_meta() for s in srcs], "errors": errors,
                "replacements": replacements}
        if tok_or_kind == "bpe":
            meta["requested_vocab_size"] = bpe_vocab
        publish(tmp, out, tok, meta, tokenizer_file)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return meta


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
    is learned or checked."""

    chars: list[int]
    has_text: list[bool]  # a character that is not whitespace
    alphabet: Alphabet | None


def _scanned(srcs: list[Source], reader: _Reader, phase: str, scan: _Scan) -> Iterator[str]:
    """Every piece of every source, noted in `scan` as it goes by."""
    done = [0]
    for i, src in enumerate(srcs):
        for doc in src.documents:
            for piece in reader.pieces(doc, phase, done):
                scan.chars[i] += len(piece)
                if scan.alphabet is not None:
                    scan.alphabet.add(piece)
                if not scan.has_text[i] and not piece.isspace():
                    scan.has_text[i] = True
                yield piece


def _first_pass(
    srcs: list[Source], reader: _Reader, tok_or_kind: Tokenizer | str, bpe_vocab: int
) -> tuple[Tokenizer, _Scan]:
    """Pass 1: count characters (for the split), check there is text, and learn the vocabulary (char,
    or BPE trained on the pieces as they stream by) or check a reused char vocabulary against it."""
    checks_alphabet = tok_or_kind == "char" or isinstance(tok_or_kind, CharTokenizer)
    scan = _Scan([0] * len(srcs), [False] * len(srcs), Alphabet() if checks_alphabet else None)
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
        tok = scan.alphabet.tokenizer()
    elif tok_or_kind != "bpe":
        tok = tok_or_kind
    missing = scan.alphabet.missing(tok) if isinstance(tok, CharTokenizer) and scan.alphabet is not None else []
    if missing:
        shown = ", ".join(f"{c!r} (U+{ord(c):04X})" for c in missing[:8]) + (
            f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        )
        raise DataError(f"the corpus has {len(missing)} characters outside the reused tokenizer's vocabulary: {shown}")
    return tok, scan


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
