"""The GPT model, top to bottom: attention (with rotary positions), MLP, Block, GPT.

Modules are built in the order the lesson builds them (token embedding, position embedding, then
per block ln_1, c_attn, c_proj, ln_2, c_fc, c_proj; ln_f, lm_head), so with the `lesson` preset
the same seed gives the lesson's exact parameters. Names follow GPT-2's so that interchange with
Hugging Face checkpoints is a key map.

The Llama family (config.arch "llama": SmolLM2, Qwen2.5, Qwen3, TinyLlama, Llama 3.2) is the same
model with other settings, read along the same lines: rotary positions instead of wpe, RMSNorm for
LayerNorm, a SwiGLU MLP, fewer key/value heads than query heads, a norm on each head's queries and
keys. Its projections are separate and carry Hugging Face's names inside tinygpt's blocks
(h.N.attn.q_proj, k_proj, v_proj, o_proj; h.N.mlp.gate_proj, up_proj, down_proj), so that its
interchange is a key map too (model.layers.N.self_attn.q_proj <-> h.N.attn.q_proj) and LoRA adapts
a query or a value projection alone, under the names PEFT and its users give them.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import kernels
from .config.model import LOSS_CHUNK, MATH_ATTENTION_MAX_SCORES, GPTConfig
from .kv_cache import KVCache


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    explicit: bool = False,
    dropout: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Causal scaled dot-product attention over (..., T, head_dim) tensors.

    One contract, three ways to compute it. The fast path calls PyTorch's fused
    `scaled_dot_product_attention`, except for training on a CPU in bf16: a batched-matmul path
    (_sdpa_is_slow). (In float32, CausalSelfAttention trains on tinygpt's kernel where it applies,
    kernels.causal_attention, before it comes here.)
    The explicit path is the lesson's: scores / sqrt(d_head), the tril mask as -inf, softmax; it
    also returns the attention weights (..., T_q, T_k).

    Args:
        q, k, v: queries (..., H, T_q, D), keys and values (..., H_kv, T_k, D), where H_kv divides H
            (grouped-query attention: each key/value head serves H / H_kv query heads).
        mask: bool (..., T_q, T_k), True where a query may look. None means causal, aligned at
            the end: a sequence attending to itself (T_q == T_k), or one new query that sees
            every key (T_q == 1).
        explicit: use the explicit path and return the weights.
        dropout: dropout on the attention weights.

    Returns:
        (output (..., T_q, D), weights or None).
    """
    t_q, t_k = q.shape[-2], k.shape[-2]
    # fewer key/value heads than query heads (grouped-query attention)
    grouped = q.dim() > 2 and k.shape[-3] != q.shape[-3]
    if not explicit and not _sdpa_is_slow(q, k):
        causal = mask is None and t_q > 1
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=causal,
                                             enable_gqa=grouped)
        return out, None
    if grouped:  # query head h reads key/value head h // (n_head / n_kv_head), as SDPA's enable_gqa
        group = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    if mask is None:
        mask = torch.tril(torch.ones(t_q, t_k, device=q.device), diagonal=t_k - t_q) == 1
    if not explicit:
        return _matmul_attention(q, k, v, mask, dropout), None
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])  # (..., T_q, T_k)
    scores = scores.masked_fill(~mask, float("-inf"))
    weights = F.softmax(scores, dim=-1)
    out = F.dropout(weights, p=dropout) @ v
    return out, weights


def _matmul_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, dropout: float
) -> torch.Tensor:
    # The explicit path's arithmetic in fewer passes over the T x T scores: the mask becomes an
    # additive bias (0 or -inf) that one baddbmm adds while it computes q k^T / sqrt(d), so there is
    # no separate scale, mask fill or copy of the scores to make (the README's Performance section
    # has what that saves).
    *lead, t_q, d = q.shape
    t_k = k.shape[-2]
    bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf"))
    if bias.dim() > 2:
        bias = bias.expand(*lead, t_q, t_k).reshape(-1, t_q, t_k)
    scores = torch.baddbmm(bias, q.reshape(-1, t_q, d), k.reshape(-1, t_k, d).transpose(1, 2), alpha=d**-0.5)
    weights = F.dropout(F.softmax(scores, dim=-1), p=dropout)
    return (weights @ v.reshape(-1, t_k, d)).view(*lead, t_q, d)


def _sdpa_is_slow(q: torch.Tensor, k: torch.Tensor) -> bool:
    # PyTorch's CPU flash-attention backward is slow in bfloat16, slower than the matmul path above
    # at every size tinygpt trains on a CPU (figures in the README's Performance section). So bf16
    # training on a CPU takes the matmul path, as long as its T x T scores (kept for backward, 2 bytes
    # each) stay small; inference and float32 keep SDPA, which is as fast or faster there.
    if q.dtype != torch.bfloat16 or q.device.type != "cpu" or not q.requires_grad:
        return False
    return q.shape[:-1].numel() * k.shape[-2] <= MATH_ATTENTION_MAX_SCORES


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of logits (B, T, V) against targets (B, T), in float32."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def masked_lm_loss(logits: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy averaged over the targets with weight 1 (B, T): the others (a user's
    words, padding) add nothing to the loss or its gradient. 0 when no target counts."""
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1), reduction="none")
    w = weights.reshape(-1).to(ce.dtype)
    # where, not a product alone: a masked target's loss may be inf, and inf * 0 would be nan
    return torch.where(w > 0, ce * w, 0.0).sum() / w.sum().clamp_min(1.0)


HEAD_SLICE = 512  # rows of the head's weight one product of _logits takes on a CPU


def _logits(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """h @ weight.T. A float32 head on a CPU with a large vocabulary (GPT-2's 50,257 rows) goes a slice
    of HEAD_SLICE rows at a time into one buffer: PyTorch's product (MKL) with the whole weight ran at
    about half the speed (Zen 3, 83 rows by 768 x 50,257: 42-45 GFLOP/s whole, 80-83 in slices)."""
    V = weight.shape[0]
    if h.device.type != "cpu" or h.dtype != torch.float32 or V <= 2 * HEAD_SLICE:
        return h @ weight.T
    out = torch.empty(h.shape[0], V, dtype=h.dtype)
    for i in range(0, V, HEAD_SLICE):
        torch.mm(h, weight[i:i + HEAD_SLICE].T, out=out[:, i:i + HEAD_SLICE])
    return out


def _cross_entropy_rows_(
    logits: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor, grad: bool
) -> torch.Tensor:
    """Each row's cross-entropy against its target, (N,), from float32 logits (N, V); with grad the
    logits become, in place, the gradient of sum_i weights_i * loss_i: weights * (softmax - one-hot).
    On tinygpt's CPU kernel where it is built (one exponential an element and no temporary, against
    two and a temporary the size of the logits here), else in PyTorch."""
    ops = kernels.lowbit() if logits.device.type == "cpu" else None
    if ops is not None:
        return ops.cross_entropy_rows_(logits, targets.contiguous(), weights.contiguous(), grad)
    lse = torch.logsumexp(logits, dim=1)
    ce = lse - logits.gather(1, targets[:, None]).squeeze(1)
    if grad:
        p = logits.sub_(lse[:, None]).exp_()  # the softmax, in place of the logits
        p[torch.arange(len(targets), device=targets.device), targets] -= 1
        p.mul_(weights[:, None])
    return ce


class _HeadLoss(torch.autograd.Function):
    """sum_i w_i * cross-entropy(h_i @ W.T, t_i) over rows i, a chunk of rows at a time.

    A batch's logits are the largest tensor of a training step on a big vocabulary (GPT-2 at 4 x 256:
    206 MB in float32, three times over with cross-entropy's log-probabilities and their gradient),
    and a method that trains little (LoRA) would peak there. Here they never exist whole: each
    chunk's logits give its loss and, in the same pass, its gradients for h and W (the softmax minus
    the target's one-hot), which backward only scales. The matmuls run in autocast's dtype when it is
    on, the softmax in float32, as F.cross_entropy on autocast logits does.
    """

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor):
        kind = hidden.device.type
        dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else hidden.dtype
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        # The gradient products below sum over a chunk's rows at unit scale, where a GradScaler's scale never
        # reaches: float16's range (65,504) overflows there on a big batch over a small vocabulary, so under
        # float16 autocast they run in float32 (bfloat16 has float32's range)
        grad_dtype = torch.float32 if dtype is torch.float16 else dtype
        with torch.autocast(kind, enabled=False):
            h_all, w_c = hidden.to(dtype), weight.to(dtype)
            w_g = w_c.to(grad_dtype)
            grad_h = torch.empty_like(hidden) if need_h else None
            grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
            total = torch.zeros((), dtype=torch.float32, device=hidden.device)
            rows = max(1, LOSS_CHUNK // weight.shape[0])
            for i in range(0, hidden.shape[0], rows):
                h, t, w = h_all[i:i + rows], targets[i:i + rows], weights[i:i + rows]
                logits = _logits(h, w_c).float()
                ce = _cross_entropy_rows_(logits, t, w, grad=need_h or need_w)
                total += torch.where(w > 0, ce * w, 0.0).sum()  # where: a masked target's loss may be inf
                if need_h or need_w:
                    p = logits.to(grad_dtype)  # now the loss's gradient for the chunk's logits
                    if need_h:
                        grad_h[i:i + rows] = p @ w_g
                    if need_w and grad_dtype == torch.float32:
                        grad_w.addmm_(p.T, h.to(grad_dtype))
                    elif need_w:  # bfloat16 autocast: the product in its dtype, added to float32
                        grad_w.add_(p.T @ h)
        ctx.save_for_backward(grad_h, grad_w)
        ctx.weight_dtype = weight.dtype
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # in place: a second copy of the head's gradient would be the step's peak (training runs
        # backward once; retain_graph is not for this function)
        grad_h, grad_w = ctx.saved_tensors
        grad_h = grad_h.mul_(grad) if grad_h is not None else None
        grad_w = grad_w.mul_(grad).to(ctx.weight_dtype) if grad_w is not None else None
        return grad_h, grad_w, None, None


def head_loss(
    hidden: torch.Tensor, head: nn.Module, targets: torch.Tensor, weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """The mean next-token cross-entropy of head(hidden) against targets, in float32: over every
    target (lm_loss), or over the targets with weight > 0, each counted by its weight
    (masked_lm_loss). A bias-free Linear head (the GPT's own) computes it in chunks (_HeadLoss);
    any other (a quantized one) through its logits.

    Args:
        hidden: (B, T, C) the final LayerNorm's output.
        head: the LM head.
        targets: (B, T) token ids.
        weights: (B, T) target weights (chat data: 1 on the assistant's tokens, 0 elsewhere).
    """
    fused = type(head) is nn.Linear and head.bias is None and not torch.compiler.is_compiling()
    if not fused:
        logits = head(hidden)
        return lm_loss(logits, targets) if weights is None else masked_lm_loss(logits, targets, weights)
    flat = targets.reshape(-1)
    w = torch.ones(flat.shape, device=flat.device) if weights is None else weights.reshape(-1).float()
    total = _HeadLoss.apply(hidden.reshape(-1, hidden.shape[-1]), head.weight, flat, w)
    return total / (w.sum().clamp_min(1.0) if weights is not None else flat.numel())


class RMSNorm(nn.RMSNorm):
    """nn.RMSNorm, on tinygpt's CPU kernel where it trains in float32 (kernels.trains_rms_norm)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if kernels.trains_rms_norm(x, self.weight):
            return kernels.rms_norm(x, self.weight, self.eps)
        return super().forward(x)


def norm_layer(config: GPTConfig, dim: int) -> nn.Module:
    """The config's norm over the last `dim` features: LayerNorm (with a bias when config.bias) or RMSNorm."""
    if config.norm == "rmsnorm":
        return RMSNorm(dim, eps=config.layer_norm_eps)
    return nn.LayerNorm(dim, eps=config.layer_norm_eps, bias=config.bias)


def rope_frequencies(config: GPTConfig, device: torch.device | str = "cpu") -> torch.Tensor:
    """The rotary inverse frequencies theta^(-2i/D), i < D/2, float32, after the config's rope_scaling.

    llama3 (Llama 3.1's): wavelengths 2 pi / f longer than rope_original_context / low_freq_factor are
    divided by rope_factor, those shorter than rope_original_context / high_freq_factor are kept, and
    in between the frequency moves smoothly from one to the other. linear: every frequency / rope_factor.
    """
    D = config.head_dim
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, D, 2, dtype=torch.float, device=device) / D))
    if config.rope_scaling == "linear":
        return inv / config.rope_factor
    if config.rope_scaling == "llama3":
        context, factor = config.rope_original_context, config.rope_factor
        low, high = config.rope_low_freq_factor, config.rope_high_freq_factor
        wavelength = 2 * math.pi / inv
        scaled = torch.where(wavelength > context / low, inv / factor, inv)
        smooth = (context / wavelength - low) / (high - low)
        between = ~(wavelength < context / high) & ~(wavelength > context / low)
        return torch.where(between, (1 - smooth) * scaled / factor + smooth * scaled, scaled)
    return inv


def rotate(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Rotary positions on queries or keys x (B, H, T, D): each pair of dimensions (i, i + D/2) turned
    by its position's angle, cos and sin (T, D) or (B, 1, T, D) from GPT.rotary."""
    cos, sin = rope
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, config.kv_heads, config.head_dim
        self.dropout = config.dropout
        d, inner = config.n_embd, config.n_head * config.head_dim
        self.fused = config.arch == "gpt2"
        if self.fused:
            self.c_attn = nn.Linear(d, 3 * d, bias=config.bias)  # q, k, v in one matmul
            self.c_proj = nn.Linear(d, d, bias=config.bias)
        else:
            qkv_bias = config.bias or config.qkv_bias
            kv = config.kv_heads * config.head_dim
            self.q_proj = nn.Linear(d, inner, bias=qkv_bias)
            self.k_proj = nn.Linear(d, kv, bias=qkv_bias)
            self.v_proj = nn.Linear(d, kv, bias=qkv_bias)
            self.o_proj = nn.Linear(inner, d, bias=config.bias)
            if config.qk_norm:  # over each head's head_dim features (Qwen3)
                self.q_norm = norm_layer(config, config.head_dim)
                self.k_norm = norm_layer(config, config.head_dim)
        self.qk_norm = config.qk_norm
        self.resid_drop = nn.Dropout(config.dropout)

    def forward(
        self,
        x: torch.Tensor,
        kv_cache: KVCache | None = None,
        layer: int = 0,
        input_pos: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        explicit: bool = False,
        kv_len: int | None = None,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        B, T, C = x.shape
        dropout = self.dropout if self.training else 0.0
        plain = kv_cache is None and mask is None and not explicit and dropout == 0.0  # what the kernels compute
        if self.fused:
            qkv = self.c_attn(x)
            if plain and kernels.trains_attention(qkv, self.n_head):  # training on a CPU: tinygpt's kernel
                return self.resid_drop(self.c_proj(kernels.causal_attention(qkv, self.n_head))), None
            # (B, T, C) -> (B, n_head, T, head_dim): every head attends in parallel
            q, k, v = kernels.heads(qkv, self.n_head)
            out = self.c_proj
        else:
            q = self.q_proj(x).view(B, T, self.n_head, self.head_dim)
            k = self.k_proj(x).view(B, T, self.n_kv_head, self.head_dim)
            v = self.v_proj(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)  # (B, n_kv_head, T, D)
            q, k = self._turned(q, k, rope)  # (B, heads, T, D)
            out = self.o_proj
            if plain and kernels.trains_heads_attention(q, k, v):  # training on a CPU: tinygpt's kernel
                return self.resid_drop(out(kernels.heads_attention(q, k, v))), None
        if kv_cache is not None:
            k, v = kv_cache.update(layer, k, v, input_pos, kv_len)  # (B, n_kv_head, kv_len, head_dim)
        # a cache may hold another dtype than the activations (float32 on a CPU: see KVCache.for_model)
        dtype = q.dtype
        y, weights = attention(q.to(k.dtype), k, v, mask, explicit=explicit, dropout=dropout)
        y = y.transpose(1, 2).contiguous().view(B, T, self.n_head * self.head_dim).to(dtype)  # heads side by side
        return self.resid_drop(out(y)), weights

    def _turned(self, q: torch.Tensor, k: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None
                ) -> list[torch.Tensor]:
        """Queries (B, T, n_head, D) and keys after the QK-norm and the rotary positions, as (B, heads, T, D):
        on tinygpt's kernel in training on a CPU, one pass each (kernels.rotary)."""
        norms = (self.q_norm, self.k_norm) if self.qk_norm else (None, None)
        if rope is not None and all(kernels.trains_rotary(t, n) for t, n in zip((q, k), norms)):
            angles = kernels.rotary_angles(rope)
            return [kernels.rotary(t, n, angles).transpose(1, 2) for t, n in zip((q, k), norms)]
        if self.qk_norm:
            q, k = _normed(self.q_norm, q), _normed(self.k_norm, k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        if rope is not None:  # before the cache: it keeps keys with their positions applied
            q, k = rotate(q, rope), rotate(k, rope)
        return [q, k]


def _normed(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """norm(x) in its weight's dtype, back in x's: autocast's bfloat16 queries meet a float32 qk-norm,
    which torch's RMSNorm would compute alike, with a warning at every call."""
    dtype = norm.weight.dtype
    return norm(x) if x.dtype == dtype else norm(x.to(dtype)).to(x.dtype)


class GELU(nn.GELU):
    """nn.GELU, on tinygpt's CPU kernel where it trains in float32 or, in the tanh form, under bfloat16 autocast
    (kernels.trains_gelu)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if kernels.trains_gelu(x, self.approximate):
            return kernels.gelu(x, self.approximate)
        return super().forward(x)


class MLP(nn.Module):
    """GPT-2's c_fc, GELU, c_proj; in the llama layout up_proj, GELU or ReLU squared, down_proj, or, as
    SwiGLU, down_proj(silu(gate_proj x) * up_proj x)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        d, hidden = config.n_embd, config.mlp_width
        self.kind = config.mlp
        if config.arch == "gpt2":
            self.c_fc = nn.Linear(d, hidden, bias=config.bias)
        else:
            if self.kind == "swiglu":
                self.gate_proj = nn.Linear(d, hidden, bias=config.bias)
            self.up_proj = nn.Linear(d, hidden, bias=config.bias)
        if self.kind == "gelu":
            self.gelu = GELU(approximate="tanh" if config.activation == "gelu_tanh" else "none")
        if config.arch == "gpt2":
            self.c_proj = nn.Linear(hidden, d, bias=config.bias)
        else:
            self.down_proj = nn.Linear(hidden, d, bias=config.bias)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "c_fc"):
            return self.drop(self.c_proj(self.gelu(self.c_fc(x))))
        if self.kind == "swiglu":
            a, b = self.gate_proj(x), self.up_proj(x)
            h = kernels.swiglu(a, b) if kernels.trains_swiglu(a, b) else F.silu(a) * b
        elif self.kind == "relu2":
            h = F.relu(self.up_proj(x)).square()
        else:
            h = self.gelu(self.up_proj(x))
        return self.drop(self.down_proj(h))


def residual_projections(block: nn.Module) -> tuple[nn.Module, nn.Module]:
    """The two projections of a block that write into the residual stream: attention's output and the MLP's."""
    attn, mlp = block.attn, block.mlp
    return (attn.c_proj if attn.fused else attn.o_proj), (mlp.c_proj if hasattr(mlp, "c_fc") else mlp.down_proj)


class Block(nn.Module):
    """Pre-norm: x + attn(ln_1(x)), then x + mlp(ln_2(x))."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = norm_layer(config, config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = norm_layer(config, config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x, kv_cache=None, layer=0, input_pos=None, mask=None, explicit=False, kv_len=None, rope=None):
        a, weights = self.attn(self.ln_1(x), kv_cache, layer, input_pos, mask, explicit, kv_len, rope)
        x = x + a
        return x + self.mlp(self.ln_2(x)), weights


class GPT(nn.Module):
    """A decoder-only transformer: token (+ position) embeddings, blocks, final norm, LM head.

    `model(idx)` returns the logits (B, T, vocab_size); a reward model's (config.head "reward") returns
    its scores (B, T, 1), a text's score being its last token's. Generation passes a KVCache and the
    positions of the new tokens; the model itself keeps no decoding state.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        # rotary positions turn queries and keys inside attention instead (GPT.rotary)
        self.wpe = nn.Embedding(config.block_size, config.n_embd) if config.positions == "learned" else None
        self.drop = nn.Dropout(config.dropout)
        self.h = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = norm_layer(config, config.n_embd)
        if config.head == "reward":  # one score a position, Hugging Face's *ForSequenceClassification's `score`
            self.score = nn.Linear(config.n_embd, 1, bias=False)
        else:
            self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_weights:
            self.lm_head.weight = self.wte.weight
        # False drops the causal mask: every position sees the whole sequence, the future included.
        # Only for showing the lesson's pitfall (it trains to a near-zero loss and generates
        # nonsense); a plain attribute, never saved, since no real model should be built this way.
        self.causal = True
        # True recomputes each block's forward in backward instead of keeping its activations
        # (torch.utils.checkpoint), in training only: memory for compute. Set by fine-tuning's
        # grad_checkpoint; a plain attribute, never saved.
        self.grad_checkpoint = False
        self._frequencies: dict[torch.device, torch.Tensor] = {}  # rope_frequencies by device, made when first used
        if config.init == "gpt2":
            self._init_gpt2()
        if config.zero_init:  # every block starts as the identity: x + 0 + 0
            with torch.no_grad():
                for block in self.h:
                    for projection in residual_projections(block):
                        for tensor in (projection.weight, projection.bias):
                            if tensor is not None:
                                tensor.zero_()

    @torch.no_grad()
    def _init_gpt2(self) -> None:
        # GPT-2: N(0, 0.02) everywhere, zero biases, and the two projections that write into the
        # residual stream scaled by 1/sqrt(2 n_layer) so its variance does not grow with depth.
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for block in self.h:
            for projection in residual_projections(block):
                nn.init.normal_(projection.weight, mean=0.0, std=residual_std)

    def num_params(self, *, exclude_positions: bool = False) -> int:
        """Parameters in the model, a tied head counted once; optionally without the position embedding."""
        n = sum(p.numel() for p in self.parameters())  # parameters() yields a shared tensor once
        return n - self.wpe.weight.numel() if exclude_positions and self.wpe is not None else n

    def rotary(self, pos: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of the rotary angles at positions pos (T,) or (B, T), computed in float32 and
        given in `dtype`: (T, head_dim) or (B, 1, T, head_dim), each frequency twice (for dimensions i
        and i + head_dim / 2). Once per forward pass, for every layer."""
        inv = self._frequencies.get(pos.device)
        if inv is None:
            inv = self._frequencies[pos.device] = rope_frequencies(self.config, pos.device)
        angles = pos[..., None].float() * inv  # (..., T, head_dim / 2)
        angles = torch.cat((angles, angles), dim=-1)
        if angles.dim() == 3:
            angles = angles.unsqueeze(1)  # one row of positions per sequence: broadcast over the heads
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def _positions(
        self, idx: torch.Tensor, kv_cache: KVCache | None, input_pos: torch.Tensor | None,
        documents: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, int | None]:
        """Where each token of idx (B, T) sits and what it sees: its position, (T,) or (B, T), the attention
        mask (None: causal) and, with a cache, how many cached positions attention reads (kv_len).

        Args:
            idx, kv_cache, input_pos, documents: as forward takes them.
        """
        B, T = idx.shape
        if documents is not None:
            if kv_cache is not None:
                raise ValueError("documents apply to a forward pass without a kv_cache")
            pos, mask = _document_positions(documents)
            return pos, mask, None
        if kv_cache is None:
            # not causal (the lesson's pitfall): every query sees every key
            mask = None if self.causal else torch.ones(T, T, dtype=torch.bool, device=idx.device)
            return torch.arange(T, device=idx.device), mask, None
        if not self.causal:
            # cached keys were computed before the later tokens existed: a bidirectional model
            # must recompute every position at each step
            raise ValueError("a non-causal model cannot decode with a KV cache; use use_cache=False")
        if input_pos is None:
            raise ValueError("a kv_cache needs input_pos, the positions of the new tokens")
        pos = kv_cache.positions(input_pos, B)  # (T,) or (B, T)
        kv_len, mask = kv_cache.span(pos)  # the cached positions to read, and who sees what
        return pos, mask, kv_len

    def forward(
        self,
        idx: torch.Tensor,
        kv_cache: KVCache | None = None,
        input_pos: torch.Tensor | None = None,
        *,
        last_only: bool = False,
        return_attention: bool = False,
        documents: torch.Tensor | None = None,
        targets: torch.Tensor | None = None,
        loss_weights: torch.Tensor | None = None,
    ):
        """Logits for token ids `idx` (B, T).

        Args:
            idx: token ids (B, T), T <= block_size.
            kv_cache: a KVCache to read earlier keys/values from and write this call's into.
            input_pos: with a cache, the positions of idx's tokens: (T,) for every row or (B, T).
            last_only: compute the logits of the last position only (B, 1, vocab_size).
            return_attention: use the explicit attention path and also return each layer's
                weights, a list of (B, n_head, T, T_keys).
            documents: (B, T) ids of the documents packed into each row (conversations of a
                chat batch; no cache): a position attends only to earlier positions of its own
                document, and positions restart at 0 where a document begins, so each one is
                computed exactly as it would be alone.
            targets: (B, T) the next tokens: return the training loss (head_loss) instead of
                the logits, which a large vocabulary then never holds whole.
            loss_weights: (B, T) with targets: each target's weight in the loss (chat data's mask).

        Returns:
            logits (B, T, vocab_size), or (logits, weights) with return_attention; with targets
            the mean loss, a float32 scalar.
        """
        B, T = idx.shape
        if targets is not None and self.config.head != "lm":
            raise ValueError("a reward model has no language-model head: it scores a text, it has no next-token loss")
        if targets is not None and (last_only or return_attention or kv_cache is not None):
            raise ValueError("targets (the training loss) take a forward pass without a cache, last_only or attention")
        if T > self.config.block_size:
            raise ValueError(f"sequence of {T} tokens is longer than block_size={self.config.block_size}")
        pos, mask, kv_len = self._positions(idx, kv_cache, input_pos, documents)
        tok = self.wte(idx)  # (B, T, C)
        if self.config.scale_embeddings:
            # an embedding shared with the head has entries of about 1/sqrt(d): the factor lifts them to
            # unit size beside the position embedding (the original Transformer's choice; GPT-2's is not to)
            tok = tok * math.sqrt(self.config.n_embd)
        x = self.drop(tok + self.wpe(pos) if self.wpe is not None else tok)  # (B, T, C)
        if self.config.positions == "rope":  # in the dtype the projections give queries and keys in
            kind = x.device.type
            rope = self.rotary(pos, torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype)
        else:
            rope = None
        weights = []
        recompute = self.grad_checkpoint and self.training and torch.is_grad_enabled() and kv_cache is None
        for layer, block in enumerate(self.h):
            if recompute:  # the block's inputs are all autograd keeps; its dropout masks are redrawn alike
                # torch's activation recomputation (`import torch` loads it; tests/test_finetune's
                # gradient test runs this line)
                x, w = torch.utils.checkpoint.checkpoint(block, x, None, layer, None, mask, return_attention,
                                                         kv_len, rope, use_reentrant=False)
            else:
                x, w = block(x, kv_cache, layer, pos, mask, return_attention, kv_len, rope)
            weights.append(w)
        if last_only:
            x = x[:, -1:]
        if targets is not None:
            return head_loss(self.ln_f(x), self.lm_head, targets, loss_weights)
        head = self.score if self.config.head == "reward" else self.lm_head
        logits = head(self.ln_f(x))  # (B, T, vocab_size), or a reward model's scores (B, T, 1)
        return (logits, weights) if return_attention else logits


def _document_positions(documents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions (B, T) that restart where each document begins, and the attention mask (B, 1, T, T)
    that keeps each position causal within its own document."""
    B, T = documents.shape
    at = torch.arange(T, device=documents.device).expand(B, T)
    first = torch.ones_like(documents, dtype=torch.bool)
    first[:, 1:] = documents[:, 1:] != documents[:, :-1]
    pos = at - torch.where(first, at, 0).cummax(dim=1).values
    causal = torch.ones(T, T, dtype=torch.bool, device=documents.device).tril()
    mask = (documents[:, :, None] == documents[:, None, :]) & causal
    return pos, mask[:, None]


@torch.no_grad()
def grow_vocab(model: GPT, vocab_size: int) -> GPT:
    """Give a built model room for new tokens (a chat template's special tokens after GPT-2's 50,257),
    in place: wte and lm_head get rows for ids vocab_size_old .. vocab_size - 1, and config.vocab_size
    becomes vocab_size.

    Each new row starts as the mean of the old rows (of wte; of lm_head when it is not tied), a common
    practice: a new token starts as an average token instead of a random direction, so the loss on
    the old tokens does not jump when training on the new ones begins. A tied head stays tied.

    Args:
        model: the GPT.
        vocab_size: the new size, at least the current one (equal: nothing changes).

    Returns:
        The same model.

    Raises:
        ValueError: a smaller vocab_size.
    """
    old = model.config.vocab_size
    if vocab_size < old:
        raise ValueError(f"cannot shrink a vocabulary of {old} tokens to {vocab_size}")
    if vocab_size == old:
        return model
    tied = model.lm_head.weight is model.wte.weight

    def grown(weight: torch.Tensor) -> nn.Parameter:
        rows = weight.mean(dim=0, keepdim=True).expand(vocab_size - old, -1)
        return nn.Parameter(torch.cat([weight, rows]), requires_grad=weight.requires_grad)

    wte = nn.Embedding(vocab_size, model.config.n_embd, device=model.wte.weight.device, dtype=model.wte.weight.dtype)
    wte.weight = grown(model.wte.weight)
    model.wte = wte
    head = nn.Linear(model.config.n_embd, vocab_size, bias=False,
                     device=model.lm_head.weight.device, dtype=model.lm_head.weight.dtype)
    head.weight = model.wte.weight if tied else grown(model.lm_head.weight)
    model.lm_head = head
    model.config = dataclasses.replace(model.config, vocab_size=vocab_size)
    return model


SCORE_SEED, SCORE_STD = 0, 0.02  # a new score layer's draw: transformers' initializer_range for these families


def score_head(model: GPT) -> GPT:
    """Make a language model a reward model, in place: its head (lm_head, tied or not) gives way to a new
    bias-free score layer (n_embd x 1) drawn from N(0, 0.02) with a fixed seed, so that every model made from
    the same base starts from the same score, and config.head becomes "reward" (nothing tied).

    Args:
        model: a language model (config.head "lm").

    Returns:
        The same model.
    """
    weight = model.wte.weight
    del model.lm_head
    model.config = dataclasses.replace(model.config, head="reward", tie_weights=False)
    g = torch.Generator().manual_seed(SCORE_SEED)
    model.score = nn.Linear(model.config.n_embd, 1, bias=False, device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        model.score.weight.copy_(torch.randn(model.score.weight.shape, generator=g) * SCORE_STD)
    return model
