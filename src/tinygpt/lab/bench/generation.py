"""The bench's generation rows: prefill tokens/s, time to first token and decode tokens/s of every engine
(tinygpt in each weight format, eager and compiled, the model as tinygpt.load gives it, transformers and
llama.cpp on the same weights) at the plan's batches, with and without the KV cache, and the share of
the memory bandwidth a tinygpt decode step uses; the llama.cpp comparison again beside a busy core."""

from __future__ import annotations

import copy
import functools
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ...generate import generate_stream
from ...interop.hf import to_transformers
from ...interop.quantize import quantize
from ...model import GPT
from .clock import Clock
from .machine import peak_bandwidth
from .peers import generate_llama, generate_transformers, llama_failure, llama_files, load_llama
from .plans import Plan, bench_config, peer_formats
from .report import engine_name

Engine = tuple[str, str, Any, list[tuple[bool, int]]]  # (impl, weight format, model, cases: (kv cache, batch))


def generation_rows(plan: Plan, device: torch.device, lim: dict[str, Any], peers: bool, llama: bool,
                    log: Callable[[str], None]) -> list[dict[str, Any]]:
    """Every generation row of the plan, model by model.

    Args:
        plan: the models, batches, formats, tokens and rounds to measure.
        device: where to decode.
        lim: the machine's limits (machine.limits), which bandwidth use divides by.
        peers: measure transformers on the plan's generation models.
        llama: measure llama.cpp on the plan's llama models (on a CPU).
        log: called with each row's line, and with what is left out and why.
    """
    rows = []
    if peers and "bf16" in plan.peer_formats and "bf16" not in peer_formats(plan, device):
        log("generate: transformers' bf16 rows left out: this CPU emulates bfloat16")
    llama_models = plan.llama_models if llama and device.type == "cpu" else ()
    for name in dict.fromkeys(plan.gen_models + llama_models):  # in order, each once
        with tempfile.TemporaryDirectory() as tmp:
            rows += _model_rows(name, plan, device, lim, peers and name in plan.gen_models,
                                Path(tmp) if name in llama_models else None, log)
    return rows


def _model_rows(name: str, plan: Plan, device: torch.device, lim: dict[str, Any], peers: bool,
                llama_dir: Path | None, log: Callable[[str], None]) -> list[dict[str, Any]]:
    """Every engine's rows for one model; a model measured only against llama.cpp gets batch 1 with the cache."""
    cfg = bench_config(name, training=False)
    torch.manual_seed(0)
    base = GPT(cfg).to(device).eval()
    full = name in plan.gen_models
    cases = [(True, b) for b in plan.gen_batches] + [(False, 1)] if full else [(True, 1)]
    engines = _peer_engines(name, base, plan, device, cases, peers, llama_dir, log)
    ours, models = _tinygpt_engines(base, plan, device, cases, full)
    engines += ours
    g = torch.Generator().manual_seed(1)
    prompts = {b: torch.randint(0, cfg.vocab_size, (b, plan.prompt), generator=g).to(device) for b in plan.gen_batches}
    best: dict[tuple, dict[str, Any]] = {}
    rounds = functools.partial(_rounds, best, name, plan, prompts)
    rounds(engines, "quiet", plan.repeats_gen)
    if llama_dir is not None:  # the llama.cpp comparison's rows get the rest of their rounds
        rounds(_at_batch_1(engines, "tinygpt", "tinygpt.load", "llama.cpp"), "quiet",
               plan.repeats_llama - plan.repeats_gen)
    if plan.busy and llama_dir is not None:  # tinygpt and llama.cpp at batch 1 again, a core taken
        with busy_core():
            rounds(_at_batch_1(engines, "tinygpt", "llama.cpp"), "busy", max(plan.repeats_gen, plan.repeats_llama))
    for impl, _, model, _ in engines:
        if impl == "llama.cpp":
            model.close()  # its threads and buffers, before the next model's
    return _finished_rows(name, best, models, plan, lim, log)


def _peer_engines(name: str, base: GPT, plan: Plan, device: torch.device, cases: list[tuple[bool, int]],
                  peers: bool, llama_dir: Path | None, log: Callable[[str], None]) -> list[Engine]:
    """With `peers`, transformers on the same weights in each of its formats; with a `llama_dir`, llama.cpp
    on GGUF files of them written there, each format it can decode on this machine."""
    engines: list[Engine] = []
    if peers:
        hf = to_transformers(base).to(device)
        for fmt in peer_formats(plan, device):
            engines.append(("transformers", fmt, hf if fmt == "fp32" else copy.deepcopy(hf).to(torch.bfloat16), cases))
    if llama_dir is not None:
        n_ctx = base.config.block_size
        for fmt, path in llama_files(base, llama_dir, plan.llama_formats).items():
            failure = llama_failure(path, n_ctx)
            if failure:
                log(f"generate {name}: llama.cpp {fmt} left out: {failure} (the README's Performance section "
                    "says how to build llama.cpp without its AMX kernels, which fault in some virtual machines)")
                continue
            engines.append(("llama.cpp", fmt, load_llama(path, n_ctx), [(True, 1)]))
    return engines


def _tinygpt_engines(base: GPT, plan: Plan, device: torch.device, cases: list[tuple[bool, int]],
                     full: bool) -> tuple[list[Engine], dict[str, Any]]:
    """tinygpt in each of the plan's formats (through torch.compile too, where the plan says), and on a
    CPU the model as tinygpt.load gives it; with the models by format. `base` becomes the fp32 one."""
    formats = [f for f in plan.formats if f != "int4" or device.type == "cpu"]  # int4 is a CPU kernel
    copies = {fmt: copy.deepcopy(base) for fmt in formats if fmt != "fp32"}  # before packing: no copies after
    engines: list[Engine] = []
    if "fp32" in formats and device.type == "cpu":  # the model as tinygpt.load gives it, beside the CLI's layout
        engines.append(("tinygpt.load", "fp32", copy.deepcopy(base), [(True, 1)]))
    copies["fp32"] = base
    models = {fmt: quantize(copies[fmt], fmt) for fmt in formats}
    engines += [("tinygpt", fmt, models[fmt], cases) for fmt in formats]
    # the same models decoded through torch.compile: (True, batch) cases of engines named "tinygpt compiled"
    compiled = [(fmt, b) for fmt, b in plan.gen_compiled if fmt in models and b in plan.gen_batches and full]
    engines += [("tinygpt compiled", fmt, models[fmt], [(True, b) for f, b in compiled if f == fmt])
                for fmt in dict.fromkeys(f for f, _ in compiled)]
    return engines, models


def _rounds(best: dict[tuple, dict[str, Any]], name: str, plan: Plan, prompts: dict[int, torch.Tensor],
            engines: list[Engine], condition: str, count: int) -> None:
    """`count` rounds of every engine's cases, the fastest of each kept in `best` (keyed by impl, format,
    batch, cache and condition)."""
    runners = {"tinygpt": generate_tinygpt, "tinygpt.load": generate_tinygpt, "transformers": generate_transformers,
               "llama.cpp": generate_llama, "tinygpt compiled": functools.partial(generate_tinygpt, compile=True)}
    for _ in range(count):  # interleaved, so a busy moment hits every engine alike
        for impl, fmt, model, engine_cases in engines:
            fn = runners[impl]
            for use_cache, batch in engine_cases:
                idx = prompts[batch]
                new = plan.new_tokens if use_cache else plan.no_cache_tokens
                fn(model, idx[:, :8], 2, use_cache=use_cache)  # warm up kernels and allocations (and compile)
                r = fn(model, idx, new, use_cache=use_cache)
                key = (impl, fmt, batch, use_cache, condition)
                if key not in best or r["decode_tokens_per_s"] > best[key]["decode_tokens_per_s"]:
                    best[key] = {"model": name, "impl": impl, "format": fmt, "batch": batch, "kv_cache": use_cache,
                                 "prompt": plan.prompt, "new_tokens": new, "condition": condition, **r}


def _at_batch_1(engines: list[Engine], *impls: str) -> list[Engine]:
    return [(impl, fmt, model, [(True, 1)]) for impl, fmt, model, _ in engines if impl in impls]


def _finished_rows(name: str, best: dict[tuple, dict[str, Any]], models: dict[str, Any], plan: Plan,
                   lim: dict[str, Any], log: Callable[[str], None]) -> list[dict[str, Any]]:
    """The best rows, each logged, with whether a peer's greedy tokens on float32 weights and compiled
    decoding's are tinygpt's eager ones, and the bandwidth use of tinygpt's decode steps."""
    tokens = {key: row.pop("tokens") for key, row in best.items()}
    ours = tokens.get(("tinygpt", "fp32", 1, True, "quiet"))  # a plan without fp32 at batch 1 compares no peer's
    rows = []
    for key, row in best.items():
        impl, fmt, batch, use_cache, condition = key
        if not impl.startswith("tinygpt") and fmt in ("fp32", "f32") and batch == 1 and use_cache and ours:
            row["same_tokens_as_tinygpt"] = tokens[key] == ours  # greedy on identical float32 weights
        if impl == "tinygpt compiled":
            row["same_tokens_as_eager"] = tokens[key] == tokens[("tinygpt", fmt, batch, True, "quiet")]  # row 0's
        if impl.startswith("tinygpt") and use_cache:
            per_step = bytes_per_token(models[fmt], batch, plan.prompt + row["new_tokens"] / 2)
            row["bytes_per_step"] = per_step
            row["bandwidth_use"] = per_step * row["decode_tokens_per_s"] / batch / peak_bandwidth(lim)
        rows.append(row)
        bw = f"  bandwidth {row['bandwidth_use']:.0%}" if "bandwidth_use" in row else ""
        log(f"generate {name:5s} {engine_name(row):16s} {fmt:4s} batch {batch} "
            f"{'cache' if use_cache else 'no-cache':8s}: decode {row['decode_tokens_per_s']:8.1f} tokens/s  "
            f"prefill {row['prefill_tokens_per_s']:8.0f} tokens/s  TTFT {row['ttft_s'] * 1000:7.1f} ms{bw}")
    return rows


def generate_tinygpt(model, idx: torch.Tensor, new_tokens: int, *, use_cache: bool,
                     compile: bool = False) -> dict[str, Any]:
    """Greedy generation with tinygpt.generate_stream: TTFT, prefill and decode rates, row 0's tokens."""
    clock, tokens = Clock(), []
    for token in generate_stream(model, idx, new_tokens, greedy=True, use_cache=use_cache, compile=compile):
        clock.tick()
        tokens.append(int(token[0]))
    return clock.result(idx.shape[1], idx.shape[0], tokens)


def bytes_per_token(model, batch: int, context: float) -> float:
    """Bytes a decode step reads: every matrix once (the embedding row lookups aside) and, per row,
    the keys and values of `context` positions in every layer."""
    weights = 0
    for m in model.modules():
        if hasattr(m, "nbytes"):  # tinygpt.quantize's layers say what their forward reads
            weights += m.nbytes
        elif isinstance(m, (torch.nn.Linear, torch.nn.LayerNorm, torch.nn.RMSNorm)):
            weights += sum(p.numel() * p.element_size() for p in m.parameters(recurse=False))
    cfg = model.config
    # the cache holds n_kv_head heads (grouped-query attention: fewer than the queries' n_head)
    cache = 2 * cfg.n_layer * cfg.kv_heads * cfg.head_dim * context * model.wte.weight.element_size() * batch
    return weights + cache


class busy_core:
    """One process spinning on a core while the block runs: the machine a laptop user decodes on, doing
    something else (a build, a browser tab), as the issue measured llama.cpp and tinygpt beside it."""

    def __enter__(self) -> busy_core:
        self.spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        time.sleep(0.2)  # on its core before the first measurement
        return self

    def __exit__(self, *exc) -> None:
        self.spinner.kill()
        self.spinner.wait()
