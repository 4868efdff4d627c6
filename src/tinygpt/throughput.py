"""How many training FLOPs per second this machine delivers, measured with a few real training steps.

A small tinygpt GPT takes forward + backward + optimizer steps on random tokens; the FLOPs of each step
come from the calculators (calc.flops_per_token: matmul FLOPs, the convention MFU figures use), so
FLOP/s here is the useful work a training run gets, overheads included. `tinygpt chinchilla --time`
turns it into a compute budget.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from .calc import count_params, dtype_name, flops_per_token
from .config.model import GPTConfig
from .config.train import TrainConfig
from .device import DTYPES, autocast, resolve_device
from .errors import ConfigError
from .model import GPT
from .optim import make_optimizer

# Probe models. On a CPU one the size of what a laptop trains in minutes (~1M parameters); on a GPU
# GPT-2 small, since a tiny model there measures kernel-launch overhead rather than compute.
CPU_PROBE = GPTConfig(vocab_size=256, block_size=256, n_layer=4, n_head=4, n_embd=128, dropout=0.0)
GPU_PROBE = GPTConfig(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768, dropout=0.0)


@dataclass(frozen=True)
class Throughput:
    """A measured training speed.

    Args:
        flops_per_second: training FLOPs (calc's count) per wall-clock second of the timed steps.
        tokens_per_second: tokens trained on per second.
        step_seconds: mean seconds per timed step.
        steps: timed steps (after the warm-up steps).
        batch_size, seq_len: tokens per step = batch_size x seq_len.
        dtype, device: where and how it ran ("bfloat16" means autocast over float32 weights).
        params: the probe model's parameters.
        config: the probe model's architecture.
    """

    flops_per_second: float
    tokens_per_second: float
    step_seconds: float
    steps: int
    batch_size: int
    seq_len: int
    dtype: str
    device: str
    params: int
    config: GPTConfig

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "config": self.config.to_dict()}


def measure_training_throughput(
    config: GPTConfig | None = None,
    *,
    batch_size: int | None = None,
    steps: int = 5,
    warmup: int = 2,
    dtype: str = "float32",
    device: str | None = None,
    seed: int = 0,
    optimizer: str = "adamw",
) -> Throughput:
    """Time `steps` training steps (forward, backward, the optimizer's step) of a GPT on random tokens.

    Args:
        config: the model to time (default: CPU_PROBE or GPU_PROBE by device); sequences fill its block_size.
        batch_size: sequences per step (default 8).
        steps: timed steps.
        warmup: untimed steps first (allocations, kernel choices, the optimizer's state).
        dtype: "float32", or "bfloat16" for autocast over float32 weights.
        device: "cpu", "cuda" or "mps" (default: the best available, as training picks it).
        seed: for the weights and the tokens.
        optimizer: "adamw", or "muon" (its Newton-Schulz iterations cost a small model's step a share).
    """
    device = resolve_device(device or "auto").type
    dtype = dtype_name(dtype)
    if dtype == "float16":
        raise ConfigError("dtype: training is measured in float32 or bfloat16")
    if steps < 1 or warmup < 0:
        raise ConfigError(f"steps must be >= 1 and warmup >= 0, got {steps} and {warmup}")
    config = config or (GPU_PROBE if device == "cuda" else CPU_PROBE)
    B, T = batch_size or 8, config.block_size
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = GPT(config).to(device).train()
    optimizer = make_optimizer(model, TrainConfig(lr=1e-4, optimizer=optimizer), torch.device(device))
    tokens = torch.randint(0, config.vocab_size, (B, T + 1), generator=generator).to(device)
    x, y = tokens[:, :-1], tokens[:, 1:]

    def step() -> None:
        with autocast(torch.device(device), DTYPES[dtype]):
            loss = model(x, targets=y)  # the training loop's step
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    for _ in range(warmup):
        step()
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    seconds = time.perf_counter() - start
    step_tokens = B * T
    return Throughput(
        flops_per_second=flops_per_token(config, T).training * step_tokens * steps / seconds,
        tokens_per_second=step_tokens * steps / seconds,
        step_seconds=seconds / steps,
        steps=steps,
        batch_size=B,
        seq_len=T,
        dtype=dtype,
        device=device,
        params=count_params(config).total,
        config=config,
    )
