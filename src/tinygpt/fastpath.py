"""One decode step of a GPT on a CPU without going through its Block and attention modules.

At batch 1 a small model's step is a few hundred tiny operators, and on a CPU the time between
them (module calls, views, transposes, dtype checks, the cache's bookkeeping) costs as much as the
arithmetic. This step does the same arithmetic as `GPT.forward` with a KV cache, for one new token
per row at one shared position, in fewer operators: the Linear layers (whatever `quantize` made of
them) are called as they are, LayerNorm, GELU and attention are called as functions, and the new
keys and values go straight into the cache's buffers. A test holds it equal to the model's own path.

`generate.decode_step` takes it when `applies` says so (eval mode, a CPU, no compiler tracing);
everything else (training, accelerators, rows at different positions) runs the model's forward.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .kv_cache import KVCache


def applies(model, token: torch.Tensor, kv_cache: KVCache, pos: int) -> bool:
    """Whether `step` computes this decode step: the model in eval mode and causal, on a CPU,
    rows that fill the cache, a position inside it, and no torch.compile tracing."""
    return (
        token.device.type == "cpu"
        and not model.training
        and getattr(model, "causal", False)
        and not torch.compiler.is_compiling()
        and token.dim() == 1
        and token.shape[0] == kv_cache.batch_size
        and 0 <= pos < min(kv_cache.max_len, model.config.block_size)
    )


def step(model, token: torch.Tensor, kv_cache: KVCache, pos: int) -> torch.Tensor:
    """The logits (B, V) after token (B,) at position `pos`, its keys and values written to the cache."""
    cfg = model.config
    B, C, H = token.shape[0], cfg.n_embd, cfg.n_head
    tok = model.wte.weight[token]  # (B, C)
    if cfg.scale_embeddings:
        tok = tok * math.sqrt(C)  # as GPT.forward
    x = tok + model.wpe.weight[pos]
    for layer, block in enumerate(model.h):
        ln, attn = block.ln_1, block.attn
        q, k, v = attn.c_attn(F.layer_norm(x, ln.normalized_shape, ln.weight, ln.bias, ln.eps)).view(B, 3, H, 1, C // H).unbind(1)
        keys, values = kv_cache.k[layer], kv_cache.v[layer]  # (B, H, max_len, head_dim)
        keys[:, :, pos] = k[:, :, 0]
        values[:, :, pos] = v[:, :, 0]
        # one query at the newest position sees every key so far: no mask (KVCache.span's CPU rule)
        y = F.scaled_dot_product_attention(q.to(keys.dtype), keys[:, :, : pos + 1], values[:, :, : pos + 1])
        x = x + attn.c_proj(y.view(B, C).to(x.dtype))  # (B, H, 1, D) is already heads side by side
        ln, mlp = block.ln_2, block.mlp
        h = mlp.c_fc(F.layer_norm(x, ln.normalized_shape, ln.weight, ln.bias, ln.eps))
        x = x + mlp.c_proj(F.gelu(h, approximate=mlp.gelu.approximate))
    ln = model.ln_f
    return model.lm_head(F.layer_norm(x, ln.normalized_shape, ln.weight, ln.bias, ln.eps))
