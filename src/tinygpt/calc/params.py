"""Parameter counts of a GPTConfig, piece by piece, equal to `sum(p.numel())` of the built model."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..config import GPTConfig


@dataclass(frozen=True)
class ParamCounts:
    """Parameters of one GPT by part. Each field is a count of scalars.

    Args:
        token_embedding: wte, vocab_size x n_embd.
        position_embedding: wpe, block_size x n_embd.
        attention: c_attn (d -> 3d) and c_proj (d -> d) of every layer, biases included.
        mlp: c_fc (d -> 4d) and c_proj (4d -> d) of every layer, biases included.
        layer_norm: ln_1 and ln_2 of every layer and ln_f (weight, and bias when config.bias).
        head: lm_head's own weight (n_embd x vocab_size); 0 when tied to wte, which then serves as both.
        biases: how many of the above are Linear or LayerNorm biases (0 without config.bias).
        matmul_weights: the block weights that multiply activations (attention and MLP matrices,
            biases excluded), the "dense" part the FLOP count is built on.
        tied: whether the head shares wte.
    """

    token_embedding: int
    position_embedding: int
    attention: int
    mlp: int
    layer_norm: int
    head: int
    biases: int
    matmul_weights: int
    tied: bool

    @property
    def total(self) -> int:
        """Every parameter, a tied matrix counted once (what `sum(p.numel() for p in model.parameters())` gives)."""
        return (
            self.token_embedding + self.position_embedding + self.attention + self.mlp + self.layer_norm + self.head
        )

    @property
    def embedding(self) -> int:
        """Token and position embeddings plus an untied head: the vocabulary- and position-sized matrices."""
        return self.token_embedding + self.position_embedding + self.head

    @property
    def non_embedding(self) -> int:
        """Kaplan et al.'s N: everything but the embedding matrices (and an untied unembedding)."""
        return self.total - self.embedding

    def to_dict(self) -> dict[str, int | bool]:
        return {**asdict(self), "total": self.total, "non_embedding": self.non_embedding}


def count_params(config: GPTConfig) -> ParamCounts:
    """Count the parameters of `GPT(config)` without building it.

    Args:
        config: the architecture.

    Returns:
        The counts by part; `.total` equals the built model's `sum(p.numel())`.
    """
    d, L, V = config.n_embd, config.n_layer, config.vocab_size
    b = 1 if config.bias else 0
    attn_weights, attn_biases = d * 3 * d + d * d, b * (3 * d + d)  # c_attn, c_proj
    mlp_weights, mlp_biases = d * 4 * d + 4 * d * d, b * (4 * d + d)  # c_fc, c_proj: the 4x rule
    n_norms = 2 * L + 1  # ln_1 and ln_2 per block, ln_f
    return ParamCounts(
        token_embedding=V * d,
        position_embedding=config.block_size * d,
        attention=L * (attn_weights + attn_biases),
        mlp=L * (mlp_weights + mlp_biases),
        layer_norm=n_norms * (d + b * d),
        head=0 if config.tie_weights else d * V,  # lm_head has no bias, as in GPT-2
        biases=L * (attn_biases + mlp_biases) + n_norms * b * d,
        matmul_weights=L * (attn_weights + mlp_weights),
        tied=config.tie_weights,
    )
