"""The peers the bench measures tinygpt beside, on the same sizes and weights: Hugging Face transformers
(GPT2LMHeadModel for GPT-2's layout, LlamaForCausalLM for the Llama family), training and generating,
and llama.cpp (llama-cpp-python) decoding tinygpt's own GGUF export. Each is imported only here, and
only when installed (the hf and llama extras)."""

from __future__ import annotations

import ctypes
import logging
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ...config.model import GPTConfig
from ...interop.hf import to_transformers
from ...model import GPT
from .clock import Clock


def peers_available() -> bool:
    """Whether transformers (the hf extra) imports."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def llama_available() -> bool:
    """Whether llama.cpp (llama-cpp-python, the llama extra) and the gguf writer (the hf extra) import."""
    try:
        import gguf  # noqa: F401
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def train_transformers(
    cfg: GPTConfig, batch: int, steps: int, dtype: str, device: torch.device, *, warmup: int = 2
) -> dict[str, Any]:
    """Tokens/s of a plain transformers loop (GPT2LMHeadModel, or LlamaForCausalLM for the Llama family):
    autocast, fused AdamW, clipping."""
    from ...device import DTYPES, autocast

    torch.manual_seed(0)
    model = to_transformers(GPT(cfg)).to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=True)
    T, V = cfg.block_size, cfg.vocab_size
    g = torch.Generator().manual_seed(0)
    times = []
    for i in range(warmup + steps):
        tokens = torch.randint(0, V, (batch, T + 1), generator=g).to(device)
        start = time.perf_counter()
        with autocast(device, DTYPES[dtype]):
            logits = model(tokens[:, :-1]).logits
        loss = F.cross_entropy(logits.reshape(-1, V).float(), tokens[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return {"tokens_per_s": batch * T / statistics.median(times)}


def generate_transformers(hf, idx: torch.Tensor, new_tokens: int, *, use_cache: bool) -> dict[str, Any]:
    """Greedy transformers generate (GPT2LMHeadModel, LlamaForCausalLM), timed through a streamer: the same
    figures as generate_tinygpt."""
    from transformers.generation.streamers import BaseStreamer

    class Streamer(BaseStreamer):
        def __init__(self) -> None:
            self.prompt_seen = False

        def put(self, value) -> None:
            if self.prompt_seen:  # the first call hands over the prompt
                clock.tick()
            self.prompt_seen = True

        def end(self) -> None:
            pass

    clock = Clock()
    with torch.inference_mode():
        out = hf.generate(
            idx, attention_mask=torch.ones_like(idx), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
            do_sample=False, use_cache=use_cache, pad_token_id=0, streamer=Streamer(),
        )
    return clock.result(idx.shape[1], idx.shape[0], out[0, idx.shape[1]:].tolist())


# llama.cpp's formats, each beside the tinygpt formats it is compared with (the faster of several)
LLAMA_PAIRS = {"f32": ("fp32",), "f16": ("bf16", "fp16"), "q8_0": ("int8",), "q4_0": ("int4",)}


def llama_files(model: GPT, folder: Path, formats: tuple[str, ...]) -> dict[str, Path]:
    """`model` as GGUF files llama.cpp runs, one per format: f32 and f16 from tinygpt's own export,
    q8_0 and q4_0 quantized from the f32 file by llama.cpp's own quantizer."""
    import llama_cpp

    from ...interop.gguf import export_gguf
    from ...tokenizer.char import CharTokenizer

    # the weights are what is measured; a character vocabulary makes the export valid for any vocab size
    tokenizer = CharTokenizer([chr(33 + i) for i in range(min(model.config.vocab_size, 90))])
    files = {"f32": export_gguf(model, tokenizer, folder / "f32.gguf")}
    if "f16" in formats:
        files["f16"] = export_gguf(model, tokenizer, folder / "f16.gguf", dtype="float16")
    logger = logging.getLogger("llama-cpp-python")
    level = logger.level
    logger.setLevel(logging.ERROR)  # its quantizer logs a line per tensor
    try:
        for fmt, ftype in (("q8_0", llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0), ("q4_0", llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0)):
            if fmt not in formats:
                continue
            params = llama_cpp.llama_model_quantize_default_params()
            params.ftype, params.nthread = ftype, torch.get_num_threads()
            files[fmt] = folder / f"{fmt}.gguf"
            rc = llama_cpp.llama_model_quantize(str(files["f32"]).encode(), str(files[fmt]).encode(),
                                                ctypes.byref(params))
            if rc != 0:
                raise RuntimeError(f"llama.cpp could not quantize to {fmt} (code {rc})")
    finally:
        logger.setLevel(level)
    return {fmt: files[fmt] for fmt in formats}


# Loads a GGUF file and decodes a few tokens: run in a child process first, so that a llama.cpp kernel
# that faults on this CPU (its AMX kernels do in some virtual machines, ggml-org/llama.cpp#20824) takes
# the child down and not the benchmark with every figure it has measured.
LLAMA_PROBE = """
import sys, llama_cpp
llm = llama_cpp.Llama(sys.argv[1], n_ctx=int(sys.argv[2]), n_threads=int(sys.argv[3]), verbose=False)
llm.eval([0, 1, 2, 3])
llm.eval([1])
"""


def llama_failure(path: Path, n_ctx: int) -> str | None:
    """Why llama.cpp cannot decode the GGUF file at `path` here (tried in a child process), or None."""
    threads = str(torch.get_num_threads())
    try:
        done = subprocess.run([sys.executable, "-c", LLAMA_PROBE, str(path), str(n_ctx), threads],
                              capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        return "it did not decode a token in 300 s"
    if done.returncode < 0:
        return f"it crashed with signal {-done.returncode}"
    if done.returncode:
        lines = done.stderr.strip().splitlines()
        return f"it failed: {lines[-1] if lines else f'exit status {done.returncode}'}"
    return None


def load_llama(path: Path, n_ctx: int) -> Any:
    """A llama.cpp model on torch's thread count, quiet."""
    import llama_cpp

    threads = torch.get_num_threads()
    return llama_cpp.Llama(str(path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, verbose=False)


def generate_llama(llm, idx: torch.Tensor, new_tokens: int, *, use_cache: bool = True) -> dict[str, Any]:
    """Greedy decoding of row 0 of idx with llama.cpp (its KV cache): the same figures as generate_tinygpt."""
    import llama_cpp
    import numpy as np

    n_vocab = llm.n_vocab()

    def argmax() -> int:  # the logits of the last token evaluated
        return int(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(n_vocab,)).argmax())

    clock, tokens = Clock(), []
    llm.reset()
    llm.eval(idx[0].tolist())
    for i in range(new_tokens):
        tokens.append(argmax())
        clock.tick()
        if i + 1 < new_tokens:
            llm.eval(tokens[-1:])
    return clock.result(idx.shape[1], 1, tokens)
