"""prepare from datasets (tinygpt.data.datasources: `hf:NAME[:CONFIG][/SPLIT]`, parquet, JSONL and CSV
files or folders of them): streamed in one pass, a row a document, and never held whole.

- Documents are encoded on `workers` threads (Encoder) in order, in batches of at most ENCODE_CHARS
  characters (or one document), so the ids are those of one worker and memory stays a few batches;
  each split's documents are separated by `<|endoftext|>` as files are.
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

import collections
import os
import shutil
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from ..errors import DataError, TokenizerError
from ..fileio import read_json, write_json
from ..tokenizer.base import Tokenizer, load_tokenizer
from ..tokenizer.bpe import DEFAULT_BPE_VOCAB, BPETokenizer
from .datasources import DatasetSource, data_kind, dataset_source, is_hub_name
from .folder import check_out_dir, folder_meta, publish, token_dtype
from .settings import ENCODE_CHARS, SHOW_BAD_LINES, Alphabet, ProgressFn, check_separator, make_tokenizer
from .shards import ShardWriter
from .sources import walk_files

STATE_FILE = "prepare-state.json"  # in the work folder: where an interrupted prepare got to
# the smallest --shard-tokens: each shard is a file synced to disk, and --shard-tokens 10 set out to write ~44,000
# of them without a word; 65,536 uint16 tokens are a shard of 128 KiB (tests patch it to cut small shards)
MIN_SHARD_TOKENS = 1 << 16

T = TypeVar("T")


def default_workers() -> int:
    """The cores this process may run on (its CPU affinity, which a container's limit narrows)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


# ---------------------------------------------------------------------------------------------
# Encoding on worker threads


class Encoder:
    """Encodes batches of texts with `tokenizer` on `workers` threads; `map` yields each batch's
    arrays in the order the batches came, holding at most two batches per worker in flight.

    Use it as a context manager: while open, Hugging Face tokenizers run without their own thread
    pool (TOKENIZERS_PARALLELISM=false), so that N workers are N threads, not N pools.
    """

    def __init__(self, tokenizer: Tokenizer, workers: int) -> None:
        if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
            raise DataError(f"workers must be an integer >= 1, got {workers!r}")
        self.tokenizer, self.workers = tokenizer, workers
        self._pool: ThreadPoolExecutor | None = None
        self._saved_env: str | None = None

    def __enter__(self) -> Encoder:
        self._saved_env = os.environ.get("TOKENIZERS_PARALLELISM")
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="tinygpt-encode")
        return self

    def __exit__(self, *exc: Any) -> None:
        assert self._pool is not None
        self._pool.shutdown(wait=True, cancel_futures=True)
        if self._saved_env is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = self._saved_env

    def map(self, batches: Iterable[T], texts_of: Callable[[T], list[str]]) -> Iterator[tuple[T, list[np.ndarray]]]:
        """(batch, the arrays of texts_of(batch)) for each batch, in order."""
        assert self._pool is not None, "use the Encoder as a context manager"
        pending: collections.deque[tuple[T, Future]] = collections.deque()
        source = iter(batches)
        try:
            while True:
                while len(pending) < 2 * self.workers:
                    batch = next(source, None)
                    if batch is None:
                        break
                    pending.append((batch, self._pool.submit(self.tokenizer.encode_each, texts_of(batch))))
                if not pending:
                    return
                batch, future = pending.popleft()
                yield batch, future.result()
        finally:
            for _, future in pending:  # a consumer that stopped early (--max-tokens reached)
                future.cancel()


# ---------------------------------------------------------------------------------------------
# prepare


@dataclass(frozen=True)
class DatasetArgs:
    """prepare's settings that apply to datasets alone (see prepare for each); check() refuses bad ones."""

    column: str
    max_tokens: int | None
    shard_tokens: int | None
    workers: int | None
    resume: bool
    errors: str

    def check(self) -> None:
        """Refuse counts below 1, shards below MIN_SHARD_TOKENS, and --resume without shards to resume from."""
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

    def refuse_for_text(self, names: list[str]) -> None:
        """Refuse any of these settings given for text SOURCEs `names`: they apply to datasets alone."""
        for flag, value in (("--max-tokens", self.max_tokens), ("--shard-tokens", self.shard_tokens),
                            ("--workers", self.workers), ("--resume", self.resume or None),
                            ("--errors skip", self.errors if self.errors == "skip" else None)):
            if value is not None:
                raise DataError(f"{flag} applies to datasets (hf:NAME, parquet, JSONL or CSV files); "
                                f"{names[0]} is text")


def _dataset_sources(names: list[str], out: Path, column: str, errors: str) -> list[DatasetSource]:
    srcs = []
    for name in names:
        if is_hub_name(name):
            srcs.append(dataset_source(name, None, [], column, errors))
            continue
        path = Path(name).expanduser().resolve()
        if out in (path, *path.parents):
            raise DataError(f"source {name} is the output folder {out} or inside it: give another --out")
        files = [path] if path.is_file() else [f for f in walk_files(path, [out]) if data_kind(f)]
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
        alphabet = Alphabet()
        for text in _dataset_texts(srcs):
            alphabet.add(text)
        return alphabet.tokenizer()
    return tok_or_kind


def _work_folder(out: Path) -> Path:
    return out.parent / f".{out.name}.prepare"


def prepare_dataset(names: list[str], out: Path, tokenizer: str | Tokenizer | None, vocab_size: int | None,
                    val_fraction: float, tokenizer_file: str | os.PathLike | None, progress: ProgressFn | None,
                    args: DatasetArgs) -> dict[str, Any]:
    """prepare() for datasets: one streaming pass (after a first one that learns a char or BPE vocabulary).
    Returns the meta.json contents.

    Args:
        names: the dataset SOURCEs (hf:NAME, parquet / JSONL / CSV files or folders of them).
        out: the data folder to write (resolved, checked by check_out_dir).
        tokenizer, vocab_size, tokenizer_file: as prepare takes them (checked by check_tokenizer_args).
        val_fraction: the share of documents held out for validation.
        progress: called as progress("encode", bytes_done, bytes_total) as the files are read.
        args: the settings of datasets alone.
    """
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
        tok_or_kind = make_tokenizer(tokenizer, tokenizer_file)
        check_separator(tok_or_kind, tokenizer_file, 2)
        tok = _dataset_tokenizer(srcs, tok_or_kind, vocab_size or DEFAULT_BPE_VOCAB, progress)
        work.mkdir()
        tok.save(work / "tokenizer.json")
    try:
        counts = _DatasetPass(srcs, tok, work, val_fraction, args, settings, state).run(progress)
    except BaseException:
        if not (work / STATE_FILE).is_file():  # no shard to resume from: nothing worth keeping
            shutil.rmtree(work, ignore_errors=True)
        raise
    meta = {**folder_meta(tok, counts), "val_fraction": val_fraction, "eot_id": tok.eot_id,
            "sources": [s.to_meta() for s in srcs]}
    if tokenizer == "bpe" and tokenizer_file is None:
        meta["requested_vocab_size"] = vocab_size or DEFAULT_BPE_VOCAB
    (work / STATE_FILE).unlink(missing_ok=True)
    check_out_dir(out)  # again: something may have appeared there while the dataset was read
    publish(work, out, tok, meta, tokenizer_file)
    return meta


def json_round_trip(obj: Any) -> Any:
    """`obj` as it reads back from JSON (tuples become lists), to compare with what a file holds."""
    import json

    return json.loads(json.dumps(obj))


class _DatasetPass:
    """The encoding pass over a dataset: documents in order, to their split's shards, with the
    counters an interrupted pass is resumed from (recorded after each full shard)."""

    def __init__(self, srcs: list[DatasetSource], tok: Tokenizer, work: Path, val_fraction: float,
                 args: DatasetArgs, settings: dict[str, Any], state: dict[str, Any] | None) -> None:
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
