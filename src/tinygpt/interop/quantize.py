"""Low-precision weights for inference, applied to a built model from outside.

    quantize(model, "bf16")   bfloat16 weights: half the bytes per token (float32 activations around
                              tinygpt's kernel where it builds, else bfloat16 throughout)
    quantize(model, "fp16")   float16 weights, float32 activations: half the bytes, on any x86 CPU
    quantize(model, "int8")   int8 weights (out, in) with one scale per output channel
    quantize(model, "int4")   4-bit weights with a scale and offset per group of 32 inputs

Decoding one token at a time is matrix-vector work: the time goes into streaming the weights
from memory, so fewer bytes per weight is more tokens per second. Which kernel multiplies them
fastest depends on the CPU, so each format picks its kernel from what this CPU can do, checked
when the model is converted (never assumed from the CPU's name):

- fp32 and fp16 decoding rows on an x86 CPU with AVX2 go to tinygpt's own matrix-vector kernel
  (tinygpt.kernels, FloatLinear), which streams the weights at the memory's speed, float16 widened to
  float32 in registers, and so do a short prompt's rows (up to FLOAT_KERNEL_ROWS); longer inputs go
  to PyTorch's matmul. Where that kernel cannot be built,
  fp32 weights are reordered into oneDNN's blocked layout (PackedLinear) and fp16 uses fbgemm's fp16
  kernel (F16C, on every AVX2 CPU).
- Where tinygpt's kernels build, every format decodes in float32 around them, whether or not the CPU
  multiplies bfloat16 natively: on the Zen 5 in the README (AVX-512 BF16) bf16, int8 and int4 models
  decoded 1.5-3.2x faster that way than computing in bfloat16 around PyTorch's kernels, and prompts
  no slower (bf16's longer inputs still multiply in bfloat16 there, int8's with fbgemm).
- bf16 sends its weights to tinygpt's kernel, widened to float32 in registers as fp16's are; where
  that kernel cannot be built the model computes in bfloat16 (emulated, and slow, where the CPU lacks
  AVX-512 BF16 and AMX: fp16 is the 16-bit format to use there).
- int8 decoding rows go to tinygpt's own kernel (tinygpt.kernels: int8 weights against activations
  quantized in blocks of 32), which reads the weights at nearly twice the speed of fbgemm's at one
  row; longer inputs multiply with fbgemm's dynamic int8 kernel, which quantizes each input to 8
  bits on the fly (7 bits of range, so the products cannot saturate on CPUs without VNNI). Without
  tinygpt's kernels, a CPU with native bfloat16 uses PyTorch's weight-only int8 kernel
  (`aten._weight_int8pack_mm`, bfloat16 activations, a few rows at a time; longer inputs multiply a
  dequantized bfloat16 copy), and other CPUs fbgemm's.
- int4 uses tinygpt's own kernel where it builds (tinygpt.kernels: a scale and minimum per block
  of 32 inputs, float32 activations), else PyTorch's int4 kernel
  (`aten._weight_int4pack_mm_for_cpu`, bfloat16 inputs), as gpt-fast does; a layer whose shape the
  kernel cannot take (in_features not a multiple of 32; for PyTorch's, also out_features not a
  multiple of 16, such as a character model's head) is stored in int8.

The result is for inference (generate, eval, serve): such models cannot be trained or saved.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import functools
import warnings

from .. import kernels
from ..device import allow_fast_float32, cpu_has_native_bf16
from ..errors import ConfigError

FORMATS = ("fp32", "bf16", "fp16", "int8", "int4")
INT8_KERNEL_ROWS = 8  # up to this many rows the int8 kernel beats dequantize + bf16 matmul (measured)
# up to this many rows (a short prompt) float32 and float16 weights multiply on tinygpt's kernel, past it on
# PyTorch's matmul, float16 widened for the call: SmolLM2-135M's matrices at 16 rows 46 against 53 ms on the
# README's Xeon with AMX, at 32 rows 77 against 69 (bfloat16 weights take PyTorch's bfloat16 matmul past 8 rows
# where the CPU multiplies it natively: 2.3x the kernel's speed at 16 rows there)
FLOAT_KERNEL_ROWS = 16
INT8_KERNEL_ALIGN = 16  # the CPU kernel needs in_features to be a multiple of 16
INT4_GROUP = kernels.BLOCK  # inputs per scale and offset (llama.cpp's Q4_0 blocks are 32 long too)
INT4_OUT_ALIGN = 16  # the int4 kernel packs 16 output channels together


def _decoding_rows(x: torch.Tensor) -> bool:
    # float32 rows as the module-free decode step passes them, for tinygpt's kernels as they are: at
    # batch 1 a layer's reshape, casts and view around the kernel cost 10-15 us of its 80 (GPT-2's MLP)
    return x.dim() == 2 and x.dtype is torch.float32 and x.shape[0] <= INT8_KERNEL_ROWS


class Int8Linear(nn.Module):
    """A Linear layer with int8 weights and a scale per output channel: y = (x @ q.T) * s + b.

    Args:
        linear: the float layer to quantize (symmetric, per output channel: s = max|w_row| / 127).
        dtype: the activation dtype. bfloat16: PyTorch's weight-only int8 kernel (for CPUs that
            multiply bfloat16 natively, and accelerators); float32: fbgemm's dynamic int8 kernel,
            which quantizes the activations too, where this PyTorch has it (`fbgemm_works`).
    """

    def __init__(self, linear: nn.Linear, dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        w = linear.weight.detach().float()
        # round the scale to its stored dtype first, so q * scale is exactly what the kernel computes
        scales = (w.abs().amax(dim=1).clamp(min=1e-12) / 127).to(dtype)
        q = torch.round(w / scales.float().unsqueeze(1)).clamp(-127, 127).to(torch.int8).contiguous()
        bias = linear.bias.detach().to(dtype) if linear.bias is not None else None
        self.packed = None  # fbgemm's prepacked weights (not a buffer: it cannot be copied or saved)
        if dtype is torch.float32 and q.device.type == "cpu" and fbgemm_works():
            self.packed = _fbgemm_int8_pack(q, scales, bias)
        # (out, in) int8; None where fbgemm's pack holds q (dequantized() reads it back from there)
        self.register_buffer("weight", q if self.packed is None else None)
        self.register_buffer("scales", scales)  # (out,)
        self.register_buffer("bias", bias)
        self.use_kernel = self.packed is None and self.in_features % INT8_KERNEL_ALIGN == 0 and _kernel_works(self)
        # decoding rows in float32 on a CPU: tinygpt's own kernel, where it builds (tinygpt.kernels), on
        # q in its layout (beside fbgemm's, which prompts take: two bytes a weight in all)
        self.lowbit = (self.packed is not None and self.in_features % kernels.BLOCK == 0
                       and kernels.lowbit() is not None)
        self.grouped = kernels.int8_group(q) if self.lowbit else None  # not a buffer, as packed
        self.nbytes = q.numel() + scales.numel() * scales.element_size()

    def dequantized(self) -> torch.Tensor:
        """The weights the layer computes with, q * s, exactly: (out, in) in float32."""
        q = self.weight if self.packed is None else torch.ops.quantized.linear_unpack(self.packed)[0].int_repr()
        return q.float() * self.scales.float().unsqueeze(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.lowbit and _decoding_rows(x):
            return kernels.lowbit().int8_linear(x, self.grouped, self.scales, self.bias, self.out_features)
        x = x.to(self.scales.dtype)
        rows = x.reshape(-1, self.in_features)  # (N, in)
        if self.lowbit and _decoding_rows(rows):  # a few rows in another shape
            return self.forward(rows).view(*x.shape[:-1], self.out_features)
        if self.packed is not None:
            return self._fbgemm(rows).view(*x.shape[:-1], self.out_features)
        if self.use_kernel and rows.shape[0] <= INT8_KERNEL_ROWS:
            y = torch.ops.aten._weight_int8pack_mm(rows.contiguous(), self.weight, self.scales)
        else:
            # (x @ q.T) * s: the per-channel scale commutes with the matmul, so int8 -> bf16 is the only copy
            y = F.linear(rows, self.weight.to(rows.dtype)) * self.scales
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def _fbgemm(self, rows: torch.Tensor) -> torch.Tensor:
        # fbgemm quantizes its whole input with one scale (reduce_range: 7 bits, so that no product
        # saturates on CPUs without VNNI). A few rows are decoding rows, often of different
        # sequences: each gets its own scale, so a sequence decodes alike in any batch. More rows
        # are one prompt or an evaluation batch, multiplied in one call (several times faster).
        if 1 < rows.shape[0] <= INT8_KERNEL_ROWS:
            return torch.cat([torch.ops.quantized.linear_dynamic(row, self.packed, True) for row in rows.split(1)])
        return torch.ops.quantized.linear_dynamic(rows, self.packed, True)

    def extra_repr(self) -> str:
        kernel = ("tinygpt+fbgemm" if self.lowbit else "fbgemm" if self.packed is not None else
                  "int8pack" if self.use_kernel else "dequantized")
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"kernel={kernel}")


def _fbgemm_int8_pack(q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None):
    zero_points = torch.zeros(q.shape[0], dtype=torch.long)
    with warnings.catch_warnings():  # PyTorch marks its quantized tensors as deprecated; the pinned release has them
        warnings.simplefilter("ignore")
        qweight = torch._make_per_channel_quantized_tensor(q, scales.double(), zero_points, 0)
        return torch.ops.quantized.linear_prepack(qweight, bias)


class Fp16Linear(nn.Module):
    """A Linear layer with float16 weights and float32 inputs and outputs (fbgemm's fp16 kernel, CPU).

    The kernel widens each block of weights to float32 in registers and accumulates in float32,
    so it reads half of float32's bytes without bfloat16 hardware. The packed weights are opaque:
    such a layer only runs forward, on the CPU.

    Args:
        linear: the layer to convert (weights rounded to float16).
    """

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach().float().clamp(-65504, 65504)  # float16's range
        bias = linear.bias.detach().float() if linear.bias is not None else None
        self.packed = torch.ops.quantized.linear_prepack_fp16(weight, bias)
        self.has_bias = bias is not None
        self.nbytes = weight.numel() * 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.float().reshape(-1, self.in_features)
        return torch.ops.quantized.linear_dynamic_fp16(rows, self.packed).view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.has_bias}"


def int4_quantize(weight: torch.Tensor, group: int = INT4_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit quantization of an (out, in) weight, per group of `group` inputs.

    Returns:
        (q, scales_and_zeros): q (out, in) int32 in 0..15, and (in / group, out, 2) bfloat16 holding
        each group's scale and the value of the middle code 8, so that w ~ (q - 8) * scale + zero:
        the layout PyTorch's int4 kernel reads.
    """
    out, inp = weight.shape
    w = weight.detach().float().reshape(out, inp // group, group)
    low, high = w.amin(dim=-1, keepdim=True), w.amax(dim=-1, keepdim=True)
    # round scale and zero to their stored dtype first, so the codes fit what the kernel computes
    scale = ((high - low).clamp(min=1e-8) / 15).to(torch.bfloat16)
    zero = (low + 8 * scale.float()).to(torch.bfloat16)
    q = torch.round((w - zero.float()) / scale.float() + 8).clamp(0, 15).to(torch.int32).reshape(out, inp)
    return q, torch.cat([scale, zero], dim=-1).transpose(0, 1).contiguous()


class Int4Linear(nn.Module):
    """A Linear layer with 4-bit weights, a scale and an offset per group of INT4_GROUP inputs (CPU).

    Where tinygpt's own kernel builds (tinygpt.kernels), it multiplies float32 inputs by codes
    stored two to a byte with a float16 scale and minimum per group; elsewhere it uses PyTorch's
    int4 kernel, which wants bfloat16 inputs. Outputs come back in the input's dtype, so the rest
    of the model may stay float32 where bfloat16 is emulated. Such a layer only runs forward, on
    the CPU.

    Args:
        linear: the layer to quantize; `int4_fits(linear)` must hold.
    """

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.lowbit = kernels.lowbit() is not None
        if self.lowbit:
            packed, params = kernels.int4_pack(*kernels.int4_codes(linear.weight))
            self.register_buffer("packed", packed)  # (out / 8, in / 32, 128)
        else:
            q, params = int4_quantize(linear.weight)
            self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1))  # (out, in / 2)
        self.params = params  # not a buffer: it keeps its 16 bits when the model moves to float32
        bias = linear.bias.detach().float() if linear.bias is not None else None
        self.register_buffer("bias", bias)
        self.nbytes = self.packed.numel() + self.params.numel() * 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.lowbit and _decoding_rows(x):
            return kernels.lowbit().int4_linear(x, self.packed, self.params, self.bias, self.out_features)
        rows = x.reshape(-1, self.in_features)
        if self.lowbit:
            y = kernels.lowbit().int4_linear(rows.float(), self.packed, self.params, self.bias,
                                             self.out_features).to(x.dtype)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(rows.to(torch.bfloat16), self.packed, INT4_GROUP,
                                                          self.params).to(x.dtype)
            if self.bias is not None:
                y = y + self.bias.to(x.dtype)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        kernel = "tinygpt" if self.lowbit else "aten"
        return f"in_features={self.in_features}, out_features={self.out_features}, group={INT4_GROUP}, kernel={kernel}"


def int4_fits(linear: nn.Linear) -> bool:
    """Whether the int4 kernel takes this layer's shape: in_features a multiple of INT4_GROUP and,
    for PyTorch's kernel, out_features a multiple of 16."""
    if linear.in_features % INT4_GROUP:
        return False
    return kernels.lowbit() is not None or linear.out_features % INT4_OUT_ALIGN == 0


class FloatLinear(nn.Module):
    """A Linear layer with float32, float16 or bfloat16 weights for tinygpt's own matrix-vector kernel (CPU).

    Up to INT8_KERNEL_ROWS rows (decoding) go to tinygpt.kernels' float_linear, which streams the
    weights at the memory's speed (16-bit weights widened to float32 in registers), and up to
    FLOAT_KERNEL_ROWS (a short prompt) too, but for bfloat16 weights where the CPU multiplies them
    natively; longer inputs (a prompt, an evaluation batch) go to PyTorch's matmul: in bfloat16 for
    bfloat16 weights where the CPU multiplies it natively (4x float32's rate on the README's Zen 5),
    else in float32 with 16-bit weights widened for the call. Activations, outputs and bias are
    float32. Such a layer only runs forward, on the CPU.

    Args:
        linear: the layer to convert; `FloatLinear.fits(linear)` must hold.
        dtype: float32, float16 or bfloat16 for the weights.
    """

    def __init__(self, linear: nn.Linear, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach().float()
        if dtype is torch.float16:
            weight = weight.clamp(-65504, 65504)  # float16's range
        # plain attributes, not buffers: 16-bit weights must not become float32 when the model moves
        self.weight = weight.to(dtype).contiguous()
        self.bias = linear.bias.detach().float() if linear.bias is not None else None
        self.nbytes = self.weight.numel() * self.weight.element_size() + (self.bias.numel() * 4 if self.bias is not None else 0)
        self.native_bf16 = dtype is torch.bfloat16 and cpu_has_native_bf16()  # long inputs multiply in bfloat16

    @staticmethod
    def fits(linear: nn.Linear) -> bool:
        """Whether the kernel takes this layer: tinygpt's kernels built here, in_features a multiple of 8."""
        return linear.in_features % 8 == 0 and kernels.lowbit() is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _decoding_rows(x):
            return kernels.lowbit().float_linear(x, self.weight, self.bias)
        rows = x.float().reshape(-1, self.in_features)
        if rows.shape[0] <= (INT8_KERNEL_ROWS if self.native_bf16 else FLOAT_KERNEL_ROWS):
            y = kernels.lowbit().float_linear(rows, self.weight, self.bias)
        elif self.native_bf16:
            y = F.linear(rows.bfloat16(), self.weight).float() + (self.bias if self.bias is not None else 0)
        else:
            y = F.linear(rows, self.weight.float(), self.bias)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, dtype={self.weight.dtype}"


class PackedLinear(nn.Module):
    """A Linear layer whose weight is reordered once into oneDNN's blocked layout (CPU only).

    PyTorch's default CPU matmul reads an (out, in) weight at well under half the memory's speed
    when the input is one row; the packed layout streams at near the read limit (the README's
    Performance section has the figures). The packed tensor is opaque:
    such a layer only runs forward, on the CPU.

    Args:
        linear: the layer to pack.
        dtype: float32 or bfloat16 for weights and activations.
    """

    def __init__(self, linear: nn.Linear, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.in_features, self.out_features, self.dtype = linear.in_features, linear.out_features, dtype
        weight = linear.weight.detach().to(dtype)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight)  # not a buffer: it cannot be copied or saved
        self.bias = linear.bias.detach().to(dtype) if linear.bias is not None else None
        self.nbytes = weight.numel() * weight.element_size() + (self.bias.numel() * self.bias.element_size() if
                                                                self.bias is not None else 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x.to(self.dtype), self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, dtype={self.dtype}"


def can_pack(device: torch.device | str, dtype: torch.dtype = torch.float32) -> bool:
    """Whether PackedLinear runs here in `dtype`: a CPU with oneDNN (mkldnn) in this PyTorch build
    that supports the dtype (oneDNN's bfloat16 path needs AVX-512 or AVX-NE-CONVERT; an AVX2-only CPU
    has none, and there a bf16 model keeps PyTorch's own kernels)."""
    if torch.device(device).type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    try:
        linear = nn.Linear(16, 8).to(dtype)
        x = torch.randn(3, 16, dtype=dtype)
        atol = 1e-5 if dtype is torch.float32 else 0.05
        return bool(torch.allclose(PackedLinear(linear, dtype)(x).float(), linear(x).float(), atol=atol))
    except (RuntimeError, NotImplementedError):
        return False


@functools.cache
def fbgemm_works() -> bool:
    """Whether this PyTorch has fbgemm's CPU kernels (x86 builds; AVX2 at least) and its dynamic int8
    and fp16 products agree with float32 here."""
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        return False
    try:
        g = torch.Generator().manual_seed(0)
        w, x = torch.randn(32, 64, generator=g), torch.randn(3, 64, generator=g)
        scales = w.abs().amax(dim=1) / 127
        q = torch.round(w / scales.unsqueeze(1)).to(torch.int8)
        int8 = torch.ops.quantized.linear_dynamic(x, _fbgemm_int8_pack(q, scales, None), True)
        fp16 = torch.ops.quantized.linear_dynamic_fp16(x, torch.ops.quantized.linear_prepack_fp16(w, None))
    except (RuntimeError, NotImplementedError):
        return False
    want = x @ w.t()
    scale = float(want.abs().max())
    return bool(torch.allclose(int8, want, atol=0.05 * scale) and torch.allclose(fp16, want, atol=0.01 * scale))


def activation_dtype(fmt: str, device: torch.device | str) -> torch.dtype:
    """The dtype a model quantized to `fmt` computes in outside its Linear layers on `device`.

    On a CPU where tinygpt's kernels build, bf16, int8 and int4 compute in float32 around them (int8
    with fbgemm for longer inputs); without them, in bfloat16 where the CPU multiplies it natively and
    on accelerators, else int8 and int4 in float32 (fbgemm's int8 kernel wants float32 inputs) and bf16
    in emulated bfloat16. fp16 computes in float32 around fbgemm's fp16 kernel on a CPU (float16
    throughout elsewhere).
    """
    cpu = torch.device(device).type == "cpu"
    if fmt == "fp32":
        return torch.float32
    if fmt == "fp16":
        return torch.float32 if cpu and fbgemm_works() else torch.float16
    # float32 around tinygpt's kernels, where they build, decodes faster than PyTorch's bfloat16 paths
    # even where bfloat16 is native (the README's Zen 5: 1.5-3.2x); without them, bfloat16 unless emulated
    kernel = cpu and kernels.lowbit() is not None
    if fmt == "bf16":
        return torch.float32 if kernel else torch.bfloat16
    float32 = cpu and (kernel or not cpu_has_native_bf16()) and (fmt == "int4" or fbgemm_works())
    return torch.float32 if float32 else torch.bfloat16


def _kernel_works(layer: Int8Linear) -> bool:
    """Whether the int8 kernel runs on this device and agrees with the dequantized product."""
    x = torch.randn(2, layer.in_features, device=layer.weight.device, dtype=layer.scales.dtype)
    try:
        got = torch.ops.aten._weight_int8pack_mm(x, layer.weight, layer.scales).float()
    except (RuntimeError, NotImplementedError):
        return False
    want = x.float() @ layer.dequantized().t()
    return bool(torch.allclose(got, want, rtol=0.02, atol=0.02 * float(want.abs().max()) + 1e-6))


def quantize(model: nn.Module, fmt: str, *, pack: bool | None = None) -> nn.Module:
    """Convert a model's weights to a format for fast inference, in place; returns it.

    Args:
        model: a tinygpt GPT (any nn.Module whose Linear layers should be converted).
        fmt: "fp32" (float32 values unchanged, only given a faster kernel), "bf16" (bfloat16
            weights; activations too where tinygpt's kernels do not build), "fp16" (float16 weights),
            "int8" (int8 weights with a scale per output channel) or "int4" (4-bit weights with a
            scale and offset per group of 32 inputs; CPU only). `activation_dtype` says what the
            rest of the model computes in.
        pack: give fp32 and bf16 Linear layers a faster CPU kernel: tinygpt's own for fp32 where it
            builds (FloatLinear), else oneDNN's blocked layout (PackedLinear); default: when the model
            is on a CPU that has oneDNN.

    Returns:
        the same model, in eval mode, ready for `tinygpt.generate` and evaluation; it can no longer
        be trained or saved when quantized or packed. A tied LM head gets its own copy (the
        embedding stays as it is for the lookup).

    Raises:
        ConfigError: an unknown format, or int4 on a device other than the CPU.
    """
    if fmt not in FORMATS:
        raise ConfigError(f"quantize: format must be one of {', '.join(FORMATS)}; got {fmt!r}")
    model.eval()
    device = next(model.parameters()).device
    if fmt == "int4" and device.type != "cpu":
        raise ConfigError(f"quantize: int4 runs on the CPU only (PyTorch's CPU int4 kernel); the model is on {device}")
    dtype = activation_dtype(fmt, device)
    allow_fast_float32(device)  # TF32 matmuls on CUDA
    pack = can_pack(device, dtype) if pack is None else pack
    # quantize from the float32 weights before anything is rounded to a lower precision
    if fmt == "int8":
        _replace_linears(model, lambda linear: Int8Linear(linear, dtype))
    elif fmt == "int4":
        _replace_linears(model, lambda linear: Int4Linear(linear) if int4_fits(linear) else Int8Linear(linear, dtype))
    elif fmt == "fp16" and dtype is torch.float32:
        _replace_linears(model, lambda linear: FloatLinear(linear, torch.float16) if FloatLinear.fits(linear) else
                         Fp16Linear(linear))
    elif fmt == "bf16" and dtype is torch.float32:  # a layer the kernel cannot take keeps float32 bfloat16 values
        _replace_linears(model, lambda linear: FloatLinear(linear, torch.bfloat16) if FloatLinear.fits(linear) else
                         _rounded(linear, torch.bfloat16))
    elif fmt == "fp32" and pack:
        _replace_linears(model, lambda linear: FloatLinear(linear) if FloatLinear.fits(linear) else linear)
    model.to(dtype)  # embeddings, LayerNorms, biases, Int8Linear scales (int8 and int4 weights keep their dtype)
    converted = fmt in ("int8", "int4") or (fmt in ("fp16", "bf16") and dtype is torch.float32)
    if pack and not converted:  # the Linear layers still as they were
        _replace_linears(model, lambda linear: PackedLinear(linear, dtype))
    model.requires_grad_(False)
    if converted or pack:
        model.inference_only = True  # checkpoint.save refuses it: the state dict no longer holds the weights
    return model


def _rounded(linear: nn.Linear, dtype: torch.dtype) -> nn.Linear:
    """The layer with its weight rounded to dtype's values, kept in float32."""
    with torch.no_grad():
        linear.weight.copy_(linear.weight.to(dtype))
    return linear


def _replace_linears(model: nn.Module, make) -> None:
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, make(child))


def on_cpu_kernels(model: nn.Module) -> bool:
    """Whether some layer of the model multiplies on a CPU kernel outside PyTorch's operators (tinygpt's own,
    oneDNN's packed layout, fbgemm's): what `quantize` gives a model on a CPU, and torch.compile cannot trace."""
    return any(isinstance(m, (FloatLinear, PackedLinear, Fp16Linear, Int4Linear))
               or isinstance(m, Int8Linear) and (m.packed is not None or m.lowbit) for m in model.modules())


def weight_format(model: nn.Module) -> str:
    """"int4", "int8", "fp16", "bf16" or "fp32" for a model, by how its weights are stored."""
    kinds = {type(m) for m in model.modules()}
    for cls, name in ((Int4Linear, "int4"), (Int8Linear, "int8"), (Fp16Linear, "fp16")):
        if cls in kinds:
            return name
    names = {torch.bfloat16: "bf16", torch.float16: "fp16"}
    for m in model.modules():
        if isinstance(m, FloatLinear) and m.weight.dtype in names:
            return names[m.weight.dtype]
    dtype = model.wte.weight.dtype if hasattr(model, "wte") else next(model.parameters()).dtype
    return names.get(dtype, "fp32")
