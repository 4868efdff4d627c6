"""Datasets as `tinygpt prepare` sources: a Hugging Face dataset (`hf:NAME[:CONFIG][/SPLIT]`) or local
parquet, JSONL and CSV files and folders of them, one document a row of a text column.

- Parquet is read with pyarrow, a row group at a time (a file's schema and row count come from its
  footer, so a missing or non-text column is refused before anything is written); JSON lines and CSV
  line by line, here (a row is a non-blank line, or a CSV record after the header line; a .json file
  that is one JSON array is read whole, an item a row); a Hub dataset with
  `datasets.load_dataset(..., streaming=True)`, so nothing is downloaded whole. Rows whose text is
  empty or null are skipped and counted; so are files with no rows (an empty parquet file's column
  has no type to check).
- Text that is not UTF-8 (a JSON lines or CSV row's) stops naming the file and line (errors="strict"),
  has each invalid sequence replaced by U+FFFD and counted ("replace"), or leaves its row out,
  counted ("skip"). Parquet and the Hub's text is UTF-8 by their format.
- Files are read in sorted path order, a folder's too. A folder is a dataset when it holds data
  files and nothing else but documentation (README, LICENSE, *.md, dataset_info.json), as a Hub
  snapshot does; a folder with other text files is text, read as it always was.
- A position in a source is (file, row): `rows(start)` begins there, which is how an interrupted
  prepare resumes.
- Offline (HF_HUB_OFFLINE set, or the Hub unreachable) a Hub name is one line that prints the
  download command of the config's files (_hub_files); with HF_HUB_OFFLINE=1 a copy in the `datasets`
  cache is used when there is one.

Needs the `data` extra (`pip install 'tinygpt[data]'`): datasets and pyarrow.
"""

from __future__ import annotations

import contextlib
import csv
import gzip
import io
import json
import logging
import os
import re
import shlex
import socket
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, TextIO
from urllib.parse import urlparse

from ..errors import DataError, MissingDependencyError
from ..fileio import printable_path
from .sources import walk_files

HUB_PREFIX = "hf:"
# suffix -> the reader (a `datasets` builder name, or parquet through pyarrow)
DATA_SUFFIXES = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".csv": "csv",
                 ".jsonl.gz": "json", ".json.gz": "json", ".csv.gz": "csv"}
_DOC_FILE = re.compile(r"(readme|license|licence|copying|notice)(\..*)?|.*\.md|dataset_infos?\.json|dataset_dict\.json",
                       re.IGNORECASE)
BATCH_ROWS = 1024  # rows per batch read from a file
ERRORS = ("strict", "replace", "skip")  # what text that is not UTF-8 does (see the module docstring)
# csv's default limit on a field, 131,072 characters, would refuse a book; it is the process's, raised not lowered
CSV_FIELD_CHARS = (1 << 31) - 1
_UNDECODED = re.compile("[\udc80-\udcff]+")  # bytes that are not UTF-8, as errors="surrogateescape" reads them
HUB_TIMEOUT_S = 5.0  # seconds to wait for the Hub's address to answer


def data_kind(path: Path) -> str | None:
    """"parquet", "json" or "csv" for a data file (by its suffix), else None."""
    name = path.name.lower()
    return next((kind for suffix, kind in DATA_SUFFIXES.items() if name.endswith(suffix)), None)


def is_dataset_folder(files: list[Path]) -> bool:
    """Whether a folder's files are a dataset: data files, and nothing else but documentation."""
    data = [f for f in files if data_kind(f)]
    return bool(data) and all(data_kind(f) or _DOC_FILE.fullmatch(f.name) for f in files)


def is_hub_name(source: str) -> bool:
    return str(source).startswith(HUB_PREFIX)


def is_dataset(source: str) -> bool:
    """Whether a SOURCE is a dataset: hf:NAME, a parquet / JSONL / CSV file, or a folder of them.

    Args:
        source: a SOURCE as given to prepare.
    """
    if is_hub_name(source):
        return True
    path = Path(source).expanduser()
    if path.is_file():
        return data_kind(path) is not None
    return path.is_dir() and is_dataset_folder(walk_files(path.resolve(), []))


@dataclass(frozen=True)
class HubName:
    """A Hub dataset as `hf:NAME[:CONFIG][/SPLIT]` names it."""

    name: str
    config: str | None = None
    split: str = "train"

    @classmethod
    def parse(cls, source: str) -> HubName:
        """`hf:org/name`, `hf:org/name/split`, `hf:org/name:config`, `hf:org/name:config/split`; a name
        without an organization (`hf:wikitext`) takes a split only after a config."""
        spec = source[len(HUB_PREFIX):]
        name, _, rest = spec.partition(":")
        config, split = None, "train"
        if rest:
            config, _, split = rest.partition("/")
            split = split or "train"
        elif name.count("/") == 2:
            name, _, split = name.rpartition("/")
        if not re.fullmatch(r"[\w.-]+(/[\w.-]+)?", name) or (config is not None and not config) or not split:
            raise DataError(f"{source}: not a Hugging Face dataset name; write hf:NAME[:CONFIG][/SPLIT], "
                            "e.g. hf:HuggingFaceFW/fineweb-edu:sample-10BT/train")
        return cls(name, config, split)

    def __str__(self) -> str:
        return HUB_PREFIX + self.name + (f":{self.config}" if self.config else "") + f"/{self.split}"


class Rows(NamedTuple):
    """A batch of a source's rows: its file (part) and first row, each row's text (None where it has none
    or was left out), and the rows whose text was not UTF-8, as (index in texts, where, invalid sequences)."""

    part: int
    row: int
    texts: list[Any]
    invalid: Sequence[tuple[int, str, int]] = ()


@dataclass
class DatasetSource:
    """A dataset SOURCE: its files (or Hub name), the column read, and what reading it found."""

    name: str
    column: str
    files: list[Path] = field(default_factory=list)
    hub: HubName | None = None
    path: Path | None = None
    errors: str = "strict"  # what a row's text that is not UTF-8 does: strict, replace or skip
    documents: int = 0  # rows read with text, counted as they are read
    empty: int = 0  # rows whose text is empty or null, skipped
    text_bytes: int = 0  # UTF-8 bytes of the documents read
    empty_files: int = 0  # files with no rows, left out
    invalid: int = 0  # rows whose text was not UTF-8 (replaced or left out)
    replaced: int = 0  # invalid UTF-8 sequences those rows held

    @property
    def size(self) -> int:
        """Bytes of its files (a Hub dataset: of the text read)."""
        return sum(f.stat().st_size for f in self.files) if self.hub is None else self.text_bytes

    @property
    def parts(self) -> int:
        return len(self.files) if self.hub is None else 1

    def to_meta(self) -> dict[str, Any]:
        meta = {"name": printable_path(self.name), "kind": "dataset", "column": self.column,
                "files": len(self.files), "bytes": self.size, "documents": self.documents, "skipped": self.empty,
                "empty_files": self.empty_files, "invalid_rows": self.invalid, "replacements": self.replaced}
        if self.hub is not None:
            meta.update(dataset=self.hub.name, config=self.hub.config, split=self.hub.split)
        else:
            meta["path"] = printable_path(self.path)
        return meta

    def describe_files(self) -> list[list[Any]]:
        """(path, size, mtime) of each file, or the Hub name: what a resumed prepare must find unchanged."""
        if self.hub is not None:
            return [[str(self.hub)]]
        return [[str(f), (st := f.stat()).st_size, st.st_mtime_ns] for f in self.files]

    def check(self) -> None:
        """Refuse a missing or non-text column, or an empty dataset, before anything is written (from
        the parquet footers, no data read; else the first rows), and leave out the files with no rows."""
        _require()
        if self.hub is not None:
            self._hub_dataset()  # opens it: a name that is not there, offline, a bad config or split
            return
        kept = [f for f in self.files if self._has_rows(f)]
        if not kept:
            raise DataError(f"{self.name} holds no rows: an empty dataset")
        self.files, self.empty_files = kept, len(self.files) - len(kept)

    def _has_rows(self, path: Path) -> bool:
        if data_kind(path) != "parquet":
            return next(_read_lines(path, self.column, 0, self.errors), None) is not None
        pf = _parquet_file(path)
        if not pf.metadata.num_rows:  # its column may have no type to check (pandas writes an empty one as null)
            return False
        _check_arrow_column(pf.schema_arrow, self.column, path)
        return True

    def rows(self, start: tuple[int, int] = (0, 0)) -> Iterator[Rows]:
        """Batches of rows from position `start` (part, row) on, in order."""
        _require()
        part0, row0 = start
        with _quiet_datasets():
            if self.hub is not None:
                yield from (Rows(0, r, texts) for r, texts in self._read_hub(row0))
                return
            for part in range(part0, len(self.files)):
                f = self.files[part]
                first = row0 if part == part0 else 0
                if data_kind(f) == "parquet":
                    yield from (Rows(part, r, texts) for r, texts in _read_parquet(f, self.column, first))
                else:
                    yield from (Rows(part, *batch) for batch in _read_lines(f, self.column, first, self.errors))

    # -- the Hub

    def _hub_dataset(self) -> Any:
        """The dataset, streamed from the Hub (or from the datasets cache in offline mode)."""
        import datasets

        hub = self.hub
        offline = _env_offline()
        if not offline and not _hub_reachable():
            offline = True
        if offline and not datasets.config.HF_HUB_OFFLINE:
            # datasets would try the network (and retry for half a minute): it reads offline mode at import
            raise DataError(_offline_message(hub))
        try:
            with _quiet_datasets():
                ds = datasets.load_dataset(hub.name, hub.config, split=hub.split, streaming=not offline)
        except (ConnectionError, TimeoutError) as e:
            if offline or "OfflineModeIsEnabled" in str(e) or "Couldn't reach" in str(e):
                raise DataError(_offline_message(hub)) from None
            raise DataError(f"{hub}: {_first_line(e)}") from None
        except datasets.exceptions.DatasetNotFoundError:
            raise DataError(f"{hub}: no such dataset on the Hugging Face Hub (a gated or private one needs "
                            "`hf auth login`)") from None
        except Exception as e:  # a config or split it does not have, a dataset script, ...
            raise DataError(f"{hub}: {_first_line(e)}") from None
        features = getattr(ds, "features", None)
        if features is not None:
            _check_features(features, self.column, str(hub))
        return ds

    def _read_hub(self, first: int) -> Iterator[tuple[int, list[Any]]]:
        ds = self._hub_dataset()
        if first:
            ds = ds.skip(first)
        row = first
        try:
            for batch in ds.iter(batch_size=BATCH_ROWS):
                texts = _column_of(batch, self.column, str(self.hub))
                yield row, texts
                row += len(texts)
        except DataError:
            raise
        except Exception as e:
            raise DataError(f"{self.hub}: reading row {row:,} failed: {_first_line(e)}") from None


def dataset_source(name: str, path: Path | None, files: list[Path], column: str,
                   errors: str = "strict") -> DatasetSource:
    """A local dataset (its data files, in order) or a Hub one (`path` None, `name` hf:...).

    Args:
        name: the SOURCE as given.
        path: the file or folder (None for a Hub dataset).
        files: its data files, in the order they are read.
        column: the column of text.
        errors: text that is not UTF-8: "strict" stops naming the line, "replace" substitutes U+FFFD,
            "skip" leaves the row out.
    """
    if not isinstance(column, str) or not column:
        raise DataError("--text-column must name a column")
    if errors not in ERRORS:
        raise DataError(f"errors must be one of {', '.join(ERRORS)} for a dataset, got {errors!r}")
    if path is None:
        return DatasetSource(name, column, hub=HubName.parse(name), errors=errors)
    return DatasetSource(name, column, files=files, path=path, errors=errors)


# ---------------------------------------------------------------------------------------------


def _require() -> None:
    try:
        import datasets  # noqa: F401
        import pyarrow  # noqa: F401
    except ImportError:
        raise MissingDependencyError("reading datasets needs the datasets and pyarrow packages: "
                                     "pip install 'tinygpt[data]'") from None


@contextlib.contextmanager
def _quiet_datasets():
    """datasets logs a failed file at ERROR level before raising: the caller's one-line error says it."""
    logger = logging.getLogger("datasets")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _first_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0]


def _is_text_type(t: Any) -> bool:
    import pyarrow as pa

    if pa.types.is_dictionary(t):
        t = t.value_type
    return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t)


def _no_column(where: str, column: str, columns: list[str]) -> DataError:
    shown = ", ".join(columns) if columns else "none"
    return DataError(f"{where} has no column {column!r} (its columns: {shown}); name the text with --text-column")


def _not_text(where: str, column: str, kind: str, text_columns: list[str]) -> DataError:
    hint = f" (its text columns: {', '.join(text_columns)})" if text_columns else " (it has no text column)"
    return DataError(f"column {column!r} of {where} holds {kind}, not text; choose another with --text-column{hint}")


def _check_arrow_column(schema: Any, column: str, where: Path | str) -> None:
    import pyarrow as pa

    names = list(schema.names)
    if column not in names:
        raise _no_column(str(where), column, names)
    t = schema.field(column).type
    # null: no row has a value (pandas writes a column of None so): rows without text, skipped and counted
    if not _is_text_type(t) and not pa.types.is_null(t):
        raise _not_text(str(where), column, str(t), [n for n in names if _is_text_type(schema.field(n).type)])


def _check_features(features: Any, column: str, where: str) -> None:
    names = list(features)
    if column not in names:
        raise _no_column(where, column, names)

    def dtype(f: Any) -> str:
        return getattr(f, "dtype", None) or type(f).__name__

    if dtype(features[column]) not in ("string", "large_string", "null"):
        texts = [n for n in names if dtype(features[n]) in ("string", "large_string")]
        raise _not_text(where, column, dtype(features[column]), texts)


def _column_of(batch: dict[str, list[Any]], column: str, where: str) -> list[Any]:
    """A batch's texts, each a str or None; anything else is a non-text column."""
    if column not in batch:
        raise _no_column(where, column, list(batch))
    texts = batch[column]
    bad = next((v for v in texts if v is not None and not isinstance(v, str)), None)
    if bad is not None:
        others = [k for k, vs in batch.items() if vs and all(isinstance(v, str) or v is None for v in vs)]
        raise _not_text(where, column, type(bad).__name__, others)
    return texts


def _parquet_file(path: Path) -> Any:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path)
    except (pa.ArrowException, OSError, ValueError) as e:
        raise DataError(f"{path}: not a readable parquet file ({_first_line(e)})") from None


def _read_parquet(path: Path, column: str, first: int) -> Iterator[tuple[int, list[Any]]]:
    """A parquet file's texts from row `first` on, a row group at a time."""
    import pyarrow as pa

    pf = _parquet_file(path)
    _check_arrow_column(pf.schema_arrow, column, path)
    meta = pf.metadata
    group, before = 0, 0  # the row group holding row `first`, and the rows before it
    while group < meta.num_row_groups and before + meta.row_group(group).num_rows <= first:
        before += meta.row_group(group).num_rows
        group += 1
    row, drop = before, first - before
    try:
        for batch in pf.iter_batches(batch_size=BATCH_ROWS, columns=[column],
                                     row_groups=range(group, meta.num_row_groups), use_threads=False):
            texts = batch.column(0).to_pylist()
            row += len(texts)
            if drop:
                texts, drop = texts[drop:], max(0, drop - len(texts))
            if texts:
                yield row - len(texts), texts
    except (pa.ArrowException, OSError, ValueError) as e:
        raise DataError(f"{path}: not a readable parquet file ({_first_line(e)})") from None


def _read_lines(path: Path, column: str, first: int, errors: str) -> Iterator[tuple[int, list[Any], list]]:
    """A JSON lines or CSV file's texts from row `first` on, BATCH_ROWS at a time, as (first row, texts,
    invalid) with Rows' meaning; a row's text that is not UTF-8 is refused, replaced or left out (`errors`)."""
    csv_file, name = data_kind(path) == "csv", printable_path(path)  # a name that is not UTF-8 goes to meta.json
    row, texts, invalid = 0, [], []
    try:
        with _open_text(path) as f:
            for row, (where, text) in enumerate(_csv_texts(f, name, column) if csv_file
                                                else _json_texts(f, name, column)):
                if row < first:
                    continue
                if text is not None and not text.isascii():
                    text, n = _decoded(text, errors, where)
                    if n:
                        invalid.append((len(texts), where, n))
                texts.append(text)
                if len(texts) == BATCH_ROWS:
                    yield row + 1 - len(texts), texts, invalid
                    texts, invalid = [], []
        if texts:
            yield row + 1 - len(texts), texts, invalid
    except (OSError, EOFError, zlib.error, csv.Error) as e:  # a file that vanished, a corrupt .gz, a CSV quote
        raise DataError(f"{name}: not readable as {'CSV' if csv_file else 'JSON lines'} ({_first_line(e)})") from None


def _open_text(path: Path) -> TextIO:
    """A JSON lines or CSV file (gzip-compressed where its name ends .gz) as text: UTF-8, a leading BOM
    dropped, line endings as they are; bytes that are not UTF-8 read as lone surrogates (surrogateescape),
    so that a row holding them is refused, replaced or skipped by itself (_decoded)."""
    raw = gzip.open(path, "rb") if path.name.lower().endswith(".gz") else open(path, "rb")
    return io.TextIOWrapper(raw, encoding="utf-8-sig", errors="surrogateescape", newline="")


def _decoded(text: str, errors: str, where: str) -> tuple[str | None, int]:
    """A row's text as UTF-8 text, and how many invalid sequences it held: refused naming `where` (strict),
    the row left out (skip: None), or each invalid sequence one U+FFFD, as Python's "replace" makes it."""
    bad = _UNDECODED.search(text)
    if bad is None:
        return text, 0
    if errors == "strict":
        shown = bad.group().encode("utf-8", "surrogateescape")[:4].hex(" ")
        raise DataError(f"{where}: invalid UTF-8 ({shown}); use --errors replace to substitute U+FFFD or "
                        "--errors skip to leave such rows out")
    fixed = _UNDECODED.sub(lambda m: m.group().encode("utf-8", "surrogateescape").decode("utf-8", "replace"), text)
    return None if errors == "skip" else fixed, fixed.count("\ufffd") - text.count("\ufffd")


def _json_texts(f: TextIO, name: str, column: str) -> Iterator[tuple[str, str | None]]:
    """(where, text or None) of each row of JSON lines file `name`; the first row must have the column."""
    for k, (where, obj) in enumerate(_json_rows(f, name)):
        if not isinstance(obj, dict):
            raise DataError(f"{where}: not a JSON object (a row is one, its text in {column!r})")
        if not k and column not in obj:
            raise _no_column(name, column, list(obj))
        text = obj.get(column)
        if text is not None and not isinstance(text, str):
            raise _not_text(where, column, type(text).__name__, [c for c, v in obj.items() if isinstance(v, str)])
        yield where, text


def _json_rows(f: TextIO, name: str) -> Iterator[tuple[str, Any]]:
    """(where, value) of each non-blank line, or of each item of a file that is one JSON array (read
    whole, as the `datasets` library reads one)."""
    first = True
    for n, line in enumerate(f, 1):
        if not line.strip():
            continue
        if first and line.lstrip().startswith("["):
            items = _json_value(line + f.read(), name, n)
            yield from ((f"{name} item {k:,}", item) for k, item in enumerate(items, 1))
            return
        first = False
        yield f"{name} line {n:,}", _json_value(line, name, n)


def _json_value(text: str, name: str, line: int) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as e:
        at = line + getattr(e, "lineno", 1) - 1
        raise DataError(f"{name} line {at:,}: not JSON ({getattr(e, 'msg', None) or _first_line(e)})") from None


def _csv_texts(f: TextIO, name: str, column: str) -> Iterator[tuple[str, str | None]]:
    """(where, text or None where the record is short) of each record of CSV file `name` after the header
    line; blank lines are no records."""
    csv.field_size_limit(max(csv.field_size_limit(), CSV_FIELD_CHARS))
    reader = csv.reader(f)
    header = next(reader, None)
    if header is None:
        return
    if column not in header:
        raise _no_column(name, column, header)
    i = header.index(column)
    line = reader.line_num + 1  # a record's first line: a quoted field may hold line breaks
    for record in reader:
        if record:
            yield f"{name} line {line:,}", record[i] if i < len(record) else None
        line = reader.line_num + 1


def _env_offline() -> bool:
    return any(os.environ.get(v, "").strip().upper() in ("1", "ON", "YES", "TRUE")
               for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))


def _hub_reachable(timeout: float = HUB_TIMEOUT_S) -> bool:
    """Whether the Hub's host answers on its port: a machine without a network fails here in
    milliseconds, where huggingface_hub would retry for half a minute."""
    endpoint = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    port = endpoint.port or (443 if endpoint.scheme == "https" else 80)
    try:
        socket.create_connection((endpoint.hostname or "huggingface.co", port), timeout=timeout).close()
    except OSError:
        return False
    return True


def _offline_message(hub: HubName) -> str:
    folder = f"data/hf/{hub.name.rsplit('/', 1)[-1]}"
    patterns, whose = _hub_files(hub)
    # one pattern a flag: hf reads a second word after --include as a file name, and then ignores --include
    include = "".join(f" --include {shlex.quote(p)}" for p in patterns)
    return (f"{hub}: the Hugging Face Hub cannot be reached (offline); on a machine online, download it with "
            f"`hf download {hub.name} --repo-type dataset{include} --local-dir {folder}`{whose} and prepare the "
            "folder of its parquet or JSONL files from there (or, with HF_HUB_OFFLINE=1, a copy in the datasets "
            "cache is read)")


def _hub_files(hub: HubName) -> tuple[list[str], str]:
    """The `hf download --include` patterns of the config (and split) asked for, and where they come from.

    A config's files are the `data_files` of its entry in the dataset card's `configs:` (README.md's YAML;
    fineweb-edu's sample-10BT is sample/10BT/*), read from the Hugging Face cache when the dataset was
    opened here before. Without the card, the files of a folder named after the config are a guess, said
    so: the whole repository would be every config (terabytes for fineweb-edu). No config named and none
    in the card: the whole dataset, as asked."""
    try:
        from datasets.data_files import sanitize_patterns
        from datasets.utils.metadata import MetadataConfigs
        from huggingface_hub import try_to_load_from_cache
        from huggingface_hub.repocard import metadata_load

        card = try_to_load_from_cache(hub.name, "README.md", repo_type="dataset")
        configs = MetadataConfigs.from_dataset_card_data(metadata_load(card) or {}) if isinstance(card, str) else {}
        config = hub.config or (configs.get_default_config_name() if configs else None)
        splits = sanitize_patterns(configs[config]["data_files"]) if configs.get(config, {}).get("data_files") else {}
    except Exception:  # a card datasets cannot read, or a datasets release whose internals differ: guess
        config, splits = hub.config, {}
    if splits:
        named = hub.split in splits
        patterns = splits[hub.split] if named else [p for files in splits.values() for p in files]
        return patterns, (f" (config {config}'s {hub.split + ' ' if named else ''}files, as the dataset card in the "
                          "Hugging Face cache names them)")
    if config is None:
        return [], ""
    return [f"{config}/*", f"*/{config}/*"], (f" (a guess, a folder named {config}: the dataset card's configs: "
                                              f"section names the config's files; `hf download {hub.name} README.md "
                                              "--repo-type dataset` fetches the card)")
