"""Text SOURCEs: text files, folders of them, and the built-in corpora, resolved into the files they stand for.

- A SOURCE is a text file, a folder (every text file below it, in sorted path order; hidden entries
  and binary files, those with a NUL byte in their first 8 KiB, are skipped; symlinked folders are
  followed, each real folder read once, so a link loop ends), or a built-in corpus:
  `python-stdlib` (this interpreter's standard-library .py files, read in place, each decoded as
  Python itself decodes it) or `shakespeare` (tiny-shakespeare, downloaded once into the cache).
  An existing path wins over a built-in name.

Datasets (parquet, JSONL, CSV, `hf:NAME`) are the other kind of SOURCE: tinygpt.data.datasources.
"""

from __future__ import annotations

import codecs
import os
import sysconfig
import tokenize
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import DataError
from ..fileio import printable_path

BUILTIN_CORPORA = ("python-stdlib", "shakespeare")
SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
DOWNLOAD_TIMEOUT_S = 10.0
BINARY_SNIFF_BYTES = 8192


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


def walk_files(
    root: Path, exclude: list[Path], skip_dirs: tuple[str, ...] = (), *, follow_links: bool = True
) -> list[Path]:
    """Regular files below root, in sorted path order, skipping hidden entries and excluded folders.

    Symlinked folders are followed (unless follow_links is False), each real folder once: a link
    back to a folder above it, or a second link to one already read, is skipped, so a loop ends.

    Args:
        root: the folder to walk.
        exclude: folders (resolved) never to enter.
        skip_dirs: folder names never to enter, at any depth.
        follow_links: whether to enter symlinked folders.
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
    for p in walk_files(root, exclude):
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
    for p in walk_files(root, [], skip_dirs=("site-packages", "dist-packages", "__pycache__"), follow_links=False):
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
