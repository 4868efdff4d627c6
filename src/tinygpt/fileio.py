"""Atomic file writes and checked JSON reads, shared by every module that saves something."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any


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
    included) the temp file is removed and `path` is untouched.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)


def write_json(path: str | os.PathLike, obj: Any, indent: int | None = 2) -> None:
    """Write `obj` as UTF-8 JSON, atomically."""
    text = json.dumps(obj, ensure_ascii=False, indent=indent) + "\n"
    atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def read_json(path: str | os.PathLike, error: type[Exception]) -> Any:
    """Parse a JSON file; a missing or malformed file raises `error` with a one-line message."""
    try:
        return json.loads(Path(path).read_bytes().decode("utf-8"))
    except FileNotFoundError:
        raise error(f"{path} is missing") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise error(f"{path} is not valid JSON: {e}") from None
