"""Run by tests/test_finetune.py in a fresh process: for each fine-tuning method given, two AdamW
steps on a small model, printing the process's peak RSS above what it held before that model was
built (Linux's VmHWM, reset through /proc/self/clear_refs between methods) beside `tinygpt params`'
estimate of the peak (calc.training_memory(...).peak), one JSON line per method.

Usage: python peak_rss.py '{}' '{"lora": {"rank": 8}}' '{"freeze_layers": 2}' '{"grad_checkpoint": true}'

Run with MALLOC_MMAP_THRESHOLD_ set (the test does): glibc then returns freed large blocks to the
system at once, so RSS follows the tensors alive rather than what the allocator chose to keep.
"""

import dataclasses
import json
import re
import resource
import sys
from pathlib import Path

import torch

from tinygpt import GPT, GPTConfig, calc
from tinygpt.config import LoraConfig, TrainConfig
from tinygpt.finetune import freeze
from tinygpt.lora import apply_lora
from tinygpt.optim import make_optimizer

CONFIG = GPTConfig(vocab_size=2048, block_size=128, n_layer=4, n_head=4, n_embd=192)
B, T = 8, 128


def resident() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def high_water_mark() -> int:
    return int(re.search(r"VmHWM:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024


def steps(model: GPT, idx: torch.Tensor, n: int = 2) -> None:
    optimizer = make_optimizer(model, TrainConfig(lr=1e-3), torch.device("cpu"))
    for _ in range(n):
        model(idx[:, :-1], targets=idx[:, 1:]).backward()  # the training loop's loss
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def measure(method: dict, idx: torch.Tensor) -> dict:
    lora = LoraConfig(**method.pop("lora")) if "lora" in method else None
    Path("/proc/self/clear_refs").write_text("5")  # the high-water mark starts again from what is resident
    baseline = resident()
    torch.manual_seed(0)
    model = GPT(CONFIG)
    if lora is not None:
        apply_lora(model, lora.rank, lora.alpha, lora.targets)
    else:
        freeze(model, embeddings=method.get("freeze_embeddings", False), layers=method.get("freeze_layers", 0))
    model.grad_checkpoint = method.get("grad_checkpoint", False)
    steps(model.train(), idx)
    estimate = calc.training_memory(CONFIG, B, T, lora=lora, **method)
    return {"peak": high_water_mark() - baseline, "estimate": estimate.peak, "total": estimate.total}


def main() -> None:
    torch.set_num_threads(1)
    # the kernels' code and workspaces, paged in by a throwaway model, belong to the baseline
    small = dataclasses.replace(CONFIG, n_layer=1, n_embd=32, n_head=2, vocab_size=64)
    steps(GPT(small).train(), torch.randint(0, 64, (2, 17)))
    idx = torch.randint(0, CONFIG.vocab_size, (B, T + 1))
    for arg in sys.argv[1:]:
        print(json.dumps(measure(json.loads(arg), idx)), flush=True)


if __name__ == "__main__":
    main()
