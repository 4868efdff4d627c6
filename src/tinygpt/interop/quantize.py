"""Low-precision weights for inference, applied to a built model from outside.

    quantize(model, "bf16")   every weight and activation in bfloat16: half the bytes per token
    quantize(model, "int8")   weight-only int8: each Linear keeps int8 weights (out, in) and one
                              scale per output channel; everything else runs in bfloat16

Decoding one token at a time is matrix-vector work: the time goes into streaming the weights
from memory, so fewer bytes per weight is more tokens per second. Int8 weights are a quarter of
float32's, and PyTorch's weight-only int8 kernel (`aten._weight_int8pack_mm`) multiplies them
without unpacking them first. That kernel wants bfloat16 activations, and it works through the
rows of its input one at a time, so it is used for a few rows (decoding); longer inputs (a
prompt, an evaluation batch) multiply a dequantized bfloat16 copy instead.

The result is for inference (generate, eval, serve): int8 models cannot be trained or saved.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..device import allow_fast_float32
from ..errors import ConfigError

FORMATS = ("fp32", "bf16", "int8")
INT8_KERNEL_ROWS = 8  # up to this many rows the int8 kernel beats dequantize + bf16 matmul (measured)
INT8_KERNEL_ALIGN = 16  # the CPU kernel needs in_features to be a multiple of 16


class Int8Linear(nn.Module):
    """A Linear layer with int8 weights and a bfloat16 scale per output channel: y = (x @ q.T) * s + b.

    Args:
        linear: the float layer to quantize (symmetric, per output channel: s = max|w_row| / 127).
        dtype: the activation dtype (bfloat16: what the int8 kernel multiplies fastest).
    """

    def __init__(self, linear: nn.Linear, dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        w = linear.weight.detach().float()
        # round the scale to its stored dtype first, so q * scale is exactly what the kernel computes
        scales = (w.abs().amax(dim=1).clamp(min=1e-12) / 127).to(dtype)
        q = torch.round(w / scales.float().unsqueeze(1)).clamp(-127, 127).to(torch.int8)
        self.register_buffer("weight", q.contiguous())  # (out, in) int8
        self.register_buffer("scales", scales)  # (out,)
        bias = linear.bias.detach().to(dtype) if linear.bias is not None else None
        self.register_buffer("bias", bias)
        self.use_kernel = self.in_features % INT8_KERNEL_ALIGN == 0 and _kernel_works(self)

    def dequantized(self) -> torch.Tensor:
        """The weights the layer computes with, q * s, exactly: (out, in) in float32."""
        return self.weight.float() * self.scales.float().unsqueeze(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.scales.dtype)
        rows = x.reshape(-1, self.in_features)  # (N, in)
        if self.use_kernel and rows.shape[0] <= INT8_KERNEL_ROWS:
            y = torch.ops.aten._weight_int8pack_mm(rows.contiguous(), self.weight, self.scales)
        else:
            # (x @ q.T) * s: the per-channel scale commutes with the matmul, so int8 -> bf16 is the only copy
            y = F.linear(rows, self.weight.to(rows.dtype)) * self.scales
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


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
        fmt: "int8" (weight-only int8 with per-output-channel scales; activations, embeddings and
            LayerNorms in bfloat16), "bf16" (weights and activations in bfloat16) or "fp32"
            (float32 values unchanged, only laid out for speed).
        pack: lay float weights out for oneDNN's CPU kernels (PackedLinear); default: when the
            model is on a CPU that has them.

    Returns:
        the same model, in eval mode, ready for `tinygpt.generate` and evaluation; it can no longer
        be trained or saved when int8 or packed. A tied LM head gets its own copy (the embedding
        stays as it is for the lookup).

    Raises:
        ConfigError: an unknown format.
    """
    if fmt not in FORMATS:
        raise ConfigError(f"quantize: format must be one of {', '.join(FORMATS)}; got {fmt!r}")
    model.eval()
    dtype = torch.float32 if fmt == "fp32" else torch.bfloat16
    device = next(model.parameters()).device
    allow_fast_float32(device)  # TF32 matmuls on CUDA
    pack = can_pack(device, dtype) if pack is None else pack
    if fmt == "int8":
        # quantize from the float32 weights before anything is rounded to bfloat16
        _replace_linears(model, Int8Linear)
    model.to(dtype)  # embeddings, LayerNorms, biases, Int8Linear scales (int8 weights stay int8)
    if pack and fmt != "int8":
        _replace_linears(model, lambda linear: PackedLinear(linear, dtype))
    model.requires_grad_(False)
    if fmt == "int8" or pack:
        model.inference_only = True  # checkpoint.save refuses it: the state dict no longer holds the weights
    return model


def _replace_linears(model: nn.Module, make) -> None:
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, make(child))


def weight_format(model: nn.Module) -> str:
    """"int8", "bf16", "fp32" (or "fp16") for a model, by how its weights are stored."""
    if any(isinstance(m, Int8Linear) for m in model.modules()):
        return "int8"
    dtype = model.wte.weight.dtype if hasattr(model, "wte") else next(model.parameters()).dtype
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32")
