"""Peak memory and time of `tinygpt prepare` on a large corpus (default 100 MB).

The target: 100 MB of text prepares in under 500 MB of peak resident memory. Each prepare runs in
its own process, measured with wait4(); the reference measured in the same run is the memory of
a process that only imports tinygpt (torch included), and the time to read the corpus once.

The corpus is the standard library's .py sources written out repeatedly; each copy after the
first shifts its letters (a Caesar shift per copy), so the text keeps the statistics of code but
the number of distinct words grows with the size, as it would in real data. With --format chat the
same text becomes one JSONL file of conversations (a user turn and an assistant turn of about 1,000
characters each, a system message in every tenth) and `prepare --format chat` reads it.

    .venv/bin/python benchmarks/prepare_memory.py [--mb 100] [--kinds char,bpe] [--format chat] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import string
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from tinygpt.data import resolve_sources

LIMIT_MB = 500
FILE_BYTES = 1 << 20
TURN_CHARS = 1000


def documents(n_bytes: int) -> Iterator[str]:
    """The standard library's sources, each copy's letters shifted one further, until about n_bytes."""
    (stdlib,) = resolve_sources(["python-stdlib"])
    lower = string.ascii_lowercase
    written, copy = 0, 0
    while written < n_bytes:
        shift = copy % 26
        table = str.maketrans(lower, lower[shift:] + lower[:shift])
        for doc in stdlib.documents:
            if doc.encoding != "utf-8":
                continue
            text = doc.path.read_text(encoding="utf-8-sig").translate(table)
            yield text
            written += len(text.encode())
            if written >= n_bytes:
                return
        copy += 1


def make_corpus(folder: Path, n_bytes: int) -> Path:
    """Write about n_bytes of text as ~1 MB files in `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    out, buf = 0, []
    for text in documents(n_bytes):
        buf.append(text)
        if sum(map(len, buf)) >= FILE_BYTES:
            (folder / f"part{out:05d}.txt").write_text("".join(buf), encoding="utf-8")
            out, buf = out + 1, []
    if buf:
        (folder / f"part{out:05d}.txt").write_text("".join(buf), encoding="utf-8")
    return folder


def make_chat_corpus(path: Path, n_bytes: int) -> Path:
    """Write about n_bytes of text as a JSONL file of conversations, turns of about TURN_CHARS characters."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for n, text in enumerate(documents(n_bytes)):
            turns = [t for i in range(0, len(text), TURN_CHARS) if (t := text[i : i + TURN_CHARS]).strip()]
            for k in range(0, len(turns) - 1, 2):
                messages = [{"role": "user", "content": turns[k]}, {"role": "assistant", "content": turns[k + 1]}]
                if (n + k) % 10 == 0:
                    messages.insert(0, {"role": "system", "content": "Answer in the style of the standard library."})
                f.write(json.dumps({"messages": messages}, ensure_ascii=False) + "\n")
    return path


def run_process(args: list[str]) -> tuple[float, float]:
    """Run a command; return (peak RSS in MB, wall seconds) of its process (wait4: the children it waited for too)."""
    start = time.perf_counter()
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - start
    out, err = proc.stdout.read().decode(), proc.stderr.read().decode()
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({proc.returncode}):\n{out}{err}")
    return usage.ru_maxrss / 1024, seconds  # ru_maxrss is in KiB on Linux


def measure(corpus: Path | str, out: Path, kind: str, fmt: str = "text") -> tuple[float, float]:
    """Peak RSS (MB) and seconds of `tinygpt prepare CORPUS --tokenizer KIND --format FMT`."""
    return run_process([sys.executable, "-m", "tinygpt", "prepare", str(corpus), "--out", str(out), "--tokenizer",
                        kind, "--format", fmt])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=float, default=100, help="corpus size in MB (default 100)")
    parser.add_argument("--kinds", default="char,bpe", help="tokenizers to measure (default char,bpe)")
    parser.add_argument("--dir", help="work folder (default: a temporary one, removed after)")
    parser.add_argument("--stdlib", action="store_true", help="measure the python-stdlib corpus as it is, instead")
    parser.add_argument("--format", choices=("text", "chat"), default="text",
                        help="text files, or one JSONL file of conversations for `prepare --format chat`")
    args = parser.parse_args()
    if args.stdlib and args.format == "chat":
        parser.error("--stdlib is a text corpus; --format chat generates its conversations")

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        tmp = Path(tmp)
        if args.stdlib:
            corpus: Path | str = "python-stdlib"
            files = [d.path for d in resolve_sources([corpus])[0].documents]
        elif args.format == "chat":
            corpus = make_chat_corpus(tmp / "chat.jsonl", int(args.mb * 1e6))
            files = [corpus]
        else:
            corpus = make_corpus(tmp / "corpus", int(args.mb * 1e6))
            files = sorted(corpus.iterdir())
        floor_mb, _ = run_process([sys.executable, "-c", "import tinygpt, tinygpt.data"])
        start = time.perf_counter()
        size = sum(len(p.read_bytes()) for p in files)
        read_s = time.perf_counter() - start
        what = "python-stdlib" if args.stdlib else f"generated {args.format}"
        print(f"corpus: {what}, {size / 1e6:.1f} MB in {len(files):,} files")
        print(f"reference: import tinygpt = {floor_mb:.0f} MB peak; reading the corpus once = {read_s:.2f} s")
        for kind in args.kinds.split(","):
            peak, seconds = measure(corpus, tmp / f"data-{kind}", kind, args.format)
            print(
                f"{kind:>5}: peak {peak:5.0f} MB ({peak / LIMIT_MB:.2f} x the {LIMIT_MB} MB target, "
                f"{peak - floor_mb:+.0f} MB over import), {seconds:6.1f} s ({size / 1e6 / seconds:5.1f} MB/s, "
                f"{seconds / read_s:.0f} x a plain read)"
            )


if __name__ == "__main__":
    main()
