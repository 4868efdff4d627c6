"""The bench's step rows: one training step of the default block (config.RECIPE_MODEL, with Muon beside AdamW,
as `tinygpt train` gives it) and of GPT-2's block (AdamW: the 2019 recipe) at the same width and context, in
each dtype worth measuring here, measured against the machine's own matmul limit.

    step         the best time of a step (forward, backward, clipping, the optimizer) over interleaved rounds
    split        the profiler's own figures for one more step: the share of its time in matrix products (those
                 of the forward and backward, and of the optimizer: Muon's Newton-Schulz iteration), and the
                 optimizer's share
    limit        every product the step ran, timed again alone as a plain GEMM of the same shapes and dtype:
                 the time the step would take if it were its products alone at the machine's speed for them;
                 the step's GFLOP/s and the limit's, and the step's share of it (limit time / step time)

The ratio of the two blocks' steps, at each size and dtype, is one of the run's ratios (a target), beside the
ratio of their forward and backward passes alone and of their products' floating-point operations."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from ...config.fields import from_mapping
from ...config.model import GPTConfig, with_arch
from ...config.train import DEFAULT_LR, RECIPE_MODEL, RECIPE_TRAIN, TrainConfig
from ...device import autocast, reuse_freed_memory
from ...model import GPT
from ...optim import make_optimizer
from .clock import best_time
from .plans import CHAR_VOCAB, Plan, train_dtypes

# the blocks a step row compares: the default (what a new run trains) and the 2019 recipe's
BLOCKS = {"modern": (RECIPE_MODEL, RECIPE_TRAIN), "gpt2": (dict(arch="gpt2"), dict(optimizer="adamw"))}
# the products the profiler names: (b, M, K) x (b, K, N), the first input of addmm and baddbmm being what is added
PRODUCTS = ("aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm", "aten::baddbmm")


def step_model(block: str, n_layer: int, n_head: int, n_embd: int, context: int, device: torch.device
               ) -> tuple[GPT, Any]:
    """A block's model at a size over a character vocabulary, and its recipe's optimizer (TrainConfig's
    settings, DEFAULT_LR), as `tinygpt train` builds them."""
    model_over, train_over = BLOCKS[block]
    shape = dict(n_layer=n_layer, n_head=n_head, n_embd=n_embd, block_size=context, vocab_size=CHAR_VOCAB,
                 dropout=0.0)
    cfg = from_mapping(GPTConfig, with_arch(GPTConfig(**shape).to_dict(), model_over))
    torch.manual_seed(0)
    model = GPT(cfg).to(device).train()
    return model, make_optimizer(model, from_mapping(TrainConfig, {"lr": DEFAULT_LR, **train_over}), device)


def _halves(model: GPT, opt: Any, batch: torch.Tensor, dtype: torch.dtype, device: torch.device
            ) -> tuple[Callable[[], None], Callable[[], None]]:
    """A training step as train's: the loss's forward and backward under autocast, then clipping and the update."""

    def forward_backward() -> None:
        with autocast(device, dtype):
            loss = model(batch[:, :-1], targets=batch[:, 1:])
        loss.backward()

    def update() -> None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return forward_backward, update


def _profiled(fn: Callable[[], None]) -> tuple[float, float, list[tuple[str, list, int]]]:
    """fn once under the profiler: its wall seconds, the seconds its matrix products took (their own time), and
    the products as (name, input shapes, count)."""
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        start = time.perf_counter()
        fn()
        wall = time.perf_counter() - start
    events = [e for e in prof.key_averages(group_by_input_shape=True) if e.key in PRODUCTS]
    products = sum(e.self_cpu_time_total for e in events) / 1e6
    return wall, products, [(e.key, e.input_shapes, e.count) for e in events]


def _operands(name: str, shapes: list) -> tuple[list[int], list[int]] | None:
    """The two matrices (or batches of them) a product multiplied, from its input shapes."""
    a, b = (shapes[1], shapes[2]) if name in ("aten::addmm", "aten::addmm_", "aten::baddbmm") else shapes[:2]
    return (list(a), list(b)) if a and b else None


def _limit(products: list[tuple[str, list, int]], dtype: torch.dtype, repeats: int, device: torch.device
           ) -> tuple[float, float]:
    """Each product, timed alone as a plain GEMM of its shapes in `dtype` (random operands, contiguous): the
    seconds they take together (counted as often as the step ran each) and their floating-point operations."""
    seconds = flops = 0.0
    for name, shapes, count in products:
        operands = _operands(name, shapes)
        if operands is None:
            continue
        a, b = (torch.randn(s, device=device).to(dtype) for s in operands)
        seconds += count * best_time(lambda: a @ b, repeats, device)
        flops += count * 2 * a.shape[-2] * a.shape[-1] * b.shape[-1] * (a.shape[0] if a.dim() == 3 else 1)
    return seconds, flops


def step_rows(plan: Plan, device: torch.device, log: Callable[[str], None]) -> list[dict[str, Any]]:
    """The step rows of the plan's sizes (plan.step_sizes) in each dtype: both blocks' step times (interleaved
    rounds, the best kept), their split, GFLOP/s and the matmul limit of their own products.

    Args:
        plan: the sizes, batch, context and rounds to measure.
        device: where to train.
        log: called with each row's line.
    """
    rows = []
    reuse_freed_memory(device)  # as a training run's steps do
    g = torch.Generator().manual_seed(0)
    batch = torch.randint(0, CHAR_VOCAB, (plan.step_batch, plan.step_context + 1), generator=g).to(device)
    for n_layer, n_head, n_embd in plan.step_sizes:
        for dtype_name in train_dtypes(device):
            dtype = getattr(torch, dtype_name)
            steps = {b: _halves(*step_model(b, n_layer, n_head, n_embd, plan.step_context, device), batch, dtype,
                                device) for b in BLOCKS}
            best = dict.fromkeys(steps, float("inf"))
            for r in range(plan.repeats_step + 1):  # interleaved: a slow spell falls on both blocks alike
                for b, (forward_backward, update) in steps.items():
                    start = time.perf_counter()
                    forward_backward()
                    update()
                    if r:  # the first is a warmup
                        best[b] = min(best[b], time.perf_counter() - start)
            for b, (forward_backward, update) in steps.items():
                rows.append(_row(b, (n_layer, n_head, n_embd), plan, dtype_name, best[b],
                                 _profiled(forward_backward), _profiled(update), device))
                r = rows[-1]
                log(f"step {r['size']:7s} {b:6s} {dtype_name:8s} {plan.step_batch}x{plan.step_context}: "
                    f"{r['step_ms']:8.1f} ms, {1 - r['products_share']:.0%} outside matrix products, "
                    f"{r['gflops']:.0f} GFLOP/s = {r['of_limit']:.0%} of its products' limit "
                    f"({r['limit_gflops']:.0f} GFLOP/s)")
    return rows


def _row(block: str, size: tuple[int, int, int], plan: Plan, dtype: str, step_s: float,
         forward_backward: tuple[float, float, list], update: tuple[float, float, list], device: torch.device
         ) -> dict[str, Any]:
    """A step row from its best time and the profiled halves (wall, products' seconds, products)."""
    wall = forward_backward[0] + update[0]
    limit_s, flops = _limit(forward_backward[2] + update[2], getattr(torch, dtype), plan.repeats, device)
    return {"size": f"{size[0]}x{size[2]}", "block": block, "n_head": size[1],
            "optimizer": "muon+adamw" if BLOCKS[block][1].get("optimizer") == "muon" else "adamw", "dtype": dtype,
            "batch": plan.step_batch, "seq_len": plan.step_context, "step_ms": step_s * 1e3,
            "products_share": (forward_backward[1] + update[1]) / wall, "optimizer_share": update[0] / wall,
            "optimizer_products_share": update[1] / wall, "gflop": flops / 1e9, "gflops": flops / step_s / 1e9,
            "limit_ms": limit_s * 1e3, "limit_gflops": flops / limit_s / 1e9 if limit_s else 0.0,
            "of_limit": limit_s / step_s}
