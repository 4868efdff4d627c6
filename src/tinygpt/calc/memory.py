"""Memory of a GPTConfig: the KV cache for generation, and what training with AdamW holds.

Training memory = weights + gradients + AdamW's two moments + activations. Weights, gradients and
moments live in `param_dtype` (float32: with --dtype bfloat16 tinygpt trains under autocast, so
the master weights stay float32), 16 bytes a parameter in all. A fine-tuning method that trains
part of the model (LoRA, frozen embeddings or blocks: calc.params.trainable_params) holds the
weights of all of it but gradients and moments only for what trains: 4 + 12 x trainable/total
bytes a parameter. Its activations are what autograd keeps for that method: a matmul keeps its
input only when its weight trains (or LoRA adapts it), and where nothing upstream needs a gradient
(frozen embeddings and the frozen blocks after them, LoRA's LayerNorms before the first adapter)
nothing is kept at all; attention, LayerNorm and GELU keep theirs wherever a gradient passes.
Autocast keeps a matmul weight's compute-dtype copy where the matmul's input needs a gradient. The
tests hold each method's count to the bytes autograd saves (LoRA dropout's masks within a few %).

Activations are what autograd keeps from the forward pass for the backward pass, counted tensor by
tensor from tinygpt's model for B sequences of T tokens (d = n_embd, a = n_head, V = vocab_size).
r is the byte size of the residual stream (param_dtype: autocast leaves the embeddings, residual
adds and LayerNorm inputs in float32), c of the compute dtype (the inputs and outputs of matmuls):

    per block   2 BTd r       the inputs of ln_1 and ln_2 (the residual stream)
                11 BTd c      ln_1 output 1, attention output 1, ln_2 output 1, GELU input 4,
                              GELU output 4
                3 BTd c       q, k, v
                4 BaT + 16 BT the fused attention's logsumexp, LayerNorm mean and rstd (float32)
    at the end  BTd r         ln_f's input, plus 8 BT for its mean and rstd
                BTd r + 4 dV  the fused head and loss (model.head_loss) keep no logits, only the
                              gradients their forward pass made: the hidden states' and the head's
                8 BT + 8 T    token ids and positions (int64)
    autocast    (matmul weights) c: the compute-dtype weight copies autocast keeps
    dropout > 0 2 BTd c per block and BTd r once (embeddings): dropout masks (PyTorch's CPU
                              dropout stores them in the tensor's dtype, CUDA's as 1-byte bools,
                              so this overestimates there)
                with dropout, CPU attention leaves the fused kernel for the math path, which
                computes in float32 and keeps q, k, v (3 BTd x 4 bytes instead of 3 BTd c) and
                three a T x T matrices (weights, dropout mask, dropped weights: 3 BaT^2 x 4)
    recompute   with grad_checkpoint (torch's activation recomputation, block by block) each block
                that takes part in backward keeps only its input (BTd r), and backward rebuilds
                one block's saved tensors at a time: the sum of those inputs plus the largest block
    bf16, CPU   autocast training takes tinygpt's matmul attention path while BaT^2 <= 2^25
                (PyTorch's bf16 flash backward is slow there): q, k, v (3 BTd c), the
                probabilities (BaT^2 c; with dropout also the mask and the dropped ones, 3 BaT^2 c)
                and the T^2 causal mask, instead of the fused kernel's logsumexp

The llama layout (config.arch "llama") is counted the same way, tensor by tensor: its q_proj, k_proj
and v_proj read one input and keep it once (float32; autocast casts it for each), attention keeps
queries of n_head heads and keys and values of n_kv_head (the fused kernel reads them grouped; the
matmul and dropout paths repeat them for every query head), a SwiGLU MLP keeps gate, silu(gate), up
and their product (4 BT intermediate_size c), torch's RMSNorm its input, rstd and normalized output
(its weight's gradient needs the last), a qk-norm the same per head in float32, and rotary positions
one cos and one sin (2 T head_dim c) for every layer. That is PyTorch's operations' count (a GPU, a CPU
without tinygpt's kernels); tinygpt's CPU training kernels keep less of the llama layout (a norm its input
and rstd, SwiGLU its two inputs, the rotary positions no copy of their input without a qk-norm), so on
them it is an upper bound.

This is Korthikanti et al.'s (2022) count (34 bytes per token and unit of width per layer at 2
bytes a value, plus 5 aT^2 for unfused attention) adapted to fused attention, the loss, autocast
and PyTorch's CPU kernels; the tests hold it to the bytes autograd really saves. It is what is held
when backward starts. TrainingMemory.peak adds the loss's workspace (a chunk's logits, and under
autocast the compute-dtype copies of the head and its input), held at the end of the forward pass
before any weight's gradient exists: a method that trains little peaks there. The tests hold a run's measured peak RSS within 15% of it for full training, LoRA
and frozen blocks.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..config.lora import LoraConfig
from ..config.model import LOSS_CHUNK, MATH_ATTENTION_MAX_SCORES, GPTConfig
from .flops import tokens_in_view
from .params import projections, trainable_params
from .units import check_int, dtype_bytes, dtype_name


def kv_cache_bytes(config: GPTConfig, tokens: int = 1, *, batch_size: int = 1, dtype: str = "float32") -> int:
    """Bytes of keys and values a KV cache holds for `tokens` positions of `batch_size` sequences.

    Per token: 2 (keys, values) x n_layer x n_kv_head x head_dim values (n_embd for GPT-2: n_head x
    head_dim, every head with keys of its own; grouped-query attention keeps n_kv_head of them).

    Args:
        config: the architecture.
        tokens: cached positions per sequence (block_size for a full context).
        batch_size: sequences decoded together.
        dtype: the cache's dtype ("float32", "bfloat16", "float16").
    """
    check_int(tokens, "tokens")
    check_int(batch_size, "batch_size")
    return 2 * config.n_layer * config.kv_heads * config.head_dim * tokens * batch_size * dtype_bytes(dtype)


@dataclass(frozen=True)
class TrainingMemory:
    """Bytes one training process holds, by part.

    Args:
        batch_size, seq_len: the micro-batch the activations are counted for.
        dtype: compute dtype of the activations; param_dtype: of weights, gradients and moments.
        weights, gradients, optimizer: parameters, their gradients and AdamW's exp_avg and exp_avg_sq.
        activations: what autograd saves for backward (see the module docstring).
        autocast_weights: compute-dtype copies of the matmul weights (0 without autocast).
        loss_workspace: what the fused head and loss hold while they run, at the end of the forward
            pass with everything saved still held: a chunk's logits, and under autocast the
            compute-dtype copies of the head and its input.
        grad_checkpoint: whether the activations are counted for block-by-block recomputation.
        recomputed: with grad_checkpoint, the bytes of the block backward rebuilds at a time (the
            largest; part of activations, but not yet there while the loss runs).
    """

    batch_size: int
    seq_len: int
    dtype: str
    param_dtype: str
    weights: int
    gradients: int
    optimizer: int
    activations: int
    autocast_weights: int
    loss_workspace: int = 0
    grad_checkpoint: bool = False
    recomputed: int = 0

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.activations + self.autocast_weights

    @property
    def peak(self) -> int:
        """The high-water mark of a training step: as the loss runs, everything saved is held with
        its workspace, and the parameters' gradients are not made yet (they grow as backward frees
        the activations). What a run's peak RSS is measured against."""
        return max(self.total, self.total - self.gradients - self.recomputed + self.loss_workspace)

    def to_dict(self) -> dict[str, int | str]:
        return {**asdict(self), "total": self.total, "peak": self.peak}


@dataclass(frozen=True)
class _Method:
    """What trains, as autograd sees it: per run of alike blocks, whether their LayerNorms train and
    which matmuls need their input kept (their weight trains, or LoRA adapts them), and how many
    blocks the run has (a count, not a tuple per block: any n_layer costs the same); the embeddings,
    ln_f, the head."""

    # ((LayerNorms train, matmuls whose weight trains or is adapted), blocks in the run)
    blocks: tuple[tuple[tuple[bool, frozenset[str]], int], ...]
    adapted: frozenset[str]  # LoRA's targets (empty without LoRA)
    lora: LoraConfig | None
    embeddings: bool
    ln_f: bool
    head: bool

    @classmethod
    def of(cls, config: GPTConfig, lora: LoraConfig | None, freeze_embeddings: bool, freeze_layers: int) -> _Method:
        L, every = config.n_layer, frozenset(projections(config))
        if lora is not None:
            lora = lora.resolved_for(config)
            targets = frozenset(lora.targets)
            return cls((((False, targets), L),), targets, lora, False, False, False)
        frozen = min(freeze_layers, L)
        blocks = tuple(run for run in (((False, frozenset()), frozen), ((True, every), L - frozen)) if run[1])
        # a tied head is wte: it freezes with the embeddings, an untied one always trains
        return cls(blocks, frozenset(), None, not freeze_embeddings, True,
                   not (freeze_embeddings and config.tie_weights))


def activation_bytes(
    config: GPTConfig,
    batch_size: int = 1,
    seq_len: int | None = None,
    *,
    dtype: str = "float32",
    param_dtype: str = "float32",
    lora: LoraConfig | None = None,
    freeze_embeddings: bool = False,
    freeze_layers: int = 0,
) -> int:
    """Bytes of activations autograd keeps for the backward pass of one micro-batch.

    Args:
        config: the architecture (its dropout decides the masks and the attention path).
        batch_size: sequences in the micro-batch (B).
        seq_len: tokens per sequence (T, default block_size).
        dtype: the compute dtype; "bfloat16" with float32 parameters means autocast.
        param_dtype: the dtype of the residual stream and the parameters.
        lora, freeze_embeddings, freeze_layers: a fine-tuning method (see the module docstring:
            what nothing upstream needs a gradient for is not kept). Default: full training.
    """
    return _saved(config, batch_size, seq_len, dtype, param_dtype, lora, freeze_embeddings, freeze_layers)[0]


def _saved(
    config: GPTConfig, batch_size: int, seq_len: int | None, dtype: str, param_dtype: str, lora: LoraConfig | None,
    freeze_embeddings: bool, freeze_layers: int, grad_checkpoint: bool = False,
) -> tuple[int, int, int]:
    """activation_bytes, the matmul weight elements whose compute-dtype copy autocast keeps, and (with
    grad_checkpoint) the bytes of the largest block, which backward rebuilds."""
    B, T = check_int(batch_size, "batch_size"), tokens_in_view(config, seq_len, "seq_len")
    method = _Method.of(config, lora, freeze_embeddings, freeze_layers)
    d, V = config.n_embd, config.vocab_size
    r = dtype_bytes(param_dtype)
    BTd = B * T * d
    dropout = config.dropout > 0
    total = 0
    flows = method.embeddings  # whether the residual stream needs a gradient here
    if method.embeddings:  # the token ids (and learned positions), the embedding dropout's mask
        total += 8 * B * T + (8 * T if config.positions == "learned" else 0) + (BTd * r if dropout else 0)
    casts = 0
    rotates = False  # whether some block's queries or keys need a gradient: then cos and sin are kept
    blocks = []  # (a block's saved bytes, how many blocks save that much)
    for (ln, kept), n in method.blocks:
        # a run's first block may be the first one whose input needs a gradient; from its second
        # on, every block of the run is alike (`flows` only ever turns on)
        first, flows, first_casts, first_rotates = _block_bytes(config, B, T, dtype, param_dtype, flows, ln, kept,
                                                                method)
        rest, flows, rest_casts, rest_rotate = _block_bytes(config, B, T, dtype, param_dtype, flows, ln, kept, method)
        blocks += [(first, 1), (rest, n - 1)]
        casts += first_casts + rest_casts * (n - 1)
        rotates = rotates or first_rotates or (n > 1 and rest_rotate)
    if rotates and config.positions == "rope":
        total += 2 * T * config.head_dim * dtype_bytes(dtype)  # the rotary cos and sin every layer reads
    recomputed = max((size for size, n in blocks if n), default=0) if grad_checkpoint else 0
    if grad_checkpoint:  # each block's input where it saves anything, and one block rebuilt at a time
        total += sum(BTd * r * n for size, n in blocks if size) + recomputed
    else:
        total += sum(size * n for size, n in blocks)
    total += _norm_bytes(config, B * T, d, r, flows, method.ln_f)  # ln_f
    flows = flows or method.ln_f
    # the fused head and loss keep no logits, only the gradients their forward pass made: the hidden
    # states' (where a gradient flows on) and the head weight's (where it trains), in float32
    total += (BTd * r if flows else 0) + (4 * d * V if method.head else 0)
    return total, casts, recomputed


def _norm_bytes(config: GPTConfig, rows: int, width: int, r: int, grad_in: bool, trains: bool) -> int:
    """What a norm over `rows` rows of `width` keeps: a LayerNorm its input (r bytes) and each row's mean
    and rstd (float32) when anything needs its gradient; torch's RMSNorm (composed of elementwise
    operations) its input and each row's rstd when its input needs a gradient, and its normalized
    output when its weight trains. A bfloat16 input (a qk-norm's under autocast) is kept as float32."""
    if config.norm == "layernorm":
        return rows * width * r + 8 * rows if grad_in or trains else 0
    return (rows * (width + 1) * r if grad_in else 0) + (rows * width * r if trains else 0)


def _block_bytes(
    config: GPTConfig, B: int, T: int, dtype: str, param_dtype: str, flows: bool, ln: bool, kept: frozenset[str],
    method: _Method,
) -> tuple[int, bool, int, bool]:
    """One block's saved bytes, whether the residual stream after it needs a gradient, the weight
    elements whose compute-dtype copy autocast's matmuls keep (those whose input needs a gradient),
    and whether its queries or keys need a gradient (their rotary positions keep cos and sin).
    `flows`: the block's input needs a gradient; `ln`: its norms train; `kept`: the matmuls
    that keep their input (their weight trains, or LoRA adapts them)."""
    block = _Block(config, B, T, dtype, param_dtype, ln, kept, method)
    total = block.norm(flows)  # ln_1
    attention, flows, rotates = block.attention(flows or ln)
    total += attention + block.norm(flows)  # ln_2
    mlp, flows = block.mlp(flows or ln)
    return total + mlp, flows, block.casts, rotates


class _Block:
    """What one block keeps, counted tensor by tensor in the order its forward pass makes them. Its
    matmuls add to `casts` the weight elements whose compute-dtype copy autocast keeps."""

    def __init__(self, config: GPTConfig, B: int, T: int, dtype: str, param_dtype: str, ln: bool,
                 kept: frozenset[str], method: _Method) -> None:
        self.config, self.B, self.T, self.BT = config, B, T, B * T
        self.dtype, self.param_dtype = dtype, param_dtype
        self.r, self.c = dtype_bytes(param_dtype), dtype_bytes(dtype)
        self.ln, self.kept, self.method = ln, kept, method
        self.shapes = projections(config)
        self.dropout = config.dropout > 0
        self.casts = 0
        self.shared: set[str] = set()  # inputs kept once for every matmul that reads them (q, k, v; gate, up)

    def norm(self, flows: bool) -> int:
        """ln_1 or ln_2 over the residual stream (`flows`: their input needs a gradient)."""
        return _norm_bytes(self.config, self.BT, self.config.n_embd, self.r, flows, self.ln)

    def matmul(self, name: str, grad_in: bool, reads: str | None = None) -> int:
        """What a matmul keeps: its input for its weight's gradient (LoRA: A's input and B's, rank
        wide), and its weight's copy when its input needs a gradient. Matmuls that read the same
        input (`reads`) keep it once, unless autocast casts it for each, or LoRA dropout drops it for each."""
        method, BT, c = self.method, self.BT, self.c
        rank = method.lora.rank if name in method.adapted else 0
        fan_in, fan_out = self.shapes[name]
        self.casts += (fan_in * fan_out + rank * fan_in if grad_in else 0) + rank * fan_out
        if name not in self.kept:
            return 0
        dropped = rank and method.lora.dropout > 0
        if reads is not None and not (self.dtype != self.param_dtype or dropped):
            if reads in self.shared:
                return BT * rank * c
            self.shared.add(reads)
        # with LoRA dropout A's input is the dropped copy, kept with its mask
        return BT * rank * c + (2 if dropped else 1) * BT * fan_in * c

    def attention(self, flows: bool) -> tuple[int, bool, bool]:
        """From ln_1's output (`flows`: it needs a gradient) to the attention's projection and its dropout:
        the bytes kept, whether the residual stream after it needs a gradient, and whether the queries
        or keys do."""
        cfg, kept, ln = self.config, self.kept, self.ln
        H, D = cfg.n_head, cfg.head_dim
        total = 0
        if cfg.arch == "gpt2":
            total += self.matmul("attn.c_attn", flows)
            grads = dict.fromkeys("qkv", flows or "attn.c_attn" in kept)
            out = "attn.c_proj"
        else:
            for name in "qkv":
                total += self.matmul(f"attn.{name}_proj", flows, "ln_1")
            grads = {name: flows or f"attn.{name}_proj" in kept for name in "qkv"}
            if cfg.qk_norm:
                total += (_norm_bytes(cfg, self.BT * H, D, self.r, grads["q"], ln)
                          + _norm_bytes(cfg, self.BT * cfg.kv_heads, D, self.r, grads["k"], ln))
                grads["q"], grads["k"] = grads["q"] or ln, grads["k"] or ln
            out = "attn.o_proj"
        flows = grads["q"] or grads["k"] or grads["v"]  # attention's output
        matmul_path = (self.dtype == "bfloat16" and self.param_dtype == "float32"
                       and self.B * H * self.T * self.T <= MATH_ATTENTION_MAX_SCORES)
        if flows:
            total += _attention_bytes(cfg, self.B, self.T, self.dtype, matmul_path)
        if out not in kept and flows and not self.dropout and not matmul_path:
            total += self.BT * H * D * self.c  # the fused kernel keeps its output, which is the projection's input
        total += self.matmul(out, flows)
        flows = flows or out in kept
        return total + self.dropout_mask(flows), flows, grads["q"] or grads["k"]

    def mlp(self, flows: bool) -> tuple[int, bool]:
        """From ln_2's output (`flows`: it needs a gradient) to the MLP's down projection and its dropout:
        the bytes kept and whether the residual stream after it needs a gradient."""
        cfg, kept = self.config, self.kept
        hidden = self.BT * cfg.mlp_width * self.c
        if cfg.mlp == "swiglu":
            total = self.matmul("mlp.gate_proj", flows, "ln_2") + self.matmul("mlp.up_proj", flows, "ln_2")
            gate, up = flows or "mlp.gate_proj" in kept, flows or "mlp.up_proj" in kept
            # silu keeps its input; silu(g) * u keeps u where silu(g) needs a gradient, silu(g) where u does
            total += 2 * hidden * gate + hidden * up
            flows, down = gate or up, "mlp.down_proj"
        else:
            up, down = ("mlp.c_fc", "mlp.c_proj") if cfg.arch == "gpt2" else ("mlp.up_proj", "mlp.down_proj")
            total = self.matmul(up, flows)
            flows = flows or up in kept
            if flows:
                total += hidden  # GELU's input
        total += self.matmul(down, flows)
        flows = flows or down in kept
        return total + self.dropout_mask(flows), flows

    def dropout_mask(self, flows: bool) -> int:
        """The mask of the dropout after a projection back into the residual stream (the attention's, the
        MLP's), kept where a gradient flows through it."""
        return self.BT * self.config.n_embd * self.c if self.dropout and flows else 0


def _attention_bytes(config: GPTConfig, B: int, T: int, dtype: str, matmul_path: bool) -> int:
    """What attention keeps for backward when q, k and v need a gradient: queries of n_head heads, keys
    and values of n_kv_head heads (the fused kernel reads them grouped; the matmul path repeats them)."""
    H, D = config.n_head, config.head_dim
    c = dtype_bytes(dtype)
    q, kv = B * T * H * D, B * T * config.kv_heads * D
    if matmul_path:
        # bf16 training on a CPU takes tinygpt's matmul attention path (model._sdpa_is_slow):
        # q, k, v and the T x T probabilities (with dropout also its mask and output)
        return 3 * q * c + (3 if config.dropout > 0 else 1) * B * H * T * T * c
    if config.dropout > 0:
        # SDPA with dropout on a CPU runs its math path, in float32, with T x T matrices (and keys and
        # values repeated for every query head)
        return (3 * q + 3 * B * H * T * T) * 4
    return (q + 2 * kv) * c + 4 * B * H * T  # q, k, v and the fused kernel's logsumexp


def training_memory(
    config: GPTConfig,
    batch_size: int = 1,
    seq_len: int | None = None,
    *,
    dtype: str = "float32",
    param_dtype: str = "float32",
    lora: LoraConfig | None = None,
    freeze_embeddings: bool = False,
    freeze_layers: int = 0,
    grad_checkpoint: bool = False,
) -> TrainingMemory:
    """Bytes to train `config` with AdamW on micro-batches of `batch_size` x `seq_len` tokens.

    Args:
        config: the architecture.
        batch_size: sequences per micro-batch.
        seq_len: tokens per sequence (default block_size).
        dtype: compute dtype ("bfloat16" = autocast over `param_dtype` weights).
        param_dtype: dtype of weights, gradients and AdamW's moments.
        lora, freeze_embeddings, freeze_layers: a fine-tuning method (see calc.params.trainable_params):
            gradients and moments for what it trains only. Default: full training.
        grad_checkpoint: each block's activations recomputed in backward (`--grad-checkpoint`).
    """
    dtype, param_dtype = dtype_name(dtype), dtype_name(param_dtype)
    method = trainable_params(config, lora=lora, freeze_embeddings=freeze_embeddings, freeze_layers=freeze_layers)
    p = dtype_bytes(param_dtype)
    # LoRA's A and B are matmul weights too: autocast casts them as it casts the frozen ones
    activations, casts, recomputed = _saved(config, batch_size, seq_len, dtype, param_dtype, lora,
                                            freeze_embeddings, freeze_layers, grad_checkpoint)
    return TrainingMemory(
        batch_size=check_int(batch_size, "batch_size"),
        seq_len=tokens_in_view(config, seq_len, "seq_len"),
        dtype=dtype,
        param_dtype=param_dtype,
        weights=method.total * p,
        gradients=method.trainable * p,
        optimizer=2 * method.trainable * p,
        activations=activations,
        # autocast casts each matmul weight (the head's too, tied or not) once per forward and keeps
        # the copy for backward where the matmul's input needs a gradient
        autocast_weights=0 if dtype == param_dtype else casts * dtype_bytes(dtype),
        loss_workspace=_loss_workspace(config, batch_size * tokens_in_view(config, seq_len, "seq_len"), dtype,
                                       param_dtype, _Method.of(config, lora, freeze_embeddings, freeze_layers).head),
        grad_checkpoint=bool(grad_checkpoint),
        recomputed=recomputed,
    )


def _loss_workspace(config: GPTConfig, rows: int, dtype: str, param_dtype: str, head_trains: bool) -> int:
    """Bytes model.head_loss holds at once beyond what it keeps: one chunk's float32 logits, which
    tinygpt's CPU kernel turns into their gradient in place, and under autocast their compute-dtype
    product before it and copy after it, the compute-dtype copies of the head and its input, and a
    chunk's product for the head's gradient. (Without the kernels, on a GPU or a CPU without AVX2,
    PyTorch's log-sum-exp holds a temporary as large as the chunk's logits more: up to 16 MB.)"""
    d, V = config.n_embd, config.vocab_size
    c = dtype_bytes(dtype)
    chunk = min(rows, max(1, LOSS_CHUNK // V)) * V
    workspace = 4 * chunk
    if dtype != param_dtype:
        workspace += c * chunk + c * d * V + c * rows * d + (c * d * V if head_trains else 0)
    return workspace
