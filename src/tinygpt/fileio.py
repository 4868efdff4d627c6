"""Atomic file writes and checked JSON reads, shared by every module that saves something."""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

# The largest JSON file tinygpt reads (refused unread): twice the largest tokenizer.json it writes (a
# BPE of 2^20 tokens). JSON is parsed whole, and parsed it can take many times its size in memory.
MAX_JSON_BYTES = 128 * 1024 * 1024
HASH_CHUNK = 1 << 24  # bytes read at a time when a file is hashed


def hash_file(path: str | os.PathLike, digest: Any = None) -> Any:
    """A hashlib object (sha256 unless `digest` is given, which is updated) fed a file's bytes, a chunk
    at a time: memory stays one chunk whatever the file's size."""
    digest = hashlib.sha256() if digest is None else digest
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            digest.update(chunk)
    return digest


def fsync_dir(folder: Path) -> None:
    """Make a rename inside `folder` durable."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str | os.PathLike, write: Callable[[Path], None]) -> None:
    """Call write(tmp) for a temp file beside `path`, fsync it, then rename it over `path`.

    Readers see the old file or the new one, never half of one. On any failure (a full disk
    included) the temp file is removed and `path` is untouched. The file gets the mode of any new
    file this process makes (0666 less the umask), whatever mode the writer gave it.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.unlink(missing_ok=True)  # a killed writer's of the same pid would keep its own mode
        tmp.touch()
        mode = stat.S_IMODE(tmp.stat().st_mode)
        write(tmp)
        # a writer that makes its own temp file and renames it over tmp (safetensors does, through
        # mkstemp's 0600) would leave a run's weights unreadable to those who can read its other files
        os.chmod(tmp, mode)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        if e.filename is None or e.filename == str(tmp):  # name the file the caller asked for, not the temp
            raise OSError(e.errno, e.strerror, str(path)) from e
        raise
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)


def temp_folder(out: str | os.PathLike) -> Path:
    """A fresh hidden folder beside `out` (`.NAME.tmp-PID`) to write a folder of outputs in before it
    is renamed into place. Those a killed writer left (their process is gone) are removed first."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    prefix = f".{out.name}.tmp-"
    for old in out.parent.glob(glob.escape(prefix) + "*"):
        pid = old.name[len(prefix):]
        if pid.isdigit() and old.is_dir() and not _alive(int(pid)):
            shutil.rmtree(old, ignore_errors=True)
    tmp = out.parent / f"{prefix}{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    return tmp


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):  # another user's process, or not a pid at all
        return True
    return True


@contextmanager
def new_folder(out: str | os.PathLike) -> Iterator[Path]:
    """Write a new folder whole or not at all: yields a temp folder beside `out` (temp_folder) to
    write in, and renames it to `out` when the block ends; on an error (or a kill) `out` never
    appears, and what was written is removed (a killed writer's, by the next one). `out` must not
    exist, or be an empty folder (replaced)."""
    out = Path(out)
    tmp = temp_folder(out)
    try:
        yield tmp
        fsync_dir(tmp)
        if out.is_dir() and not out.is_symlink():
            out.rmdir()  # empty, as the caller checked; rmdir refuses otherwise, and nothing is lost
        os.rename(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    fsync_dir(out.parent)


def check_output_file(path: str | os.PathLike, error: type[Exception]) -> None:
    """Refuse, before any work, a path that cannot become a file: an existing folder, or one below a
    file. Folders that do not exist yet are fine (the writer makes them). Raises `error`."""
    path = Path(path)
    if path.is_dir():
        raise error(f"{path} is a folder: give a file's name")
    check_parents(path, error)


def check_new_folder(path: str | os.PathLike, error: type[Exception]) -> None:
    """Refuse, before any work, a path that cannot become a folder of new outputs: a file, a folder
    that is not empty (what is there would mix with what is written), or a path below a file. An
    empty folder, or one that does not exist yet, is fine. Raises `error`."""
    path = Path(path)
    check_folder_path(path, error)
    if path.is_dir() and any(path.iterdir()):
        raise error(f"{path} is not empty: give a new folder (or an empty one)")


def check_folder_path(path: str | os.PathLike, error: type[Exception]) -> None:
    """Refuse a path that cannot be or become a folder: a file (a dangling link too: making the folder
    would fail), or a path below a file. A folder, or a path that does not exist yet, is fine."""
    path = Path(path)
    if path.is_dir():
        check_writable(path, error)
        return
    if path.exists() or path.is_symlink():
        raise error(f"{path} exists and is not a folder")
    check_parents(path, error)


def check_parents(path: str | os.PathLike, error: type[Exception]) -> None:
    """Refuse a path below a file: the nearest of its parents that exists must be a folder (making
    the path would fail with a bare 'Not a directory' or 'File exists') that this process can write
    in. Raises `error`."""
    path = Path(path)
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise error(f"{path}: {parent} is not a folder")
            check_writable(parent, error)
            return


def check_writable(folder: Path, error: type[Exception]) -> None:
    """Refuse a folder this process cannot make files in (no permission, a read-only or special file
    system), found by making one and removing it: the permission bits alone do not tell (root ignores
    them; /proc refuses root too). Raises `error`."""
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".tinygpt-probe-"):
            pass
    except OSError as e:
        raise error(f"cannot write in {folder}: {e.strerror or e}") from None


def printable_path(path: str | os.PathLike) -> str:
    """A path as text that any UTF-8 writer takes: bytes of a name that are not UTF-8 (which Python
    keeps as lone surrogates) are written as \\xNN escapes."""
    return os.fsencode(path).decode("utf-8", "backslashreplace")


def write_json(path: str | os.PathLike, obj: Any, indent: int | None = 2) -> None:
    """Write `obj` as UTF-8 JSON, atomically."""
    text = json.dumps(obj, ensure_ascii=False, indent=indent) + "\n"
    atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def check_regular_file(path: str | os.PathLike, error: type[Exception]) -> int:
    """The size of `path`, which must be a regular file (after symlinks): opening a FIFO or a device
    that a hostile folder put in place of a file would block or never end. Raises `error` otherwise."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise error(f"{path} is missing") from None
    if not stat.S_ISREG(info.st_mode):
        raise error(f"{path} is not a regular file")
    return info.st_size


def parse_json(text: str | bytes) -> Any:
    """json.loads, with every way a text fails to parse as a ValueError with a one-line message: a
    JSONDecodeError, a number past Python's digit limit for int, nesting past the recursion limit."""
    try:
        return json.loads(text)
    except RecursionError:  # json gives up on deeply nested arrays or objects this way
        raise ValueError("nested too deeply") from None
    except ValueError as e:  # UnicodeDecodeError among them, for bytes
        raise ValueError(str(e).split(";")[0].splitlines()[0]) from None


def jsonl_records(path: str | os.PathLike) -> Iterator[tuple[int, Any, str]]:
    """A JSONL file's records: (line number, record, "") for each line that parses, (line number, None, why)
    for one that is not UTF-8 or not JSON, blank lines skipped. Decoded line by line, so that a line that
    is not UTF-8 is a bad line like any other; a byte-order mark on the first is dropped.

    Args:
        path: the file (opening it raises OSError as open does).
    """
    with open(path, "rb") as f:
        for n, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8-sig" if n == 1 else "utf-8")
            except UnicodeDecodeError as e:
                yield n, None, f"not UTF-8 ({e.reason} at byte {e.start} of the line)"
                continue
            if not line.strip():
                continue
            try:
                yield n, parse_json(line), ""
            except ValueError as e:
                yield n, None, f"not JSON ({e})"


def read_json(path: str | os.PathLike, error: type[Exception]) -> Any:
    """Parse a JSON file; a missing, special, oversized or malformed file raises `error` with a one-line message."""
    size = check_regular_file(path, error)
    if size > MAX_JSON_BYTES:
        raise error(f"{path} holds {size:,} bytes, more than a tinygpt JSON file may ({MAX_JSON_BYTES:,})")
    try:
        return parse_json(Path(path).read_bytes().decode("utf-8"))
    except FileNotFoundError:
        raise error(f"{path} is missing") from None
    except ValueError as e:
        raise error(f"{path} is not valid JSON: {e}") from None
