"""The bench's training rows: tokens/s and MFU of real `tinygpt.train` steps (AdamW, clipping, logging),
eager or compiled, beside a transformers loop on the same model, in float32 and bfloat16 autocast."""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ...calc import flops_per_token
from ...config.model import GPTConfig
from ...config.train import TrainConfig
from .machine import peak_flops
from .peers import train_transformers
from .plans import CHAR_VOCAB, Plan, bench_config, train_dtypes


def _char_data(root: Path, vocab: int) -> Path:
    """A prepared character data folder over `vocab` symbols (random text: only speed is measured)."""
    from ...data.text import prepare

    g = torch.Generator().manual_seed(0)
    alphabet = [chr(33 + i) for i in range(vocab)]
    ids = torch.randint(0, vocab, (200_000,), generator=g).tolist()
    ids[:vocab] = range(vocab)  # every symbol appears, so the vocabulary is exactly `vocab`
    text = root / "text.txt"
    text.write_text("".join(alphabet[i] for i in ids))
    prepare([str(text)], root / "data", tokenizer="char", val_fraction=0.1)
    return root / "data"


def train_tinygpt(
    cfg: GPTConfig, batch: int, steps: int, dtype: str, data: Path, *, compile: bool = False, warmup: int = 2,
    device: str = "auto",
) -> dict[str, Any]:
    """Tokens/s of `steps` real tinygpt.train optimizer steps (after `warmup` untimed ones: with compile,
    the first of them compiles)."""
    from ...run_folder import RunFolder
    from ...train.loop import train

    with tempfile.TemporaryDirectory() as tmp:
        tc = TrainConfig(
            batch_size=batch, max_iters=warmup + steps, warmup=10, eval_interval=10**6, eval_iters=1,
            dtype=dtype, compile=compile, seed=0, device=device,
        )
        start = time.perf_counter()
        train(data, Path(tmp) / "run", cfg, tc, progress=False)
        wall = time.perf_counter() - start
        lines = [json.loads(line) for line in RunFolder(Path(tmp) / "run").metrics_file.read_text().splitlines()]
    rates = [r["tokens_per_s"] for r in lines if "tokens_per_s" in r][warmup:]
    return {"tokens_per_s": statistics.median(rates), "wall_s": wall}


def training_rows(plan: Plan, device: torch.device, lim: dict[str, Any], peers: bool,
                  log: Callable[[str], None]) -> list[dict[str, Any]]:
    """Tokens/s and MFU of each model of the plan trained by tinygpt (eager, or compiled where the plan
    says) and, with `peers`, by transformers, in each dtype: interleaved rounds, the best of each kept.

    Args:
        plan: the models, batches, steps, rounds and modes to measure.
        device: where to train.
        lim: the machine's limits (machine.limits), which MFU divides by.
        peers: measure transformers beside tinygpt.
        log: called with each row's line.
    """
    rows = []
    dtypes = train_dtypes(device)
    modes = plan.train_modes or tuple((d, False) for d in dtypes)
    if plan.train_modes is None and "bfloat16" not in dtypes:
        log("train: bfloat16 rows left out: this CPU emulates bfloat16 (tinygpt trains in float32 here)")
    with tempfile.TemporaryDirectory() as tmp:
        data = _char_data(Path(tmp), CHAR_VOCAB)
        for name, batch, steps in plan.train:
            cfg = bench_config(name, training=True, vocab=plan.train_vocab, context=plan.train_context)
            flops = flops_per_token(cfg, cfg.block_size).training
            impls = [("tinygpt compiled" if c else "tinygpt", d) for d, c in modes]
            if peers:
                impls += [("transformers", d) for d in dict.fromkeys(d for d, c in modes if not c)]
            best: dict[tuple[str, str], float] = {}
            # interleaved rounds, the best of each kept: a shared host has slow spells (the README's
            # Performance section has one) that should not decide a ratio
            for _ in range(plan.repeats_train):
                for impl, dtype in impls:
                    if impl == "transformers":
                        r = train_transformers(cfg, batch, steps, dtype, device)
                    else:
                        r = train_tinygpt(cfg, batch, steps, dtype, data, compile=impl != "tinygpt",
                                          device=str(device))
                    best[impl, dtype] = max(best.get((impl, dtype), 0.0), r["tokens_per_s"])
            for (impl, dtype), tokens_per_s in best.items():
                row = {"model": name, "impl": impl, "dtype": dtype, "batch": batch, "seq_len": cfg.block_size,
                       "vocab": cfg.vocab_size, "tokens_per_s": tokens_per_s,
                       "mfu": tokens_per_s * flops / peak_flops(lim, dtype)}
                rows.append(row)
                log(f"train {name:6s} {impl:16s} {dtype:8s} {batch}x{cfg.block_size}: "
                    f"{row['tokens_per_s']:10,.0f} tokens/s  MFU {row['mfu']:.0%}")
    return rows
