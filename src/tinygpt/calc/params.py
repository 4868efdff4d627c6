"""Parameter counts of a GPTConfig, piece by piece, equal to `sum(p.numel())` of the built model; and
the share a fine-tuning method trains (full, LoRA, frozen embeddings or blocks)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..config.lora import LoraConfig
from ..config.model import GPTConfig
from ..errors import ConfigError


@dataclass(frozen=True)
class ParamCounts:
    """Parameters of one GPT by part. Each field is a count of scalars.

    Args:
        token_embedding: wte, vocab_size x n_embd.
        position_embedding: wpe, block_size x n_embd (0 with rotary positions).
        attention: c_attn (d -> 3d) and c_proj (d -> d) of every layer, biases included; in the
            llama layout q_proj, k_proj, v_proj (n_kv_head heads) and o_proj, and the qk-norms.
        mlp: c_fc (d -> 4d) and c_proj (4d -> d) of every layer, biases included; in the llama
            layout gate_proj (SwiGLU), up_proj and down_proj, intermediate_size wide.
        layer_norm: ln_1 and ln_2 of every layer and ln_f (weight, and bias for a LayerNorm with config.bias).
        head: lm_head's own weight (n_embd x vocab_size); 0 when tied to wte, which then serves as both; a
            reward model's score layer (n_embd x 1).
        biases: how many of the above are Linear or LayerNorm biases (0 without config.bias and qkv_bias).
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


def projections(config: GPTConfig) -> dict[str, tuple[int, int]]:
    """Every matmul of one block by its name inside the block (what LoRA can adapt), in block order:
    (in_features, out_features). GPT-2's fused c_attn, c_proj, c_fc, c_proj; the llama layout's q_proj,
    k_proj, v_proj (n_kv_head heads each), o_proj, gate_proj (a SwiGLU MLP's), up_proj, down_proj."""
    d, hidden = config.n_embd, config.mlp_width
    if config.arch == "gpt2":
        return {"attn.c_attn": (d, 3 * d), "attn.c_proj": (d, d), "mlp.c_fc": (d, hidden), "mlp.c_proj": (hidden, d)}
    inner, kv = config.n_head * config.head_dim, config.kv_heads * config.head_dim
    shapes = {"attn.q_proj": (d, inner), "attn.k_proj": (d, kv), "attn.v_proj": (d, kv), "attn.o_proj": (inner, d)}
    if config.mlp == "swiglu":
        shapes["mlp.gate_proj"] = (d, hidden)
    return {**shapes, "mlp.up_proj": (d, hidden), "mlp.down_proj": (hidden, d)}


def has_bias(config: GPTConfig, projection: str) -> bool:
    """Whether a block's projection (a name `projections` gives) has a bias: config.bias, or the
    query, key and value projections with qkv_bias (Qwen2)."""
    return config.bias or (config.qkv_bias and projection in ("attn.q_proj", "attn.k_proj", "attn.v_proj"))


def count_params(config: GPTConfig) -> ParamCounts:
    """Count the parameters of `GPT(config)` without building it.

    Args:
        config: the architecture.

    Returns:
        The counts by part; `.total` equals the built model's `sum(p.numel())`.
    """
    d, L, V = config.n_embd, config.n_layer, config.vocab_size
    shapes = projections(config)
    weights = {part: sum(i * o for name, (i, o) in shapes.items() if name.startswith(part)) for part in ("attn", "mlp")}
    biases = {part: sum(o for name, (i, o) in shapes.items() if name.startswith(part) and has_bias(config, name))
              for part in ("attn", "mlp")}
    qk_norms = 2 * config.head_dim if config.qk_norm else 0  # RMSNorm weights over a head's features
    norm_bias = 1 if config.bias and config.norm == "layernorm" else 0  # RMSNorm has no bias
    n_norms = 2 * L + 1  # ln_1 and ln_2 per block, ln_f
    return ParamCounts(
        token_embedding=V * d,
        position_embedding=config.block_size * d if config.positions == "learned" else 0,
        attention=L * (weights["attn"] + biases["attn"] + qk_norms),
        mlp=L * (weights["mlp"] + biases["mlp"]),
        layer_norm=n_norms * (d + norm_bias * d),
        # lm_head has no bias, as in GPT-2; nor has a reward model's score
        head=d if config.head == "reward" else 0 if config.tie_weights else d * V,
        biases=L * (biases["attn"] + biases["mlp"]) + n_norms * norm_bias * d,
        matmul_weights=L * (weights["attn"] + weights["mlp"]),
        tied=config.tie_weights,
    )


@dataclass(frozen=True)
class TrainableParams:
    """What one training method updates, in parameters.

    Args:
        method: what trains, in words ("full", "LoRA r=8, alpha 8 on attn.c_attn", "full, embeddings
            and blocks 0-1 frozen").
        total: every parameter of the model being trained: the base's, plus the adapters for LoRA.
        trainable: the ones that get gradients and AdamW's two moments.
        adapters: LoRA's A and B matrices (0 for the other methods); counted in both figures above.
    """

    method: str
    total: int
    trainable: int
    adapters: int

    @property
    def frozen(self) -> int:
        return self.total - self.trainable

    def to_dict(self) -> dict[str, int | str]:
        return {**asdict(self), "frozen": self.frozen}


def lora_params(config: GPTConfig, lora: LoraConfig) -> int:
    """Parameters LoRA adds: rank x (in + out) for each adapted projection of every block."""
    shapes = projections(config)
    lora = lora.resolved_for(config)
    return config.n_layer * sum(lora.rank * (i + o) for i, o in (shapes[t] for t in lora.targets))


def trainable_params(
    config: GPTConfig,
    *,
    lora: LoraConfig | None = None,
    freeze_embeddings: bool = False,
    freeze_layers: int = 0,
) -> TrainableParams:
    """The parameters a method trains, equal to the built model's `sum(p.numel() for p in
    model.parameters() if p.requires_grad)` once tinygpt.lora.apply_lora or tinygpt.finetune.freeze
    has been applied.

    Args:
        config: the architecture.
        lora: LoRA's settings: only the adapters train. None: full training.
        freeze_embeddings: with full training, wte and wpe stay fixed (and a head tied to wte with them).
        freeze_layers: with full training, the first N blocks stay fixed.

    Raises:
        ConfigError: freezing combined with LoRA (which freezes every base weight already), or
            freeze_layers outside 0..n_layer.
    """
    counts = count_params(config)
    L = config.n_layer
    if not (isinstance(freeze_layers, int) and not isinstance(freeze_layers, bool) and 0 <= freeze_layers <= L):
        raise ConfigError(f"freeze layers: must be an integer in 0..{L} (the model has {L} blocks), "
                          f"got {freeze_layers!r}")
    if lora is not None:
        if freeze_embeddings or freeze_layers:
            raise ConfigError("freezing embeddings or layers goes with full training: LoRA already freezes every "
                              "base weight")
        lora = lora.resolved_for(config)
        adapters = lora_params(config, lora)
        method = f"LoRA r={lora.rank}, alpha {lora.alpha:g} on {', '.join(lora.targets)}"
        return TrainableParams(method, counts.total + adapters, adapters, adapters)
    per_block = (counts.attention + counts.mlp + counts.layer_norm - _norm_params(config)) // L
    frozen = freeze_layers * per_block
    if freeze_embeddings:
        frozen += counts.token_embedding + counts.position_embedding
    parts = ["embeddings"] if freeze_embeddings else []
    if freeze_layers:
        parts.append("block 0" if freeze_layers == 1 else f"blocks 0-{freeze_layers - 1}")
    method = "full" + (f", {' and '.join(parts)} frozen" if parts else "")
    return TrainableParams(method, counts.total, counts.total - frozen, 0)


def _norm_params(config: GPTConfig) -> int:
    """ln_f's parameters: the one norm outside the blocks."""
    return config.n_embd * (2 if config.bias and config.norm == "layernorm" else 1)
