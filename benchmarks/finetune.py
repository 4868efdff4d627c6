"""Speed and peak memory of fine-tuning a GPT-2-size model (12 layers, 768 wide, vocabulary 50,257;
random weights: the cost does not depend on their values) by each method, at batch 4 x 256 tokens;
with --model smollm2-135m, a SmolLM2-135M-shaped one (the Llama family: 30 layers, 576 wide, 9 heads and
3 for keys and values, SwiGLU, vocabulary 49,152).

    .venv/bin/python benchmarks/finetune.py [--model gpt2|smollm2-135m] [--steps 3] [--dtype float32] [--methods full,lora,frozen]

Methods: full (every weight trains), lora (r=8 on PEFT's default targets: c_attn for GPT-2, q_proj and
v_proj for the family), frozen (the embeddings and all blocks but the last 2 frozen), checkpoint and
lora-checkpoint (full or LoRA with activation checkpointing per block). --live runs each with
MALLOC_MMAP_THRESHOLD_=65536, so glibc returns freed blocks at once and the peak is of live tensors. Each runs in its own process, so its peak resident memory
(getrusage's ru_maxrss, which includes torch itself: the import alone is printed as the reference)
is its own. It times `--steps` AdamW steps after one warm-up step, as train()'s step does them
(the same optimizer, loss and autocast), and prints tokens/s, the peak, `tinygpt params`' estimate
of it, and the ratios the issue asks for: LoRA's peak against full's.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

BATCH, SEQ = 4, 256
MODELS = {"gpt2": "gpt2-size model (12 x 768, vocab 50,257)",
          "smollm2-135m": "smollm2-135m-shaped model (30 x 576, 9 heads, 3 kv heads, SwiGLU 1,536, vocab 49,152)"}
FROZEN = -2  # frozen: every block but the last two
METHODS = {
    "full": {},
    "lora": {"lora": {"rank": 8}},
    "frozen": {"freeze_embeddings": True, "freeze_layers": FROZEN},
    "checkpoint": {"grad_checkpoint": True},
    "lora-checkpoint": {"lora": {"rank": 8}, "grad_checkpoint": True},
}
# with --live: glibc hands freed blocks of 64 KiB and more back to the system at once, so a peak is of
# the tensors alive (what `tinygpt params` estimates) rather than of what the allocator kept
LIVE_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def model_config(name: str):
    from tinygpt import GPTConfig

    return GPTConfig.from_preset(name, block_size=SEQ, dropout=0.0)


def child(method: str, steps: int, dtype: str, name: str = "gpt2") -> dict:
    """One method, in this process: the numbers as a dict."""
    import torch

    from tinygpt import GPT, GPTConfig, calc
    from tinygpt.config import LoraConfig, TrainConfig
    from tinygpt.device import autocast, resolve_dtype
    from tinygpt.finetune import freeze
    from tinygpt.lora import apply_lora
    from tinygpt.optim import make_optimizer

    settings = dict(METHODS[method])
    recompute = settings.pop("grad_checkpoint", False)
    lora = LoraConfig(**settings.pop("lora")) if "lora" in settings else None
    config = model_config(name)
    if settings.get("freeze_layers", 0) < 0:
        settings["freeze_layers"] += config.n_layer
    device = torch.device("cpu")
    compute = resolve_dtype(dtype, device)
    torch.manual_seed(0)
    model = GPT(config)
    if lora is not None:
        apply_lora(model, lora.rank, lora.alpha, lora.targets)
    else:
        freeze(model, embeddings=settings.get("freeze_embeddings", False), layers=settings.get("freeze_layers", 0))
    model.grad_checkpoint = recompute
    model.train()
    optimizer = make_optimizer(model, TrainConfig(lr=1e-4), device)
    g = torch.Generator().manual_seed(0)
    times = []
    for step in range(steps + 1):
        idx = torch.randint(0, config.vocab_size, (BATCH, SEQ + 1), generator=g)
        t0 = time.perf_counter()
        with autocast(device, compute):
            loss = model(idx[:, :-1], targets=idx[:, 1:])  # the training loop's loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step:  # the first step allocates AdamW's state and warms the kernels up
            times.append(time.perf_counter() - t0)
    estimate = None if recompute else calc.training_memory(  # the calculator does not count recomputation
        config, BATCH, SEQ, dtype=str(compute).removeprefix("torch."), lora=lora, **settings).peak
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {"method": method, "tokens_per_s": BATCH * SEQ * len(times) / sum(times), "peak_rss": peak_rss(),
            "estimate_peak": estimate, "trainable": trainable, "dtype": str(compute).removeprefix("torch.")}


def run(args: list[str], live: bool) -> dict:
    import os

    env = {**os.environ, **(LIVE_ENV if live else {})}
    out = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, check=True, env=env).stdout
    return json.loads(out.splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt2", choices=list(MODELS), help="the model's shape (gpt2)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per method, after one warm-up step")
    parser.add_argument("--dtype", default="float32", help="float32 or bfloat16 (autocast), or auto")
    parser.add_argument("--methods", default="full,lora,frozen", help=f"of {', '.join(METHODS)}")
    parser.add_argument("--live", action="store_true", help="peaks of live tensors (see above)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.steps, args.dtype, args.model)))
        return
    import platform

    reference = json.loads(subprocess.run(
        [sys.executable, "-c", "import json, resource, torch, tinygpt.train; "
         "print(json.dumps(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024))"],
        capture_output=True, text=True, check=True).stdout)
    live = ", live-tensor peaks (MALLOC_MMAP_THRESHOLD_=65536)" if args.live else ""
    print(f"{MODELS[args.model]}, batch {BATCH} x {SEQ} tokens, {args.dtype}, "
          f"{args.steps} timed steps{live}; {platform.processor() or platform.machine()}")
    print(f"reference: a process that only imports torch and tinygpt peaks at {reference / 2**20:,.0f} MiB")
    results = {}
    for method in args.methods.split(","):
        r = results[method] = run(["--child", method, "--model", args.model, "--steps", str(args.steps), "--dtype", args.dtype], args.live)
        estimate = f"{r['estimate_peak'] / 2**30:5.2f} GiB" if r["estimate_peak"] is not None else "    -    "
        print(f"{method:<15} {r['tokens_per_s']:>8,.0f} tokens/s  peak {r['peak_rss'] / 2**30:6.2f} GiB "
              f"(estimate {estimate} + the import)  trainable {r['trainable']:>11,}", flush=True)
    full = results.get("full")
    for name in ("lora", "lora-checkpoint"):
        if full is not None and name in results:
            r = results[name]
            print(f"{name} / full: peak {r['peak_rss'] / full['peak_rss']:.2f}x "
                  f"({(r['peak_rss'] - reference) / (full['peak_rss'] - reference):.2f}x above the import), "
                  f"speed {r['tokens_per_s'] / full['tokens_per_s']:.2f}x")


if __name__ == "__main__":
    main()
