"""One decode step of a GPT on a CPU without going through its Block and attention modules.

At batch 1 a small model's step is a few hundred tiny operators, and on a CPU the time between
them (module calls, views, transposes, dtype checks, the cache's bookkeeping) costs as much as the
arithmetic. This step does the same arithmetic as `GPT.forward` with a KV cache, for one new token
per row at one shared position, in fewer operators: the Linear layers (whatever `quantize` made of
them) are called as they are, LayerNorm, GELU and attention are called as functions, and the new
keys and values go straight into the cache's buffers. Where every Linear layer is one of tinygpt's
kernels (a model `quantize` converted on a CPU where they build), the whole step is one call into
them (tinygpt.kernels' DecodePlan: the norms, rotary positions and attention as loops of its own),
for GPT-2's block and the llama family's alike. A plain float32
model, as `tinygpt.load` or training leaves it, is one call too: its nn.Linear weights are already
the (out, in) float32 layout tinygpt's float kernel reads, so the plan reads them where they are
(no copy, and a weight trained in place is read as it now is). Tests hold the Python step equal to
the model's own path bit for bit, and the one call to float32 rounding. (Without the one call, the
llama layout's step is the model's own forward.)

`generate.decode_step` takes it when `applies` says so (eval mode, a CPU, no compiler tracing, GPT's
own forward); everything else (training, accelerators) runs the model's forward. Rows at positions of
their own (the server's batch) are one call into the plan too (DecodePlan.rows), each row's logits those
of a step that decodes it alone, bit for bit, and so are several tokens of one sequence at once (`verify`:
a speculative step's proposals, tinygpt.speculative): every row takes a one-row step's kernels, float32's
past 8 rows too, where a prompt's rows take the prompt kernel. A short prompt (up to PROMPT_ROWS rows) is
one call into the plan too (`prompt`, which `generate.prefill` takes): a 16-token prompt to a
SmolLM2-135M-shaped float32 model took 56 ms so against 78 through the model's forward (the README's Xeon
with AMX, interleaved), the baby model in bf16 5.0 against 8.1.
"""

from __future__ import annotations

import math
import weakref

import torch
import torch.nn.functional as F

from . import kernels
from .interop import quantize
from .kv_cache import KVCache
from .device import last_level_cache
from .model import GPT, rope_frequencies


def applies(model, token: torch.Tensor, kv_cache: KVCache, pos: int | torch.Tensor) -> bool:
    """Whether `step` computes this decode step: the model in eval mode and causal, on a CPU,
    rows that fill the cache, positions inside it (`pos` an int, or a (B,) tensor: a position per
    row), and no torch.compile tracing; and the model's forward GPT's own (a subclass that overrides
    it gets its forward called)."""
    if isinstance(pos, torch.Tensor):
        if pos.dim() != 1 or pos.shape[0] != token.shape[0] or pos.device.type != "cpu" or not pos.numel():
            return False
        low, high = int(pos.min()), int(pos.max())
    else:
        low = high = pos
    return (
        token.device.type == "cpu"
        and type(model).forward is GPT.forward
        and not model.training
        and getattr(model, "causal", False)
        and not torch.compiler.is_compiling()
        and token.dim() == 1
        and token.shape[0] == kv_cache.batch_size
        and 0 <= low
        and high < min(kv_cache.max_len, model.config.block_size)
    )


def step(model, token: torch.Tensor, kv_cache: KVCache, pos: int | torch.Tensor) -> torch.Tensor:
    """The logits (B, V) after token (B,) at position `pos` (an int, or a (B,) tensor: a position per row),
    its keys and values written to the cache."""
    if token.shape[0] <= quantize.INT8_KERNEL_ROWS and kv_cache.k.dtype is torch.float32:
        plan = _plan(model)
        if plan is not None:
            if isinstance(pos, int):
                return plan.step(token, pos, kv_cache.k, kv_cache.v)
            return plan.rows(token.view(-1, 1), pos, kv_cache.k, kv_cache.v)[:, 0]
    cfg = model.config
    if not isinstance(pos, int) or cfg.arch != "gpt2":  # the llama layout's step from Python is the model's own
        positions = torch.tensor([pos]) if isinstance(pos, int) else pos.view(-1, 1)
        return model(token.view(-1, 1), kv_cache, positions)[:, -1]
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


# a prompt of up to this many rows (sequences times tokens) runs as one call into the model's DecodePlan, as
# a decode step does; longer ones take the model's forward, where PyTorch's matmuls are the faster
PROMPT_ROWS = quantize.FLOAT_KERNEL_ROWS


def prompt(model, idx: torch.Tensor, kv_cache: KVCache, start: int = 0) -> torch.Tensor | None:
    """The logits (B, V) after a short prompt idx (B, T) at positions start .. start + T - 1 (its last
    position's only), its keys and values written to the cache, in one call into the model's DecodePlan;
    None where that does not apply (more than PROMPT_ROWS rows, no plan for this model), and the model's
    forward is to run it. From a start past 0 it continues the text the cache holds (a prompt cache's
    prefix, or a draft's reading: tinygpt.speculative)."""
    if not (idx.dim() == 2 and idx.numel() <= PROMPT_ROWS and kv_cache.k.dtype is torch.float32
            and applies(model, idx[:, 0], kv_cache, start + idx.shape[1] - 1)):
        return None
    plan = _plan(model)
    return None if plan is None else plan.step(idx, start, kv_cache.k, kv_cache.v)


def verify(model, tokens: torch.Tensor, kv_cache: KVCache, start: int) -> torch.Tensor | None:
    """The logits (B, T, V) of every one of tokens (B, T) at positions start .. start + T - 1, their keys
    and values written to the cache, in one call into the model's DecodePlan, each row's bit for bit what
    `step` gives it alone (a speculative step's verification); None where no plan applies, and the
    model's forward is to run them."""
    if not (tokens.dim() == 2 and kv_cache.k.dtype is torch.float32
            and applies(model, tokens[:, 0], kv_cache, start + tokens.shape[1] - 1)):
        return None
    plan = _plan(model)
    starts = torch.full((tokens.shape[0],), start, dtype=torch.long)
    return None if plan is None else plan.rows(tokens, starts, kv_cache.k, kv_cache.v)


def _plan(model):
    """The model's step as one DecodePlan, or None where some layer is not tinygpt's kernels' (or not
    float32). Kept for the model and built again after any module, parameter or buffer was assigned
    anywhere (a layer swapped, a weight replaced) or the model changed dtype: checking the modules
    themselves at every step would cost a tenth of a small model's step."""
    key = (_assignments[0], model.wte.weight.dtype)
    kept = _plans.get(model)
    if kept is None or kept[0] != key:
        kept = _plans[model] = (key, _build(model))
    return kept[1]


# beside the models, not in them: a model stays copyable and picklable (a plan is neither), and a copy
# builds its own plan for its own tensors
_plans: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_assignments = [0]  # modules, parameters and buffers assigned so far, in any nn.Module


def _assigned(*_args) -> None:
    _assignments[0] += 1


for _register in (torch.nn.modules.module.register_module_module_registration_hook,
                  torch.nn.modules.module.register_module_parameter_registration_hook,
                  torch.nn.modules.module.register_module_buffer_registration_hook):
    _register(_assigned)


def _build(model):
    ops = kernels.lowbit()
    cfg = model.config
    attns, mlps = [b.attn for b in model.h], [b.mlp for b in model.h]
    # each block's ln_1, ln_2 (and its queries' and keys' norms), then ln_f
    qk = lambda a: (a.q_norm, a.k_norm) if cfg.qk_norm else ()  # noqa: E731
    norms = [n for b in model.h for n in (b.ln_1, b.ln_2, *qk(b.attn))] + [model.ln_f]
    if cfg.arch == "gpt2":
        per_block = [(a.c_attn, a.c_proj, m.c_fc, m.c_proj) for a, m in zip(attns, mlps)]
    else:
        gate = lambda m: (m.gate_proj,) if m.kind == "swiglu" else ()  # noqa: E731
        per_block = [(a.q_proj, a.k_proj, a.v_proj, a.o_proj, *gate(m), m.up_proj, m.down_proj) for a, m in zip(attns, mlps)]
    linears = [m for layers in per_block for m in layers] + [model.lm_head]
    rope = cfg.positions == "rope"
    inv_freq = rope_frequencies(cfg) if rope else torch.empty(0)
    wpe = torch.empty(0) if rope else model.wpe.weight
    floats = [model.wte.weight, wpe, *(p for n in norms for p in (n.weight, getattr(n, "bias", None)) if p is not None)]
    specs = [_kernel_spec(m) for m in linears]
    if ops is None or None in specs or any(p.dtype is not torch.float32 or p.device.type != "cpu" for p in floats):
        return None
    mlp = cfg.mlp if cfg.mlp != "gelu" else ("tanh" if cfg.activation == "gelu_tanh" else "none")  # GELU's approximate
    plan = torch.classes.tinygpt_lowbit.DecodePlan(
        model.wte.weight, wpe, inv_freq, math.sqrt(cfg.n_embd) if cfg.scale_embeddings else 1.0, cfg.n_head,
        cfg.kv_heads, cfg.head_dim, mlp, cfg.norm == "rmsnorm", cfg.arch == "gpt2", bool(cfg.qk_norm))
    for n in norms:
        plan.norm(n.weight, getattr(n, "bias", None), n.eps if n.eps is not None else torch.finfo(torch.float32).eps)
    for spec in specs:
        plan.linear(*spec)
    if _in_cache(specs):
        plan.float_rows(4)
    return plan


def _in_cache(specs) -> bool:
    """Whether the plan's weights (the Linear layers' tensors) fit in half the CPU's last-level cache, where a
    step finds them from one token to the next: float32 weights are then read four rows at a time, which
    measured faster there than one row with its prefetch (which is for weights streaming from memory). On
    the README's Xeon with AMX (300 MiB L3), paired rounds: make demo's model 1.09x, the lesson's 1.15x,
    the baby model (42 MB) 1.04x; GPT-2 small's 12 x 768 (350 MB) 0.86x, where it stays at one row."""
    cache = last_level_cache()
    weights = sum(t.numel() * t.element_size() for spec in specs for t in spec[2:] if isinstance(t, torch.Tensor))
    return cache is not None and weights <= cache // 2


def _kernel_spec(layer) -> tuple | None:
    """(kind, out_features, weight, aux, bias) of a Linear layer on tinygpt's kernels, as
    DecodePlan.linear takes them: quantize's layers, and a plain float32 nn.Linear on the CPU, whose
    weight is the layout FloatLinear("fp32") keeps."""
    if isinstance(layer, quantize.FloatLinear):
        return 0, layer.out_features, layer.weight, torch.empty(0), layer.bias
    if type(layer) is torch.nn.Linear and quantize.FloatLinear.fits(layer):
        w, b = layer.weight, layer.bias
        if all(t is None or (t.dtype is torch.float32 and t.device.type == "cpu" and t.is_contiguous()) for t in (w, b)):
            return 0, layer.out_features, w, torch.empty(0), b  # the parameters: `.data =` swaps stay seen
    if isinstance(layer, quantize.Int8Linear) and layer.lowbit and layer.scales.dtype is torch.float32:
        return 1, layer.out_features, layer.grouped, layer.scales, layer.bias
    if isinstance(layer, quantize.Int4Linear) and layer.lowbit:
        return 2, layer.out_features, layer.packed, layer.params, layer.bias
    return None
