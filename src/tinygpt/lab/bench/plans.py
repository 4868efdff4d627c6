"""What `tinygpt bench` measures: the plans (FULL and QUICK on a CPU, GPU and GPU_QUICK on CUDA, SMOKE to
check it runs), the models its rows use, and the dtypes and formats worth measuring on a device."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ...config.model import GPTConfig
from ...device import cpu_has_native_bf16
from ...interop.quantize import FORMATS

CHAR_VOCAB = 77  # training rows use a character vocabulary, as the reference figures do
# The from-scratch peer's character model, as it builds it: 4 layers, 4 heads, 128 wide, context 64 (batch
# 12), no biases, exact GELU.
PEER_CHAR = dict(n_layer=4, n_head=4, n_embd=128, block_size=64, dropout=0.0, bias=False, activation="gelu")
PEER_CHAR_TOKENS_PER_S = 16_000  # its float32 speed on this machine kind (issue 4)
LLAMA_WIDE = "gpt2-4k"
SMOLLM = "smollm2"  # SmolLM2-135M's shape (30 x 576, 9 heads, 3 for keys and values, SwiGLU, tied), random weights
SMOLLM_CONTEXT = 1024  # generation rows of it crop the preset's 8,192 positions (the cache is sized by them)
TRAIN_CONTEXT = 256  # training rows of the bigger presets run 256-token sequences (gpt2 at 4 x 256)
# the step rows' sizes (n_layer, n_head, n_embd): the recipe bench's 4 x 128 and the baby model's 6 x 384
STEP_SIZES = ((4, 4, 128), (6, 6, 384))


@dataclass(frozen=True)
class Plan:
    """How much a run measures; `quick` takes fewer models, steps and repeats, for a first look."""

    matmul_n: int
    memory_mib: int
    repeats: int
    repeats_gen: int  # interleaved rounds of generation
    repeats_train: int  # interleaved rounds of training
    train: tuple[tuple[str, int, int], ...]  # (model, batch, steps)
    prompt: int
    new_tokens: int
    no_cache_tokens: int
    gen_models: tuple[str, ...]
    gen_batches: tuple[int, ...]
    peer_formats: tuple[str, ...]
    llama_models: tuple[str, ...] = ()  # decoded at batch 1 by tinygpt and llama.cpp (when installed)
    llama_formats: tuple[str, ...] = ("f32", "f16", "q8_0", "q4_0")
    busy: bool = False  # the llama.cpp comparison again beside a process spinning on a core
    # rounds of the llama.cpp comparison (tinygpt's and llama.cpp's batch-1 rows; the quiet ones after the
    # repeats_gen rounds every engine takes): two engines on the same kernels were 15% apart at best of 3
    repeats_llama: int = 0
    formats: tuple[str, ...] = FORMATS  # tinygpt's weight formats (int4 only where the model is on a CPU)
    # (dtype, compile) of each training row; None: float32, and bfloat16 where it is native, eager
    train_modes: tuple[tuple[str, bool], ...] | None = None
    train_vocab: int | None = CHAR_VOCAB  # None: the preset's own (GPT-2's 50,257)
    train_context: int = TRAIN_CONTEXT  # the longest training sequence (at most the preset's block_size)
    # (format, batch) decoded with the cache through torch.compile too (generate's compile=True)
    gen_compiled: tuple[tuple[str, int], ...] = ()
    # the DPO row (tinygpt.lab.bench.dpo): (pairs a step, timed steps), beside TRL's DPOTrainer; None: none
    dpo: tuple[int, int] | None = None
    # the GRPO row (tinygpt.lab.bench.grpo): (prompts a step, completions a prompt, timed steps), beside TRL's
    # GRPOTrainer; None: none
    grpo: tuple[int, int, int] | None = None
    # (n_layer, n_head, n_embd) of the step rows (the default block against GPT-2's), their batch and context,
    # and their interleaved rounds
    step_sizes: tuple[tuple[int, int, int], ...] = ()
    step_batch: int = 32
    step_context: int = 128
    repeats_step: int = 3


FULL = Plan(
    matmul_n=2048, memory_mib=1024, repeats=5, repeats_gen=3, repeats_train=2,
    train=(("lesson", 32, 30), ("char", 12, 30), ("baby", 8, 6), ("gpt2", 4, 4), (SMOLLM, 4, 4)),
    prompt=16, new_tokens=64, no_cache_tokens=16, gen_models=("baby", "gpt2", SMOLLM), gen_batches=(1, 8),
    peer_formats=("fp32", "bf16"), llama_models=("baby", "gpt2-4k", SMOLLM), busy=True, repeats_llama=5, dpo=(8, 5),
    grpo=(8, 8, 5), step_sizes=STEP_SIZES,
)
QUICK = Plan(
    matmul_n=1536, memory_mib=512, repeats=3, repeats_gen=2, repeats_train=2,
    train=(("lesson", 32, 10), ("char", 12, 12), ("baby", 4, 3)),
    prompt=16, new_tokens=24, no_cache_tokens=6, gen_models=("baby", "gpt2"), gen_batches=(1,),
    peer_formats=("fp32",), llama_models=("baby",), formats=("fp32", "bf16", "fp16", "int8"), busy=True,
    dpo=(8, 3), grpo=(8, 8, 3), step_sizes=STEP_SIZES[:1], repeats_step=2,
)
# A GPU: matrices and a copy big enough to reach its limits (a 4 GiB copy is 70 times an H200's L2);
# GPT-2 trained at 16 x 1024 with its own vocabulary in bfloat16, eager and compiled; GPT-2 decoded
# at batch 1 and 8 in fp32, bf16 and int8, bf16 also through torch.compile's CUDA graphs (the batch-1
# row is the one bound by memory bandwidth). One round of each: a GPU of its own does not have a
# shared host's slow spells. A few minutes, most of them compiling.
GPU = Plan(
    matmul_n=8192, memory_mib=4096, repeats=10, repeats_gen=1, repeats_train=1,
    train=(("gpt2", 16, 10),), train_modes=(("bfloat16", False), ("bfloat16", True)), train_vocab=None,
    train_context=1024, prompt=64, new_tokens=128, no_cache_tokens=16, gen_models=("gpt2",), gen_batches=(1, 8),
    peer_formats=("bf16",), formats=("fp32", "bf16", "int8"), gen_compiled=(("bf16", 1), ("bf16", 8)),
)
GPU_QUICK = dataclasses.replace(GPU, repeats=3, train_modes=(("bfloat16", True),), new_tokens=64, formats=("bf16",),
                                gen_batches=(1,), gen_compiled=(("bf16", 1),))
# Every kind of row once at the smallest sizes, in seconds: that the bench runs here (its figures say nothing)
SMOKE = Plan(
    matmul_n=64, memory_mib=4, repeats=1, repeats_gen=1, repeats_train=1, train=(("lesson", 4, 2),), prompt=4,
    new_tokens=3, no_cache_tokens=2, gen_models=("lesson",), gen_batches=(1, 2), peer_formats=("fp32", "bf16"),
    dpo=(2, 1), grpo=(2, 2, 1), step_sizes=((1, 2, 32),), step_batch=2, step_context=16, repeats_step=1,
)


def plan_for(device: torch.device, *, quick: bool = False, smoke: bool = False) -> Plan:
    """What `tinygpt bench` measures on `device`: SMOKE, else the GPU plans on CUDA, the CPU's elsewhere."""
    if smoke:
        return SMOKE
    if device.type == "cuda":
        return GPU_QUICK if quick else GPU
    return QUICK if quick else FULL


def bench_config(name: str, *, training: bool, vocab: int | None = CHAR_VOCAB,
                 context: int = TRAIN_CONTEXT) -> GPTConfig:
    """The model a row measures: a preset, or "char" (the peer's 4-layer, 128-wide model). Training
    rows use a `vocab`-symbol vocabulary (None: the preset's own) and at most `context` positions;
    generation rows keep the preset's vocabulary (GPT-2's 50,257) and context. "gpt2-4k" is GPT-2
    small's 12 x 768 with a 4,096-token vocabulary (the llama.cpp comparison's larger model); "smollm2"
    is SmolLM2-135M's shape (the Llama family: rotary positions, RMSNorm, SwiGLU, grouped-query
    attention), its generation rows at SMOLLM_CONTEXT positions."""
    if name == "char":
        return GPTConfig(vocab_size=(vocab or CHAR_VOCAB) if training else 65, **PEER_CHAR)
    if name == SMOLLM:
        cfg = GPTConfig.from_preset("smollm2-135m", block_size=SMOLLM_CONTEXT)
    elif name == LLAMA_WIDE:
        cfg = GPTConfig.from_preset("gpt2", vocab_size=4096)
    else:
        cfg = GPTConfig.from_preset(name)
    if training:
        cfg.vocab_size = vocab or cfg.vocab_size
        cfg.block_size = min(cfg.block_size, context)
    else:
        cfg.dropout = 0.0
    return cfg


def bf16_native(device: torch.device) -> bool:
    """Whether bfloat16 is worth measuring on `device`: a CPU without it emulates bf16 at a few GFLOP/s
    (a GPT-2 training step takes minutes, and transformers' bf16 prompt seconds)."""
    return device.type != "cpu" or cpu_has_native_bf16()


def train_dtypes(device: torch.device) -> tuple[str, ...]:
    """The training dtypes worth measuring: bfloat16 only where it is native (`--dtype auto` trains in
    float32 elsewhere)."""
    return ("float32", "bfloat16") if bf16_native(device) else ("float32",)


def peer_formats(plan: Plan, device: torch.device) -> tuple[str, ...]:
    """transformers' formats worth measuring: the plan's, bf16 only where it is native."""
    return tuple(f for f in plan.peer_formats if f != "bf16" or bf16_native(device))
