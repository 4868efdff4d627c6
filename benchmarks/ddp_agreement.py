"""How closely two processes train the model one process trains with twice the batch: `tinygpt train`
with batch 8 in one process and with batch 4 in each of two under torchrun (gloo), the same seed, data
and steps, in float32, one thread a process. For each block and optimizer it prints, after each number
of steps, the largest difference between the two runs' losses (every step's) and the first step at which
they differ by more than 1e-5, the largest between their weights outside attention's key bias, and in
the key bias (the middle third of GPT-2's c_attn bias: a gradient of zero in theory, which AdamW turns
into steps; the modern block has no biases).

The model: 4 layers x 128, 4 heads, 64 positions, on the characters of a few modules of Python's
standard library (no download); a constant learning rate without warmup, so that the longer run is
the shorter one resumed (bit for bit the same as a straight run: tests/test_distributed.py).

    .venv/bin/python benchmarks/ddp_agreement.py [--steps 10,60] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from tinygpt.checkpoint import load
from tinygpt.data import prepare

MODULES = ("argparse", "dataclasses", "textwrap", "shlex")  # ~200 KB of text any Python has
MODEL = ["--n-layer", "4", "--n-head", "4", "--n-embd", "128", "--block-size", "64"]
FLAT = ["--warmup", "0", "--lr-schedule", "constant", "--lr", "1e-3", "--dtype", "float32", "--device", "cpu",
        "--eval-interval", "100000", "--eval-iters", "1", "--quiet"]
CASES = {
    "GPT-2's block, AdamW": ["--arch", "gpt2", "--optimizer", "adamw"],
    "the modern block, AdamW": ["--optimizer", "adamw"],
    "GPT-2's block, Muon": ["--arch", "gpt2", "--optimizer", "muon"],
    "the modern block, Muon": ["--optimizer", "muon"],
}


def corpus(folder: Path) -> Path:
    """The characters of MODULES' sources, prepared in folder/data."""
    import importlib

    text = "".join(Path(importlib.import_module(name).__file__).read_text(encoding="utf-8") for name in MODULES)
    (folder / "text.txt").write_text(text, encoding="utf-8")
    prepare([str(folder / "text.txt")], folder / "data", tokenizer="char")
    return folder / "data"


def train(data: Path, out: Path, processes: int, steps: int, flags: list[str]) -> None:
    """`tinygpt train` with a global batch of 8 on `processes` processes, for `steps` steps (resuming `out`
    where it is already a run)."""
    launch = [str(Path(sys.executable).with_name("torchrun")), "--standalone", f"--nproc_per_node={processes}"]
    command = [*(launch if processes > 1 else [sys.executable]), "-m", "tinygpt", "train", "--data", str(data),
               "--out", str(out), "--batch-size", str(8 // processes), "--max-iters", str(steps), *MODEL, *FLAT,
               *flags, *(["--resume"] if (out / "train_state.pt").exists() else [])]
    subprocess.run(command, check=True, capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"})


def losses(run: Path) -> dict[int, float]:
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in lines if "loss" in r}


def differences(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[float, str, float | None]:
    """The largest difference between two models' weights outside attention's key bias, the weight that
    holds it, and the largest in the key bias (None where the model has no c_attn bias).

    Args:
        a, b: the two models' state dicts, with the same keys."""
    outside, where, key_bias = 0.0, "", None
    for name, weight in a.items():
        apart = (weight - b[name]).abs()
        if name.endswith("attn.c_attn.bias"):
            key = apart[apart.numel() // 3 : 2 * apart.numel() // 3].clone()
            key_bias = max(key_bias or 0.0, key.max().item())
            apart[apart.numel() // 3 : 2 * apart.numel() // 3] = 0
        if apart.max().item() > outside:
            outside, where = apart.max().item(), name
    return outside, where, key_bias


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", default="10,60", help="the step counts to compare at (default 10,60)")
    parser.add_argument("--dir", help="work folder (default: a temporary one, removed after)")
    args = parser.parse_args()
    counts = sorted(int(s) for s in args.steps.split(","))
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        data = corpus(Path(tmp))
        print("| block, optimizer | steps | losses | apart from step | weights (the largest where) | key bias |")
        print("|---|---:|---:|---:|---|---:|")
        for n, (case, flags) in enumerate(CASES.items()):
            runs = [Path(tmp) / f"{n}-{processes}" for processes in (1, 2)]
            for steps in counts:
                for run, processes in zip(runs, (1, 2)):
                    train(data, run, processes, steps, flags)
                one, two = map(losses, runs)
                loss = max(abs(one[s] - two[s]) for s in one)
                apart = next((str(s) for s in sorted(one) if abs(one[s] - two[s]) > 1e-5), "-")
                outside, where, key_bias = differences(*(load(run).state_dict() for run in runs))
                key = "none" if key_bias is None else f"{key_bias:.1e}"
                print(f"| {case} | {steps} | {loss:.1e} | {apart} | {outside:.1e} ({where}) | {key} |", flush=True)


if __name__ == "__main__":
    main()
