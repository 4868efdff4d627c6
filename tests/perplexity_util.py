"""A small model trained on the test corpus, and its perplexity through `tinygpt eval --quantize`: the
bounds each weight format must keep against float32 (test_quantize on the CPU, test_gpu on a GPU)."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import torch
from conftest import make_text

import tinygpt

# the most a format's perplexity may move from float32's on the trained model
PERPLEXITY_BOUNDS = {"bf16": 0.01, "fp16": 0.01, "int8": 0.03, "int4": 0.05}


def trained_run(root: Path, device: str = "cpu") -> Path:
    """A 2-layer, 64-wide character model trained 120 steps on make_text(1500), in root/run."""
    (root / "text.txt").write_text(make_text(1500))
    tinygpt.prepare([str(root / "text.txt")], root / "data", tokenizer="char")
    cfg = tinygpt.GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=2, n_embd=64)
    tc = tinygpt.TrainConfig(batch_size=16, max_iters=120, warmup=10, lr=3e-3, eval_interval=120, eval_iters=2,
                             device=device, dtype="float32")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a model this small trains faster on one core than on two that others share
    try:
        tinygpt.train(root / "data", root / "run", cfg, tc, progress=False)
    finally:
        torch.set_num_threads(threads)
    return root / "run"


def perplexity(run: Path, device: str = "cpu", fmt: str | None = None) -> float:
    """The run's perplexity on its own validation text, by `tinygpt eval --json` (with --quantize fmt)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = tinygpt.cli.main(["eval", str(run), "--json", "--device", device, *(["--quantize", fmt] if fmt else [])])
    assert code == 0, out.getvalue()
    return json.loads(out.getvalue().strip().splitlines()[-1])["perplexity"]
