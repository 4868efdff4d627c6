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

from .errors import ConfigError

FORMATS = ("int8", "bf16")
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


def _kernel_works(layer: Int8Linear) -> bool:
    """Whether the int8 kernel runs on this device and agrees with the dequantized product."""
    x = torch.randn(2, layer.in_features, device=layer.weight.device, dtype=layer.scales.dtype)
    try:
        got = torch.ops.aten._weight_int8pack_mm(x, layer.weight, layer.scales).float()
    except (RuntimeError, NotImplementedError):
        return False
    want = x.float() @ layer.dequantized().t()
    return bool(torch.allclose(got, want, rtol=0.02, atol=0.02 * float(want.abs().max()) + 1e-6))


def quantize(model: nn.Module, fmt: str) -> nn.Module:
    """Convert a model's weights to a low-precision format for inference, in place; returns it.

    Args:
        model: a tinygpt GPT (any nn.Module whose Linear layers should be quantized).
        fmt: "bf16" (weights and activations in bfloat16) or "int8" (weight-only int8 with
            per-output-channel scales; activations, embeddings and LayerNorms in bfloat16).

    Returns:
        the same model, in eval mode, ready for `tinygpt.generate` and `evaluate`. A tied LM head
        gets its own int8 copy (the embedding stays bfloat16 for the lookup).

    Raises:
        ConfigError: an unknown format.
    """
    if fmt not in FORMATS:
        raise ConfigError(f"quantize: format must be one of {', '.join(FORMATS)}; got {fmt!r}")
    model.eval()
    if fmt == "int8":
        # quantize from the float32 weights before anything is rounded to bfloat16
        for parent in list(model.modules()):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear):
                    setattr(parent, name, Int8Linear(child))
    model.to(torch.bfloat16)  # embeddings, LayerNorms, biases, Int8Linear scales (int8 weights stay int8)
    model.requires_grad_(False)
    return model


def weight_format(model: nn.Module) -> str:
    """"int8", "bf16", "fp32" (or "fp16") for a model, by how its weights are stored."""
    if any(isinstance(m, Int8Linear) for m in model.modules()):
        return "int8"
    dtype = next(model.parameters()).dtype
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32")
