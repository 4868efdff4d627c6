"""FLOPs per token of a GPTConfig, for training (forward + backward) and for inference.

Convention (PaLM's, which Chinchilla's appendix also uses): count the matrix multiplies, 2 FLOPs
per multiply-add, and nothing else (embedding lookups, LayerNorms, GELU, softmax, residual adds
and bias adds are a few percent of the work and no accelerator's peak is quoted for them).

One token's forward pass, with d = n_embd, L = n_layer, V = vocab_size, T = keys attended:

    attention projections   2 * 4d^2 * L      c_attn (d -> 3d) and c_proj (d -> d)
    MLP                     2 * 8d^2 * L      c_fc (d -> 4d) and c_proj (4d -> d)
    attention itself        4 * T * d * L     q k^T and (weights) v, over all T keys
    LM head                 2 * d * V         tied or not: the head is a matmul either way

In the llama layout the projections are each block's own matrices (calc.params.projections: q_proj,
k_proj and v_proj with n_kv_head heads, o_proj; gate_proj, up_proj, down_proj intermediate_size wide),
2 FLOPs a weight, and attention itself is 4 T n_head head_dim a layer: grouped-query attention shares
keys and values between query heads, not the work of attending to them.

so forward = 2 * (matmul weights + d V) + 4 L T d, and the backward pass costs twice the forward
(a gradient for the input and one for the weights of every matmul): training = 6 * (matmul
weights + d V) + 12 L T d per token, PaLM's 6N + 12 L H Q T. The attention term counts the full
T x T score matrix with no discount for the causal mask: that is what PyTorch's math path computes
and what torch's FLOP counter reports; a fused causal kernel may skip up to half of it. With a KV
cache a new token attends to the cached keys, so its cost is the forward above with T = the
context it sees.

Chinchilla's C = 6 N D drops the attention term and counts N as all parameters; `six_n` gives it
for comparison.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..config.model import GPTConfig
from ..errors import ConfigError
from .params import count_params, projections
from .units import check_int


@dataclass(frozen=True)
class FlopCounts:
    """Forward-pass FLOPs of one token, by part (matmuls only, 2 per multiply-add).

    Args:
        seq_len: keys each query attends to (the training sequence length, or the cached context).
        attention_proj: c_attn and c_proj of every layer.
        attention: q k^T and weights @ v of every layer.
        mlp: c_fc and c_proj of every layer.
        head: the LM head.
    """

    seq_len: int
    attention_proj: int
    attention: int
    mlp: int
    head: int

    @property
    def forward(self) -> int:
        return self.attention_proj + self.attention + self.mlp + self.head

    @property
    def backward(self) -> int:
        """Two matmuls back for each one forward: the input's gradient and the weight's."""
        return 2 * self.forward

    @property
    def training(self) -> int:
        """Forward plus backward: 3x the forward."""
        return 3 * self.forward

    def to_dict(self) -> dict[str, int]:
        return {**asdict(self), "forward": self.forward, "backward": self.backward, "training": self.training}


def tokens_in_view(config: GPTConfig, seq_len: int | None, what: str = "seq_len") -> int:
    """`seq_len`, or block_size when None, checked to fit the model's context."""
    return check_int(config.block_size if seq_len is None else seq_len, what, 1, config.block_size)


def flops_per_token(config: GPTConfig, seq_len: int | None = None) -> FlopCounts:
    """Forward FLOPs of one token by part; `.training` and `.backward` follow from it.

    Args:
        config: the architecture.
        seq_len: the sequence length T the token attends over (default block_size).
    """
    T = tokens_in_view(config, seq_len, "seq_len")
    d, L = config.n_embd, config.n_layer
    shapes = projections(config)
    weights = {part: sum(i * o for name, (i, o) in shapes.items() if name.startswith(part)) for part in ("attn", "mlp")}
    return FlopCounts(
        seq_len=T,
        attention_proj=2 * L * weights["attn"],
        attention=4 * L * T * config.n_head * config.head_dim,  # every query head, whichever key/value head it reads
        mlp=2 * L * weights["mlp"],
        head=2 * d * config.vocab_size,
    )


def training_flops(config: GPTConfig, tokens: float, seq_len: int | None = None) -> float:
    """FLOPs of a training run that processes `tokens` tokens in sequences of `seq_len`.

    Args:
        config: the architecture.
        tokens: training tokens D (batch size x sequence length x steps).
        seq_len: the training sequence length (default block_size).
    """
    if not tokens > 0:
        raise ConfigError(f"tokens: must be more than zero, got {tokens!r}")
    return float(flops_per_token(config, seq_len).training) * tokens


def inference_flops_per_token(config: GPTConfig, context: int | None = None, *, kv_cache: bool = True) -> int:
    """Forward FLOPs to produce one new token when `context` tokens (itself included) are in view.

    Args:
        config: the architecture.
        context: tokens the new one attends to (default block_size, a full context).
        kv_cache: with a cache only the new token runs through the model; without one the whole
            context is recomputed, `context` times the work.
    """
    per_token = flops_per_token(config, tokens_in_view(config, context, "context")).forward
    return per_token if kv_cache else per_token * (config.block_size if context is None else context)


def six_n(config: GPTConfig) -> int:
    """Training FLOPs per token by the 6N rule of thumb (N = all parameters), as in C = 6 N D."""
    return 6 * count_params(config).total
