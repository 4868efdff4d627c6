"""tinygpt's own CPU kernels: matrix-vector products for decoding (csrc/lowbit.cpp), with float32,
float16, bfloat16, int8 and int4 weights, and for training GELU (both forms), the head's
cross-entropy and causal attention (csrc/training.cpp), and the modern block's RMSNorm, QK-norm with
rotary positions and SwiGLU gate (csrc/modern.cpp).

PyTorch's CPU kernels are made for many rows at a time; at one row (a decoding step) they read the
weights well below the memory's speed (the README's Performance section has the figures). These
read each weight once per call for up to a few rows, with AVX2: float32, float16 and bfloat16 weights against
float32 activations, int8 and int4 weights against activations quantized to int8 in blocks of 32.
They are compiled on first use with PyTorch's extension builder (a C++ compiler and ninja; 20-60
seconds once, then cached in ~/.cache/tinygpt/kernels, or $TINYGPT_KERNELS_DIR), and checked against
a reference before anything uses them. Where they cannot be built or do not agree (no compiler, a
CPU without AVX2/FMA/F16C, not x86), `lowbit()` is None and tinygpt.quantize keeps PyTorch's
kernels; TINYGPT_KERNELS=0 chooses that too. A missing compiler is looked for before any build and
said in one line, once a process.

    float_linear(x, weight, bias)          x (M, K) float32, weight (N, K) float32, float16 or bfloat16, K % 8 == 0;
                                          past 8 rows (a prompt) three weight rows by four of x at a time
    float_rows(n)                          float32 weight rows float_linear reads at a time at one row of x:
                                          1 or 4 (per CPU kind; the same sums), n = 0 reads it
    int8_linear(x, weight, scales, bias, N)   weight as int8_group lays it out, scales (N,) float32
    int4_linear(x, weight, params, bias, N)   weight and params as int4_pack lays them out
    gelu(x, tanh), gelu_backward(grad, x, tanh)   x contiguous float32; GPT-2's tanh form or the exact
                                          GELU (gelu below: with autograd)
    cross_entropy_rows_(logits, targets, weights, grad)   logits (N, V) float32, targets (N,) int64, weights
                                          (N,) float32: each row's loss; with grad the logits become its gradient
    causal_attention(q, k, v) -> (out, lse), causal_attention_backward(grad, q, k, v, out, lse) -> dqkv
                                          q (B, H, T, D), k and v (B, H_kv, T, D) float32; dqkv
                                          (B, T, (H + 2 H_kv) D), the gradients side by side (causal_attention
                                          below: with autograd, on c_attn's output; heads_attention on the
                                          modern block's q, k and v)
    rms_norm(x, w, eps) -> (y, rstd), rms_norm_backward(grad, x, w, rstd) -> (dx, dw)
    rotary(x, w, eps, cos, sin) -> (y, rstd), rotary_backward(grad, x, w, rstd, cos, sin) -> (dx, dw)
                                          x (B, T, H, D): the QK-norm (where w is given) and rotary positions
                                          (backward's x and w: both or neither)
    swiglu(a, b), swiglu_backward(grad, a, b) -> (da, db)   silu(a) * b
                                          (the modern block's, csrc/modern.cpp: float32 or bfloat16, with
                                          AVX2 or AVX-512; rms_norm, rotary and swiglu below: with autograd)
    simd_width(n)                          the vector width modern.cpp's kernels run at: 16 where the CPU has
                                          AVX-512, else 8; n = 8 (or 16) sets it, 0 reads it

and torch.classes.tinygpt_lowbit.DecodePlan, a whole GPT decode step in one call on these kernels
(tinygpt.fastpath builds it from a quantized model): `step` (rows at one position, or a short prompt),
`rows` (every row's logits, each row at positions of its own, bit for bit a one-row step's).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
from pathlib import Path

import torch

from .device import cpu_flag_set

try:
    import fcntl
except ImportError:  # not POSIX: builds are not serialized beyond PyTorch's own lock
    fcntl = None

BLOCK = 32  # inputs per activation scale, and per int4 weight scale and minimum
SOURCES = [Path(__file__).parent / "csrc" / name for name in ("lowbit.cpp", "training.cpp", "modern.cpp")]
HEADERS = [Path(__file__).parent / "csrc" / "modern_kernels.h"]  # included by the sources: copied and hashed too
# the longest sequence causal_attention takes: measured faster than PyTorch's flash kernel up to here
ATTENTION_MAX_T = 512
NEEDS = ("avx2", "fma", "f16c")
# what a process without the kernels gives up, on an AVX2 AMD EPYC Zen 3: decoding fp32 2.0x / 1.5x (the baby
# model / 12 x 768, 2 threads; int8 and int4 3-6x by the performance page's runs), a 4 x 160 GPT-2 block's
# training step 1.27x (one thread; the modern block's 1.01x)
WITHOUT_KERNELS = "decoding at batch 1 1.5-2x slower (int8, int4: 3-6x), training GPT-2's block up to 1.3x"
log = logging.getLogger(__name__)


def cpu_supports() -> bool:
    """Whether this CPU runs the kernels: x86-64 with AVX2, FMA and F16C (from /proc/cpuinfo)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    flags = cpu_flag_set()
    return flags is not None and all(flag in flags for flag in NEEDS)


CFLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"]


def build_directory() -> Path:
    """Where the compiled kernels are kept: one folder per everything that changes the build, so that
    no two setups ever rebuild each other's and the same setup always finds its own: the torch release
    (its headers are compiled in) and installation (ninja rebuilds when the headers' path changes), the
    C++ compiler (CXX or c++, as PyTorch's builder runs it: its path and version), ninja's path and
    version (a ninja of another version discards the other's build log and rebuilds everything: a
    system ninja 1.11 and a venv's 1.13 alternating on PATH rebuilt it each time), and the content of
    the sources and flags, so that checkouts of the same code share one build. The CPU does not enter:
    the flags name the instruction sets (-mavx2 ...), not -march=native."""
    from torch.utils.cpp_extension import get_cxx_compiler

    root = os.environ.get("TINYGPT_KERNELS_DIR") or Path.home() / ".cache" / "tinygpt" / "kernels"
    toolchain = [str(Path(torch.__file__).resolve().parent), _tool(get_cxx_compiler()), _tool("ninja")]
    digest = hashlib.sha256("\n".join(CFLAGS + toolchain).encode())
    for source in SOURCES + HEADERS:
        digest.update(source.read_bytes())
    return Path(root) / f"torch-{torch.__version__}-{digest.hexdigest()[:12]}"


def _tool(command: str) -> str:
    """A build tool as a build here would run it: the command, the file it finds on PATH and the first
    line of its --version ("missing" if there is none; the build then fails and says why)."""
    found = shutil.which(command)
    if found is None:
        return f"{command}: missing"
    try:
        out = subprocess.run([found, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        out = ""
    return f"{command}: {os.path.realpath(found)} {(out.splitlines() or ['?'])[0]}"


def _has_work(folder: Path) -> bool:
    """Whether building in folder compiles anything: no library yet, or a dry run of ninja lists commands."""
    ninja = shutil.which("ninja")
    if ninja is None or not (folder / "tinygpt_lowbit.so").exists() or not (folder / "build.ninja").exists():
        return True
    try:
        dry = subprocess.run([ninja, "-n"], cwd=folder, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return True
    return dry.returncode != 0 or "no work to do" not in dry.stdout


def _build(folder: Path) -> None:
    """Compile (or load the compiled) kernels in folder, one process at a time, saying so on the log
    (a warning, which Python prints on stderr unless logging is set up otherwise) when it compiles and
    when it waits for another process's build.

    The sources are copied into the folder so that the build sees the same paths from any checkout
    (ninja rebuilds when a path changes). PyTorch's builder keeps a lock file of its own that a
    killed build leaves behind, and every later build then waits for it forever; tinygpt holds an
    OS lock (flock: let go of when its holder dies, however it dies) around the build, so whoever
    holds it knows that a lock file it finds is stale."""
    from torch.utils import cpp_extension

    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "build.lock", "a") as held:
        if fcntl is not None:
            try:
                fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # a first build elsewhere takes minutes: say why nothing happens
                log.warning("tinygpt: waiting for another process compiling its CPU kernels in %s", folder)
                fcntl.flock(held, fcntl.LOCK_EX)
        (folder / "lock").unlink(missing_ok=True)
        sources = []
        for source in SOURCES + HEADERS:
            copy = folder / "src" / source.name
            if not copy.exists() or copy.read_bytes() != source.read_bytes():
                copy.parent.mkdir(exist_ok=True)
                copy.write_bytes(source.read_bytes())
            if source in SOURCES:
                sources.append(str(copy))
        if _has_work(folder):
            log.warning("tinygpt: compiling its CPU kernels, once for this compiler, ninja and torch (20-60 s), "
                        "into %s", folder)
        cpp_extension.load(
            name="tinygpt_lowbit", sources=sources, is_python_module=False, verbose=False,
            build_directory=str(folder), extra_cflags=CFLAGS, extra_ldflags=["-fopenmp"],
        )


def _missing_compiler() -> str | None:
    """The C++ compiler PyTorch's builder would run ($CXX, else c++), said as the user set it, where PATH
    has no such program; None where it does. Only the first word must be found: CXX may be a wrapper
    and its compiler ("ccache g++"), which the build runs as written."""
    from torch.utils.cpp_extension import get_cxx_compiler

    compiler = get_cxx_compiler()
    words = compiler.split()
    if words and shutil.which(words[0]):
        return None
    return f"CXX={compiler!r}" if "CXX" in os.environ else compiler


@functools.cache
def lowbit():
    """torch.ops.tinygpt_lowbit, built and checked on first call; None where it cannot be used here."""
    if os.environ.get("TINYGPT_KERNELS", "1") == "0" or not cpu_supports():
        return None
    compiler = _missing_compiler()
    if compiler is not None:  # before the build, whose failure would print PyTorch's banner and the build log
        log.warning("tinygpt: no C++ compiler (%s is not on PATH): PyTorch's kernels do the work of tinygpt's, %s; "
                    "install one (Debian/Ubuntu: apt install g++) and the next command builds them",
                    compiler, WITHOUT_KERNELS)
        return None
    try:
        _build(build_directory())
        ops = torch.ops.tinygpt_lowbit
        with torch.autocast("cpu", enabled=False):  # a first call may come under autocast: the references in float32
            ok = _agrees(ops)
    except Exception as e:  # a missing compiler or ninja, a failed build: PyTorch's kernels do the work
        log.warning("tinygpt: the CPU kernels could not be built (%s); using PyTorch's", str(e).splitlines()[0])
        return None
    if not ok:
        log.warning("tinygpt: the CPU kernels disagree with their reference here; using PyTorch's")
        return None
    return ops


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What the kernels do to their input, in PyTorch: (M, K) float32 -> int8 codes (M, K) and a scale
    per block of 32 (max |x| / 127), rounding half to even."""
    blocks = x.float().reshape(x.shape[0], -1, BLOCK)
    scale = blocks.abs().amax(dim=-1, keepdim=True) / 127
    codes = torch.round(blocks * torch.where(scale > 0, 1 / scale, 0.0)).clamp(-127, 127)
    return codes.reshape(x.shape).to(torch.int8), scale.squeeze(-1)


def int4_codes(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An (N, K) weight in 4 bits per block of 32 inputs: codes (N, K) 0..15 and params (N, 2, K / 32)
    float16 (the blocks' scales, then their minimums), so that w ~ code * scale + minimum."""
    n, k = weight.shape
    w = weight.detach().float().reshape(n, k // BLOCK, BLOCK)
    low = w.amin(dim=-1, keepdim=True).half().float()
    # round scale and minimum to float16 first, so the codes fit what the kernel computes
    scale = ((w.amax(dim=-1, keepdim=True) - low).clamp(min=1e-8) / 15).half().float()
    codes = torch.round((w - low) / scale).clamp(0, 15).to(torch.uint8).reshape(n, k)
    return codes, torch.stack([scale[..., 0], low[..., 0]], dim=1).half().contiguous()


def int8_group(q: torch.Tensor) -> torch.Tensor:
    """int8 weights (N, K) in int8_linear's layout: rows in groups of 8 (the last one padded with
    zeros), for each group and block of 32 inputs 256 bytes, eight chunks of 4 inputs with row j's
    four at 4j (so that each 32-bit lane the kernel multiplies is one row's): (groups, K / 32, 256)."""
    padded, blocks = _in_eights(q), q.shape[1] // BLOCK
    # (group, row j, block, chunk, i) -> (group, block, chunk, j, i)
    return padded.reshape(-1, 8, blocks, 8, 4).permute(0, 2, 3, 1, 4).reshape(-1, blocks, 256).contiguous()


def int4_pack(codes: torch.Tensor, params: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int4_codes' codes (N, K) and params (N, 2, K / 32) in int4_linear's layout: rows in groups of 8
    (the last one padded with zeros), for each group and block of 32 inputs 128 bytes and 16 float16.

    The bytes are four chunks of 8 inputs; in chunk c, row j's four bytes start at 4j, and byte i holds
    input 8c + i in its low half and 8c + 4 + i in its high half, so that each 32-bit lane the kernel
    multiplies is one row's. The 16 float16 are the group's 8 scales of the block, then its 8 minimums.

    Returns:
        (weight (groups, K / 32, 128) uint8, params (groups, K / 32, 16) float16).
    """
    blocks = codes.shape[1] // BLOCK
    # (group, row j, block, chunk c, half, i) -> (group, block, chunk, j, i, half)
    t = _in_eights(codes.to(torch.uint8)).reshape(-1, 8, blocks, 4, 2, 4).permute(0, 2, 3, 1, 5, 4)
    weight = (t[..., 0] | (t[..., 1] << 4)).reshape(-1, blocks, 128).contiguous()
    p = _in_eights(params.half()).reshape(-1, 8, 2, blocks).permute(0, 3, 2, 1).reshape(-1, blocks, 16).contiguous()
    return weight, p


def _in_eights(rows: torch.Tensor) -> torch.Tensor:
    """rows (N, ...) with zero rows after them up to a multiple of 8 (the kernels' groups)."""
    padded = rows.new_zeros((-(-rows.shape[0] // 8) * 8, *rows.shape[1:]))
    padded[:rows.shape[0]] = rows
    return padded


def int4_dequantize(codes: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
    """The weights int4 codes and params stand for, (N, K) float32."""
    n, k = codes.shape
    p = params.float()[..., None]  # (N, 2, K / 32, 1)
    return (codes.float().reshape(n, k // BLOCK, BLOCK) * p[:, 0] + p[:, 1]).reshape(n, k)


def _agrees(ops) -> bool:
    """Every kernel against PyTorch on a small case (the integer ones with the same quantized activations)."""
    g = torch.Generator().manual_seed(0)
    x, w, bias = torch.randn(3, 96, generator=g), torch.randn(40, 96, generator=g), torch.randn(40, generator=g)
    codes, scales = quantize_activations(x)
    xq = (codes.float().reshape(3, -1, BLOCK) * scales[..., None]).reshape(3, 96)
    w_scales = w.abs().amax(dim=1) / 127
    w8 = torch.round(w / w_scales[:, None]).to(torch.int8)
    want8 = xq @ (w8.float() * w_scales[:, None]).T + bias
    q4, params = int4_codes(w)
    want4 = xq @ int4_dequantize(q4, params).T + bias
    pairs = [(ops.int8_linear(x, int8_group(w8), w_scales, bias, 40), want8),
             (ops.int4_linear(x, *int4_pack(q4, params), bias, 40), want4),
             (ops.float_linear(x, w, bias), x @ w.T + bias)]
    pairs += [(ops.float_linear(x, w.to(dtype), None), x @ w.to(dtype).float().T)
              for dtype in (torch.half, torch.bfloat16)]
    t = torch.linspace(-9, 9, 203)  # GELU: 25 blocks of eight and a partial one
    # ATen's own gradient, not autograd: the first call may come under no_grad or inference_mode
    ones = torch.ones(203, dtype=torch.double)
    for approximate in ("tanh", "none"):
        tanh = approximate == "tanh"
        pairs += [(ops.gelu(t, tanh).double(), torch.nn.functional.gelu(t.double(), approximate=approximate)),
                  (ops.gelu_backward(torch.ones_like(t), t, tanh).double(),
                   torch.ops.aten.gelu_backward(ones, t.double(), approximate=approximate))]
    logits = torch.randn(5, 77, generator=g) * 4  # a row: nine blocks of eight and five more
    targets = torch.randint(0, 77, (5,), generator=g)
    grads = logits.clone()  # the kernel turns it into the gradient, in place
    ce = ops.cross_entropy_rows_(grads, targets, torch.full((5,), 0.5), True)
    pairs += [(ce, torch.nn.functional.cross_entropy(logits, targets, reduction="none")),
              (grads, 0.5 * (logits.softmax(dim=1) - torch.nn.functional.one_hot(targets, 77)))]
    q, k, v = (torch.randn(1, 2, 11, 12, generator=g) for _ in range(3))  # partial tiles everywhere
    out, lse = ops.causal_attention(q, k, v)
    pairs += [(out, torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))]
    out, lse = ops.causal_attention(q, k[:, :1], v[:, :1])  # grouped-query: one key/value head for two
    pairs += [(out, torch.nn.functional.scaled_dot_product_attention(q, k[:, :1], v[:, :1], is_causal=True,
                                                                      enable_gqa=True))]
    return all(torch.allclose(got, want, rtol=1e-4, atol=1e-4) for got, want in pairs + _modern_pairs(ops, g))


def _modern_pairs(ops, g: torch.Generator) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The modern block's kernels (RMSNorm, the QK-norm and rotary positions, SwiGLU's gate) and PyTorch's
    values, forward, on widths with partial vectors."""
    F = torch.nn.functional
    x, w = torch.randn(3, 4, 2, 12, generator=g), torch.rand(12, generator=g) + 0.5
    a = torch.randn(3, 4, 6, generator=g) * 3  # six frequencies: a partial vector too
    cos, sin = torch.cat((a, a), dim=-1).cos().reshape(12, 12), torch.cat((a, a), dim=-1).sin().reshape(12, 12)
    normed = F.rms_norm(x, (12,), w, 1e-6)
    turned = normed * cos.view(3, 4, 1, 12) + torch.cat((-normed[..., 6:], normed[..., :6]), -1) * sin.view(3, 4, 1, 12)
    return [(ops.rms_norm(x, w, 1e-6)[0], normed), (ops.rotary(x, w, 1e-6, cos, sin)[0], turned),
            (ops.swiglu(x, x * 2), F.silu(x) * x * 2)]


class _Gelu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, tanh: bool) -> torch.Tensor:
        ctx.save_for_backward(x)
        ctx.tanh = tanh
        return lowbit().gelu(x, tanh)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (x,) = ctx.saved_tensors
        return lowbit().gelu_backward(grad.to(x.dtype).contiguous(), x, ctx.tanh), None


def _trains_on_cpu(*tensors: torch.Tensor, dtypes: tuple[torch.dtype, ...] = (torch.float32,)) -> bool:
    """CPU tensors of `dtypes` that autograd records (training), not under torch.compile, with the
    kernels built here: what the training kernels take."""
    return (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
            and all(t.device.type == "cpu" and t.dtype in dtypes for t in tensors)
            and not torch.compiler.is_compiling() and lowbit() is not None)


def trains_gelu(x: torch.Tensor, approximate: str = "none") -> bool:
    """Whether gelu takes x: a contiguous tensor that _trains_on_cpu (checked first: inference, every
    layer of every forward pass, answers no at its first test), float32, or bfloat16 (autocast's) in
    the tanh form. PyTorch's exact bfloat16 GELU is the faster there (on the README's Xeon with AMX,
    a 4 x 256 x 3,072 tensor forward and backward 1.8 against 3.0 ms; the tanh form 2.5 against 6.2)."""
    dtypes = (torch.float32, torch.bfloat16) if approximate == "tanh" else (torch.float32,)
    return _trains_on_cpu(x, dtypes=dtypes) and x.is_contiguous()


def gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """F.gelu(x, approximate=...) ("tanh", GPT-2's form, or "none", the exact one) and its gradient on
    tinygpt's kernel (faster than PyTorch's on a CPU: the README's Performance section). The tanh form is
    within a few float32 ulps of PyTorch's, the exact one within twice the error of PyTorch's float32
    GELU; bfloat16 x is computed in float32 and rounded to the nearest even, as PyTorch does, so its
    values are PyTorch's bfloat16 GELU's or one bfloat16 step from them. Only where trains_gelu(x, approximate)."""
    return _Gelu.apply(x, approximate == "tanh")


def heads(qkv: torch.Tensor, n_head: int) -> list[torch.Tensor]:
    """q, k, v as (B, n_head, T, head_dim) views of c_attn's output (B, T, 3 C)."""
    B, T, C3 = qkv.shape
    return [t.view(B, T, n_head, C3 // (3 * n_head)).transpose(1, 2) for t in qkv.split(C3 // 3, dim=2)]


class _CausalAttention(torch.autograd.Function):
    """Causal attention of c_attn's output (qkv, its gradient one buffer) or of separate q, k and v heads (views
    of that buffer as gradients), on the one kernel."""

    @staticmethod
    def forward(ctx, n_head: int, *tensors: torch.Tensor) -> torch.Tensor:
        q, k, v = heads(tensors[0], n_head) if len(tensors) == 1 else tensors
        out, lse = lowbit().causal_attention(q, k, v)
        B, H, T, D = q.shape
        y = out.transpose(1, 2).view(B, T, H * D)  # (B, T, C): heads side by side, no copy
        ctx.save_for_backward(q, k, v, y, lse)
        ctx.fused = len(tensors) == 1
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        q, k, v, y, lse = ctx.saved_tensors
        B, H, T, D = q.shape
        as_heads = [t.reshape(B, T, H, D).transpose(1, 2) for t in (grad, y)]
        grads = lowbit().causal_attention_backward(as_heads[0], q, k, v, as_heads[1], lse)  # (B, T, (H + 2 H_kv) D)
        if ctx.fused:
            return None, grads
        H_kv = k.shape[1]
        parts = grads.view(B, T, H + 2 * H_kv, D).split((H, H_kv, H_kv), dim=2)
        return (None, *(p.transpose(1, 2) for p in parts))


def trains_attention(qkv: torch.Tensor, n_head: int) -> bool:
    """Whether causal_attention takes qkv: c_attn's output (B, T, 3 C) that _trains_on_cpu (checked
    first, as for trains_gelu), its last dimension contiguous, T up to ATTENTION_MAX_T."""
    return (_trains_on_cpu(qkv) and qkv.dim() == 3 and qkv.stride(2) == 1 and qkv.shape[2] % (3 * n_head) == 0
            and qkv.shape[1] <= ATTENTION_MAX_T)


def causal_attention(qkv: torch.Tensor, n_head: int) -> torch.Tensor:
    """Causal self-attention of c_attn's output qkv (B, T, 3 C), as F.scaled_dot_product_attention of its
    n_head heads with is_causal=True, back as (B, T, C), and its gradient on tinygpt's kernel (1.3-2x
    faster than PyTorch's flash kernel on a CPU for 64-512 positions and 32-64 dimensions a head;
    within float32 rounding of it). Its backward writes qkv's gradient as one buffer, where separate
    q, k and v would be concatenated. Only where trains_attention(qkv, n_head)."""
    return _CausalAttention.apply(n_head, qkv)


def trains_heads_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether heads_attention takes q (B, H, T, D), k and v (B, H_kv, T, D): float32 that _trains_on_cpu,
    each's last dimension contiguous, H_kv dividing H, T up to ATTENTION_MAX_T."""
    return (_trains_on_cpu(q, k, v) and q.dim() == k.dim() == v.dim() == 4 and q.shape[2] <= ATTENTION_MAX_T
            and all(t.stride(3) == 1 for t in (q, k, v)) and k.shape == v.shape and q.shape[1] % k.shape[1] == 0
            and (q.shape[0], q.shape[2], q.shape[3]) == (k.shape[0], k.shape[2], k.shape[3]))


def heads_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal self-attention of the modern block's heads (grouped-query where k and v have fewer: each serves
    H / H_kv query heads, as SDPA's enable_gqa), back as (B, T, H D), on causal_attention's kernel. Only where
    trains_heads_attention(q, k, v).

    Args:
        q: (B, H, T, D) queries.
        k, v: (B, H_kv, T, D) keys and values.
    """
    return _CausalAttention.apply(q.shape[1], q, k, v)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        y, rstd = lowbit().rms_norm(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        dx, dw = lowbit().rms_norm_backward(grad.to(x.dtype).contiguous(), x, weight, rstd)
        return dx, dw, None


def trains_rms_norm(x: torch.Tensor, weight: torch.Tensor | None) -> bool:
    """Whether rms_norm takes x and the norm's gain: float32 that _trains_on_cpu, x contiguous."""
    return weight is not None and _trains_on_cpu(x, weight) and x.is_contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float | None) -> torch.Tensor:
    """F.rms_norm(x, (C,), weight, eps) over x's last dimension and its gradients on tinygpt's kernel (one pass
    over x each way, where PyTorch's makes five). Only where trains_rms_norm(x, weight).

    Args:
        x: (..., C) float32, contiguous.
        weight: the gain, (C,) float32.
        eps: added to the mean square (None: float32's machine epsilon, as torch's RMSNorm).
    """
    return _RMSNorm.apply(x, weight, torch.finfo(torch.float32).eps if eps is None else eps)


class _Rotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor,
                sin: torch.Tensor) -> torch.Tensor:
        y, rstd = lowbit().rotary(x, weight, eps, cos, sin)
        # without the norm the turn is linear: its gradient needs the angles only
        ctx.save_for_backward(*((x, weight, rstd) if weight is not None else (None, None, rstd)), cos, sin)
        ctx.dtype = x.dtype
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, rstd, cos, sin = ctx.saved_tensors
        grad = grad.to(ctx.dtype)
        if grad.stride(3) != 1:  # attention's gradient is read as it comes, unless head_dim is strided (explicit path)
            grad = grad.contiguous()
        dx, dw = lowbit().rotary_backward(grad, x, weight, rstd, cos, sin)
        return dx, dw if weight is not None else None, None, None, None


def trains_rotary(x: torch.Tensor, norm: torch.nn.Module | None) -> bool:
    """Whether rotary takes x (B, T, H, D), float32 or bfloat16 (autocast's), and the QK-norm `norm` (an RMSNorm
    with a float32 gain, or None), that _trains_on_cpu, x's last dimension contiguous."""
    if norm is not None and (getattr(norm, "weight", None) is None or norm.weight.dtype != torch.float32
                             or not isinstance(norm, torch.nn.RMSNorm)):
        return False
    tensors = (x,) if norm is None else (x, norm.weight)
    return _trains_on_cpu(*tensors, dtypes=(torch.float32, torch.bfloat16)) and x.dim() == 4 and x.stride(3) == 1


def rotary_angles(rope: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """GPT.rotary's cos and sin ((T, D) or (B, 1, T, D), in autocast's dtype) as rotary takes them: float32,
    (T, D) or (B T, D). Once a layer, for its queries and keys."""
    return tuple(t.float().reshape(-1, t.shape[-1]).contiguous() for t in rope)


def rotary(x: torch.Tensor, norm: torch.nn.Module | None, angles: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """model.rotate(norm(x) or x, rope) on x (B, T, H, D) in one pass and its gradients on tinygpt's kernel: the
    QK-norm over each head (where norm is given) then the rotary positions, computed in float32, in x's dtype
    (B, T, H, D) contiguous. Only where trains_rotary(x, norm).

    Args:
        x: queries or keys, (B, T, H, D), last dimension contiguous.
        norm: the QK-norm (an RMSNorm over head_dim), or None.
        angles: cos and sin as rotary_angles gives them.
    """
    weight, eps = (None, 0.0) if norm is None else (norm.weight, norm.eps)
    return _Rotary.apply(x, weight, torch.finfo(torch.float32).eps if eps is None else eps, *angles)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a, b)
        return lowbit().swiglu(a, b)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return lowbit().swiglu_backward(grad, *ctx.saved_tensors)


def trains_swiglu(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether swiglu takes a and b: contiguous, alike, float32 or bfloat16 (autocast's), that _trains_on_cpu."""
    return (_trains_on_cpu(a, b, dtypes=(torch.float32, torch.bfloat16)) and a.dtype == b.dtype
            and a.shape == b.shape and a.is_contiguous() and b.is_contiguous())


def swiglu(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """F.silu(a) * b in one pass and its gradients on tinygpt's kernel, computed in float32 and given in a's
    dtype (one rounding of a bfloat16 result, where PyTorch's rounds twice). Only where trains_swiglu(a, b).

    Args:
        a: the gate projection's output.
        b: the up projection's output.
    """
    return _SwiGLU.apply(a, b)
