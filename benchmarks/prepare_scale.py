"""`tinygpt prepare` at scale: ~1 GB of text as parquet shards, tokenized with --workers 1 and 2 into
shards, against prepare's single-file path on the same documents as plain text files.

The text is prepare_memory.py's: the standard library's .py sources written out again and again,
each copy with its letters shifted, generated here (nothing downloads). Each source file is a
document: a row of a parquet file (~16 MB of text a file) and, for the single-file path, a text file
of its own (in folders of 1,000), so both paths see the same documents in the same order, separated by
<|endoftext|>. A byte-level BPE (--vocab-size) is trained once, on the first parquet file, and passed
to every run with --tokenizer-file, so the runs time tokenizing and writing only.

Runs, each its own process (peak RSS from wait4, the process with the children it waited for):
    sharded, 1 worker    prepare PARQUET --shard-tokens N --workers 1
    sharded, 2 workers   prepare PARQUET --shard-tokens N --workers 2
    single file          prepare TEXT-FILES (train.bin, val.bin; its encoder is the tokenizers
                         library's batch encoding with that library's own thread pool)
It prints tokens/s, wall time and peak memory of each (and above a process that only imports what
prepare runs: torch with the CLI, datasets, pyarrow), the ratios (2 workers against 1; sharded
against single-file), the CPU and the load average before and after (figures on a busy machine
are the machine's, not tinygpt's), and checks that 1 and 2 workers wrote the same tokens (the
sha256 of every shard in their meta.json).

    .venv/bin/python benchmarks/prepare_scale.py [--size 1GB] [--workdir DIR] [--shard-tokens N]
        [--vocab-size N] [--keep] [--json]

A quick run: --size 50MB. The work folder holds the text twice (parquet and text files) and the
tokens of one run at a time (each run's token files are removed once measured); without --workdir it
is a temporary folder, removed at the end (with --keep, kept and named).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from prepare_memory import documents, run_process

from tinygpt.calc.units import parse_count

PARQUET_BYTES = 16 << 20  # text per parquet file
ROW_GROUP = 256  # documents per row group
TEXT_FOLDER_FILES = 1000  # documents per folder of text files
FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")  # what the summary names


def cpu() -> str:
    """The CPU's model name, the vector and matrix extensions it has, and the cores this process may use."""
    try:
        info = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        name = re.search(r"^Model name:\s*(.+)$", info, re.M).group(1).strip()
        flags = set(re.search(r"^Flags:\s*(.+)$", info, re.M).group(1).split())
    except (OSError, subprocess.CalledProcessError, AttributeError):
        text = Path("/proc/cpuinfo").read_text()
        name = re.search(r"^model name\s*:\s*(.+)$", text, re.M).group(1).strip()
        flags = set(re.search(r"^flags\s*:\s*(.+)$", text, re.M).group(1).split())
    return f"{name}, {len(os.sched_getaffinity(0))} cores, {' '.join(f for f in FLAGS if f in flags) or 'no AVX2'}"


def load() -> str:
    return "load average " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


def write_corpus(root: Path, n_bytes: int) -> tuple[int, int, int]:
    """The documents as parquet files in root/parquet and as text files in root/text; returns
    (documents, text bytes, parquet files)."""
    (root / "parquet").mkdir(parents=True)
    (root / "text").mkdir()
    batch: list[str] = []
    count = size = files = batch_bytes = 0

    def flush() -> None:
        nonlocal batch, files, batch_bytes
        pq.write_table(pa.table({"text": batch}), root / "parquet" / f"part-{files:05d}.parquet",
                       row_group_size=ROW_GROUP)
        batch, files, batch_bytes = [], files + 1, 0

    for text in documents(n_bytes):
        folder = root / "text" / f"{count // TEXT_FOLDER_FILES:05d}"
        folder.mkdir(exist_ok=True)
        (folder / f"{count:07d}.txt").write_text(text, encoding="utf-8")
        n = len(text.encode())
        batch.append(text)
        count, size, batch_bytes = count + 1, size + n, batch_bytes + n
        if batch_bytes >= PARQUET_BYTES:
            flush()
    if batch:
        flush()
    return count, size, files


def prepare(*args: str | Path) -> tuple[float, float]:
    return run_process([sys.executable, "-m", "tinygpt", "prepare", *map(str, args)])


def measured(name: str, out: Path, *args: str | Path) -> dict:
    """Run one prepare into `out`; its figures, meta.json's shard index, and its token files removed."""
    print(f"  {name} ...", flush=True)
    peak, seconds = prepare(*args, "--out", out)
    meta = json.loads((out / "meta.json").read_text())
    tokens = meta["train_tokens"] + meta["val_tokens"]
    written = sum(f.stat().st_size for f in out.glob("*.bin"))
    shutil.rmtree(out)
    return {"run": name, "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds, "peak_mb": peak,
            "token_mb": written / 1e6, "shards": meta.get("shards")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="1GB", help="text to generate: 1GB (default), 50MB, ...")
    parser.add_argument("--workdir", help="where the text and the data folders go (default: a temporary folder)")
    parser.add_argument("--shard-tokens", type=int, default=10_000_000, help="tokens per shard (10,000,000)")
    parser.add_argument("--vocab-size", type=int, default=4096, help="the BPE vocabulary (4096)")
    parser.add_argument("--keep", action="store_true", help="keep the work folder")
    parser.add_argument("--json", action="store_true", help="end with one JSON line of the figures")
    args = parser.parse_args()
    n_bytes = int(parse_count(re.sub(r"(?i)b$", "", args.size.strip()), "--size"))

    before = load()
    print(f"CPU: {cpu()}\nbefore: {before}")
    root = Path(tempfile.mkdtemp(prefix="prepare-scale-", dir=args.workdir))
    try:
        start = time.perf_counter()
        docs, size, files = write_corpus(root, n_bytes)
        print(f"text: {size / 1e6:,.1f} MB, {docs:,} documents, as {files} parquet files and as {docs:,} text files "
              f"({time.perf_counter() - start:.0f} s to write)")
        _, seconds = prepare(root / "parquet" / "part-00000.parquet", "--tokenizer", "bpe", "--vocab-size",
                             args.vocab_size, "--out", root / "tokenizer")
        tok = root / "tokenizer"
        print(f"tokenizer: BPE {args.vocab_size:,} trained on the first parquet file ({seconds:.0f} s, not counted)")
        floor, _ = run_process([sys.executable, "-c", "import tinygpt.cli, tinygpt.data, datasets, pyarrow.parquet"])
        print(f"reference: a process that imports what prepare runs (the CLI, datasets, pyarrow) peaks at {floor:.0f} MB")
        shard = ("--shard-tokens", args.shard_tokens)
        runs = [measured("sharded, 1 worker", root / "w1", root / "parquet", "--tokenizer-file", tok, *shard,
                         "--workers", 1),
                measured("sharded, 2 workers", root / "w2", root / "parquet", "--tokenizer-file", tok, *shard,
                         "--workers", 2),
                measured("single file", root / "single", root / "text", "--tokenizer-file", tok)]
    finally:
        if args.keep:
            print(f"kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    after = load()
    one, two, single = runs
    same = one["shards"] == two["shards"]
    print(f"\n{'run':<20} {'tokens':>14} {'wall s':>8} {'M tokens/s':>11} {'peak MB':>8} {'over import':>12} "
          f"{'tokens MB':>10}")
    for r in runs:
        print(f"{r['run']:<20} {r['tokens']:>14,} {r['seconds']:>8.1f} {r['tokens_per_s'] / 1e6:>11.2f} "
              f"{r['peak_mb']:>8.0f} {r['peak_mb'] - floor:>+12.0f} {r['token_mb']:>10.0f}")
    ratios = {"2 workers / 1 worker": two["tokens_per_s"] / one["tokens_per_s"],
              "sharded 1 worker / single file": one["tokens_per_s"] / single["tokens_per_s"],
              "sharded 2 workers / single file": two["tokens_per_s"] / single["tokens_per_s"]}
    for name, value in ratios.items():
        print(f"{name + ':':<34} {value:.2f}x tokens/s")
    n_shards = sum(len(v) for v in one["shards"].values())
    print(f"1 and 2 workers: {'the same tokens' if same else 'DIFFERENT tokens'} ({n_shards} shards of "
          f"{args.shard_tokens:,} tokens, sha256 each)")
    print(f"before: {before}\nafter:  {after}")
    if args.json:
        print(json.dumps({"cpu": cpu(), "bytes": size, "documents": docs, "vocab_size": args.vocab_size,
                          "import_peak_mb": floor,
                          "shard_tokens": args.shard_tokens, "load_before": before, "load_after": after,
                          "runs": [{k: v for k, v in r.items() if k != "shards"} for r in runs], "ratios": ratios,
                          "same_tokens": same}))
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main()
