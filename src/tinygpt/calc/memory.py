"""Memory of a GPTConfig: the KV cache for generation, and what training with AdamW holds.

Training memory = weights + gradients + AdamW's two moments + activations. Weights, gradients and
moments live in `param_dtype` (float32: with --dtype bfloat16 tinygpt trains under autocast, so
the master weights stay float32), 16 bytes a parameter in all. A fine-tuning method that trains
part of the model (LoRA, frozen embeddings or blocks: calc.params.trainable_params) holds the
weights of all of it but gradients and moments only for what trains: 4 + 12 x trainable/total
bytes a parameter. Its activations are counted as for full training, which is more than autograd
keeps there: a frozen matrix needs no copy of its input for backward, and frozen blocks ahead of
everything that trains keep nothing (on a 4-layer, 128-wide model at 4 x 64 tokens, float32, the
count is 1.42x the saved bytes for LoRA on c_attn, 1.01x on every projection, 1.19x with 2 blocks
frozen, 1.81x with the embeddings too). LoRA dropout is the exception: its masks and dropped
inputs are not counted (0.71x with dropout on every projection).

Activations are what autograd keeps from the forward pass for the backward pass, counted tensor by
tensor from tinygpt's model for B sequences of T tokens (d = n_embd, a = n_head, V = vocab_size).
r is the byte size of the residual stream (param_dtype: autocast leaves the embeddings, residual
adds and LayerNorm inputs in float32), c of the compute dtype (the inputs and outputs of matmuls):

    per block   2 BTd r       the inputs of ln_1 and ln_2 (the residual stream)
                11 BTd c      ln_1 output 1, attention output 1, ln_2 output 1, GELU input 4,
                              GELU output 4
                3 BTd c       q, k, v
                4 BaT + 16 BT the fused attention's logsumexp, LayerNorm mean and rstd (float32)
    at the end  BTd (r + c)   ln_f input and output, plus 8 BT for its mean and rstd
                BTV c + 4 BTV the logits (the training loop holds them) and the float32
                              log-probabilities that cross-entropy keeps
                8 BT + 8 T    token ids and positions (int64)
    autocast    (matmul weights + d V) c: the compute-dtype weight copies autocast keeps
    dropout > 0 2 BTd c per block and BTd r once (embeddings): dropout masks (PyTorch's CPU
                              dropout stores them in the tensor's dtype, CUDA's as 1-byte bools,
                              so this overestimates there)
                with dropout, CPU attention leaves the fused kernel for the math path, which
                computes in float32 and keeps q, k, v (3 BTd x 4 bytes instead of 3 BTd c) and
                three a T x T matrices (weights, dropout mask, dropped weights: 3 BaT^2 x 4)
    bf16, CPU   autocast training takes tinygpt's matmul attention path while BaT^2 <= 2^25
                (PyTorch's bf16 flash backward is slow there): q, k, v (3 BTd c), the
                probabilities (BaT^2 c; with dropout also the mask and the dropped ones, 3 BaT^2 c)
                and the T^2 causal mask, instead of the fused kernel's logsumexp

This is Korthikanti et al.'s (2022) count (34 bytes per token and unit of width per layer at 2
bytes a value, plus 5 aT^2 for unfused attention) adapted to fused attention, the loss, autocast
and PyTorch's CPU kernels; the tests hold it to the bytes autograd really saves. It is what is held
when backward starts: the peak during backward adds transient gradients, the largest the size of
the logits.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..config import MATH_ATTENTION_MAX_SCORES, GPTConfig, LoraConfig
from .flops import tokens_in_view
from .params import count_params, trainable_params
from .units import check_int, dtype_bytes, dtype_name


def kv_cache_bytes(config: GPTConfig, tokens: int = 1, *, batch_size: int = 1, dtype: str = "float32") -> int:
    """Bytes of keys and values a KV cache holds for `tokens` positions of `batch_size` sequences.

    Per token: 2 (keys, values) x n_layer x n_embd values (n_head x head_dim = n_embd).

    Args:
        config: the architecture.
        tokens: cached positions per sequence (block_size for a full context).
        batch_size: sequences decoded together.
        dtype: the cache's dtype ("float32", "bfloat16", "float16").
    """
    check_int(tokens, "tokens")
    check_int(batch_size, "batch_size")
    return 2 * config.n_layer * config.n_embd * tokens * batch_size * dtype_bytes(dtype)


@dataclass(frozen=True)
class TrainingMemory:
    """Bytes one training process holds, by part.

    Args:
        batch_size, seq_len: the micro-batch the activations are counted for.
        dtype: compute dtype of the activations; param_dtype: of weights, gradients and moments.
        weights, gradients, optimizer: parameters, their gradients and AdamW's exp_avg and exp_avg_sq.
        activations: what autograd saves for backward (see the module docstring).
        autocast_weights: compute-dtype copies of the matmul weights (0 without autocast).
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

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.activations + self.autocast_weights

    def to_dict(self) -> dict[str, int | str]:
        return {**asdict(self), "total": self.total}


def activation_bytes(
    config: GPTConfig,
    batch_size: int = 1,
    seq_len: int | None = None,
    *,
    dtype: str = "float32",
    param_dtype: str = "float32",
) -> int:
    """Bytes of activations autograd keeps for the backward pass of one micro-batch.

    Args:
        config: the architecture (its dropout decides the masks and the attention path).
        batch_size: sequences in the micro-batch (B).
        seq_len: tokens per sequence (T, default block_size).
        dtype: the compute dtype; "bfloat16" with float32 parameters means autocast.
        param_dtype: the dtype of the residual stream and the parameters.
    """
    B, T = check_int(batch_size, "batch_size"), tokens_in_view(config, seq_len, "seq_len")
    d, a, V, L = config.n_embd, config.n_head, config.vocab_size, config.n_layer
    r, c = dtype_bytes(param_dtype), dtype_bytes(dtype)
    BTd = B * T * d
    per_block = 2 * BTd * r + 11 * BTd * c + 16 * B * T
    if config.dropout > 0:
        per_block += 2 * BTd * c  # the dropout masks after c_proj and the MLP
    if dtype == "bfloat16" and param_dtype == "float32" and B * a * T * T <= MATH_ATTENTION_MAX_SCORES:
        # bf16 training on a CPU takes tinygpt's matmul attention path (model._sdpa_is_slow):
        # q, k, v and the T x T probabilities (with dropout also its mask and output)
        per_block += 3 * BTd * c + (3 if config.dropout > 0 else 1) * B * a * T * T * c
    elif config.dropout > 0:
        # SDPA with dropout on a CPU runs its math path, in float32, with T x T matrices
        per_block += (3 * BTd + 3 * B * a * T * T) * 4
    else:
        per_block += 3 * BTd * c + 4 * B * a * T  # q, k, v and the fused kernel's logsumexp
    final = BTd * (r + c) + 8 * B * T + B * T * V * (c + 4) + 8 * (B * T + T)  # ln_f, logits, token ids
    if config.dropout > 0:
        final += BTd * r  # the embedding dropout's mask
    return L * per_block + final


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
    """
    dtype, param_dtype = dtype_name(dtype), dtype_name(param_dtype)
    counts = count_params(config)
    method = trainable_params(config, lora=lora, freeze_embeddings=freeze_embeddings, freeze_layers=freeze_layers)
    p = dtype_bytes(param_dtype)
    # LoRA's A and B are matmul weights too: autocast casts them as it casts the frozen ones
    head_and_matmul = counts.matmul_weights + config.n_embd * config.vocab_size + method.adapters
    return TrainingMemory(
        batch_size=check_int(batch_size, "batch_size"),
        seq_len=tokens_in_view(config, seq_len, "seq_len"),
        dtype=dtype,
        param_dtype=param_dtype,
        weights=method.total * p,
        gradients=method.trainable * p,
        optimizer=2 * method.trainable * p,
        activations=activation_bytes(config, batch_size, seq_len, dtype=dtype, param_dtype=param_dtype),
        # autocast casts each matmul weight (the head's too, tied or not) once per forward and
        # keeps the copy for backward
        autocast_weights=0 if dtype == param_dtype else head_and_matmul * dtype_bytes(dtype),
    )
