"""The model's config: GPTConfig, the module layouts and the choices inside them, the families as rows of
settings (PRESETS), and with_arch, which moves a config's fields to another layout."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError
from .fields import check, check_bools, finite, from_mapping, is_int

# The module layouts tinygpt.model builds: GPT-2's (fused c_attn, c_fc; learned positions, LayerNorm, GELU)
# and the Llama family's (q_proj, k_proj, v_proj, o_proj; gate_proj, up_proj, down_proj: Hugging Face's
# names), in which each choice below is free. A family (SmolLM2, Qwen2.5, Qwen3, TinyLlama, Llama 3.2)
# is a row of these settings, never a class of its own.
ARCHS = ("gpt2", "llama")
POSITIONS = ("learned", "rope")
NORMS = ("layernorm", "rmsnorm")
# the MLP's kind: "gelu" (up, GELU, down: GPT-2's), "swiglu" (down(silu(gate x) * up x): Llama's) or
# "relu2" (up, ReLU squared, down: Primer's, which the modded-nanoGPT speedrun and nanochat train with)
MLPS = ("gelu", "swiglu", "relu2")
ACTIVATIONS = ("gelu", "gelu_tanh")  # the GELU of a "gelu" MLP
MLP_ACTIVATIONS = {"swiglu": "silu", "relu2": "relu2"}  # the one activation each other MLP has
INITS = ("gpt2", "torch")
# what the last hidden state becomes: "lm", the next token's logits (lm_head), or "reward", one score
# (a reward model: HF's *ForSequenceClassification with one label, its `score` layer)
HEADS = ("lm", "reward")
# how rotary positions stretch past the context they were trained at: "none", "linear" (every frequency
# divided by rope_factor) or "llama3" (Llama 3.1's: low frequencies divided, high ones kept, a smooth
# step between); Hugging Face's other kinds (yarn, dynamic, longrope) are not implemented
ROPE_SCALINGS = ("none", "linear", "llama3")
# the defaults an architecture gives the fields left unset (None)
ARCH_DEFAULTS: dict[str, dict[str, Any]] = {
    "gpt2": dict(bias=True, positions="learned", norm="layernorm", mlp="gelu"),
    "llama": dict(bias=False, positions="rope", norm="rmsnorm", mlp="swiglu"),
}
# GPT-2's layout has room for none of the family's choices: each must keep this value there
GPT2_ONLY = dict(positions="learned", norm="layernorm", mlp="gelu", intermediate_size=None, n_kv_head=None,
                 head_size=None, qk_norm=False, qkv_bias=False)
# B x heads x T_q x T_k attention scores up to which bf16 training on a CPU takes the model's matmul
# attention path (tinygpt.model._sdpa_is_slow) rather than SDPA; calc.memory counts what that path
# keeps for backward. Here, in the pure layer, so that both read the one number.
MATH_ATTENTION_MAX_SCORES = 2**25
# logits per chunk of the model's fused head and loss (model.head_loss): 16 MB of float32 at a time
LOSS_CHUNK = 2**22


@dataclass
class GPTConfig:
    """The architecture of a GPT. Defaults are GPT-2 small's.

    Args:
        vocab_size: number of token ids.
        block_size: longest context the model sees (the size of a learned position embedding; with
            rotary positions, the longest context it was trained for).
        n_layer: number of transformer blocks.
        n_head: attention heads per block (query heads); must divide n_embd unless head_size is given.
        n_embd: model width d.
        dropout: dropout rate on embeddings, attention weights and residual branches.
        bias: biases in the Linear layers and LayerNorms (RMSNorm has none). Default: the arch's
            (True for gpt2, False for llama).
        tie_weights: share the token embedding with the LM head.
        activation: the GELU of a "gelu" MLP: "gelu" (exact, as the lesson) or "gelu_tanh" (GPT-2's
            approximation, the default); a "swiglu" MLP's is "silu", a "relu2" MLP's "relu2".
        init: "gpt2" (normal 0.02, residual projections scaled by 1/sqrt(2 n_layer), zero biases)
            or "torch" (PyTorch's module defaults, as the lesson).
        zero_init: the two projections of each block that write into the residual stream (attention's
            output and the MLP's down projection) start at zero, whichever init the rest has, so that
            every block starts as the identity (the modded-nanoGPT speedrun's choice). Off by default;
            it changes nothing a trained model computes, and a config.json without it loads with it off.
        layer_norm_eps: epsilon of every norm (LayerNorm or RMSNorm; the qk-norms' too).
        scale_embeddings: multiply the token embeddings by sqrt(n_embd) in the forward pass, as the
            original Transformer and some later models (T5's, Gemma's) do; GPT-2 does not, so a
            model that sets it cannot be exported as GPT-2 (Hugging Face or GGUF). Off by default;
            a config.json written before it existed loads with it off.
        arch: the module layout (ARCHS): "gpt2" (GPT-2's fused c_attn, exactly as it always was: the
            family's choices below keep GPT-2's values there) or "llama" (separate q_proj, k_proj,
            v_proj, o_proj and gate_proj, up_proj, down_proj, as Hugging Face names them, where every
            choice below is free). Defaults: rope, rmsnorm, swiglu, no biases.
        positions: "learned" (a position embedding, wpe) or "rope" (rotary positions on queries and keys).
        norm: "layernorm" or "rmsnorm" (torch's nn.RMSNorm).
        mlp: "gelu" (up, GELU, down), "swiglu" (down(silu(gate x) * up x)) or "relu2" (up, relu(.)^2,
            down; no Hugging Face or llama.cpp architecture has it, so such a model does not export).
        intermediate_size: the MLP's hidden width. Default: 4 n_embd for gelu, and for swiglu 8/3
            n_embd rounded up to a multiple of 64 (the same number of weights as 4 n_embd in two matrices).
        n_kv_head: key/value heads (grouped-query attention: each serves n_head / n_kv_head query
            heads; 1 is multi-query attention). Default n_head.
        head_size: width of one head. Default n_embd // n_head (Qwen3 sets it wider).
        qk_norm: an RMSNorm over each head's queries and keys before the rotary positions (Qwen3).
        qkv_bias: biases on the query, key and value projections even where bias is off (Qwen2).
        rope_theta: the rotary base (10,000 in RoFormer; 1e6 in Qwen2.5, 5e5 in Llama 3).
        rope_scaling: ROPE_SCALINGS: "none", "linear" or "llama3", with rope_factor and, for llama3,
            rope_low_freq_factor, rope_high_freq_factor and rope_original_context (the context the
            model was first trained at), as Hugging Face's rope_scaling holds them.
        head: HEADS: "lm" (the language model's head, lm_head: logits over the vocabulary) or "reward"
            (a reward model's: one score a position from a bias-free `score` layer, read at a text's last
            token; no language-model head, so nothing to tie: tie_weights must be off).
    """

    vocab_size: int = 50257
    block_size: int = 1024
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool | None = None
    tie_weights: bool = True
    activation: str | None = None
    init: str = "gpt2"
    layer_norm_eps: float = 1e-5
    scale_embeddings: bool = False
    arch: str = "gpt2"
    positions: str | None = None
    norm: str | None = None
    mlp: str | None = None
    intermediate_size: int | None = None
    n_kv_head: int | None = None
    head_size: int | None = None
    qk_norm: bool = False
    qkv_bias: bool = False
    rope_theta: float = 10000.0
    rope_scaling: str = "none"
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_context: int = 8192
    zero_init: bool = False
    head: str = "lm"

    def __post_init__(self) -> None:
        check(self.arch in ARCHS, "arch", f"must be one of {', '.join(ARCHS)}, got {self.arch!r}")
        for name, value in ARCH_DEFAULTS[self.arch].items():
            if getattr(self, name) is None:
                setattr(self, name, value)
        if self.activation is None:
            self.activation = MLP_ACTIVATIONS.get(self.mlp, "gelu_tanh")
        finite(self, ("dropout", "layer_norm_eps", "rope_theta", "rope_factor", "rope_low_freq_factor",
                      "rope_high_freq_factor"))
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "rope_original_context",
                     "intermediate_size", "n_kv_head", "head_size"):
            value = getattr(self, name)
            if value is None:
                continue
            check(is_int(value), name, f"must be an integer, got {value!r}")
            check(value >= 1, name, f"must be >= 1, got {value}")
        for name, allowed in (("positions", POSITIONS), ("norm", NORMS), ("mlp", MLPS),
                              ("rope_scaling", ROPE_SCALINGS), ("init", INITS), ("head", HEADS)):
            value = getattr(self, name)
            check(value in allowed, name, f"must be one of {', '.join(allowed)}, got {value!r}")
        check_bools(self, ("bias", "tie_weights", "scale_embeddings", "qk_norm", "qkv_bias", "zero_init"))
        if self.head_size is None:
            check(
                self.n_embd % self.n_head == 0,
                "n_embd",
                f"{self.n_embd} is not divisible by n_head={self.n_head}",
            )
        check(self.n_head % self.kv_heads == 0, "n_kv_head",
              f"{self.kv_heads} key/value heads cannot serve n_head={self.n_head} query heads evenly")
        check(
            isinstance(self.dropout, (int, float)) and 0.0 <= self.dropout < 1.0,
            "dropout",
            f"must be in [0, 1), got {self.dropout!r}",
        )
        check(self.head == "lm" or not self.tie_weights, "tie_weights",
              "a reward head has no language-model head to tie to the embedding: set it off")
        if self.arch == "gpt2":
            for name, value in GPT2_ONLY.items():
                check(getattr(self, name) == value or (name == "n_kv_head" and self.kv_heads == self.n_head), name,
                      f"{getattr(self, name)!r} needs arch llama (GPT-2's layout has {value!r} only)")
        if self.mlp in MLP_ACTIVATIONS:
            want = MLP_ACTIVATIONS[self.mlp]
            check(self.activation == want, "activation", f"a {self.mlp} MLP's is {want}, got {self.activation!r}")
        else:
            check(self.activation in ACTIVATIONS, "activation",
                  f"must be one of {ACTIVATIONS}, got {self.activation!r}")
        check(
            isinstance(self.layer_norm_eps, (int, float)) and self.layer_norm_eps > 0,
            "layer_norm_eps",
            f"must be > 0, got {self.layer_norm_eps!r}",
        )
        check(self.rope_theta > 1, "rope_theta", f"must be > 1, got {self.rope_theta!r}")
        check(self.rope_factor > 0, "rope_factor", f"must be > 0, got {self.rope_factor!r}")
        if self.rope_scaling == "llama3":
            check(0 < self.rope_low_freq_factor < self.rope_high_freq_factor, "rope_low_freq_factor",
                  f"must be > 0 and below rope_high_freq_factor={self.rope_high_freq_factor!r}, "
                  f"got {self.rope_low_freq_factor!r}")
        check(self.positions == "rope" or (self.rope_scaling == "none" and self.rope_factor == 1.0), "rope_scaling",
              "applies to rotary positions (positions rope)")
        if self.head_size is not None:
            check(self.head_size % 2 == 0 or self.positions != "rope", "head_size",
                  f"rotary positions turn pairs of a head's dimensions: must be even, got {self.head_size}")
        else:
            check(self.head_dim % 2 == 0 or self.positions != "rope", "n_head",
                  f"rotary positions need an even head width, and n_embd / n_head = {self.head_dim}")

    @property
    def head_dim(self) -> int:
        """The width of one attention head."""
        return self.head_size if self.head_size is not None else self.n_embd // self.n_head

    @property
    def kv_heads(self) -> int:
        """Key/value heads (n_kv_head, or n_head)."""
        return self.n_kv_head if self.n_kv_head is not None else self.n_head

    @property
    def mlp_width(self) -> int:
        """The MLP's hidden width: intermediate_size, or the MLP kind's default."""
        if self.intermediate_size is not None:
            return self.intermediate_size
        if self.mlp == "swiglu":
            return -(-8 * self.n_embd // (3 * 64)) * 64
        return 4 * self.n_embd

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GPTConfig:
        return from_mapping(cls, data)

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> GPTConfig:
        """A named preset (see PRESETS), with any field overridden."""
        if name not in PRESETS:
            raise ConfigError(f"preset: unknown preset {name!r}; choose from {', '.join(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})


def with_arch(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """A config's fields (`base`, as to_dict gives them) with `overrides` over them, where an override
    of arch also brings that arch's defaults for the fields base held at its own arch's (so that
    `--preset stretch --arch llama` is the stretch model's size in the llama layout, not one with
    GPT-2's biases, learned positions and GELU), and another MLP its own activation.

    Args:
        base: the fields of the config to start from.
        overrides: the fields to set (a command line's flags, a sweep's choices).
    """
    arch = overrides.get("arch")
    old = base.get("arch", "gpt2")
    kept = base
    if arch is not None and arch != old and old in ARCH_DEFAULTS:
        defaults = ARCH_DEFAULTS[old]
        kept = {k: v for k, v in base.items() if k not in defaults or v != defaults[k]}
    merged = {**kept, **overrides}
    new_arch = ARCH_DEFAULTS.get(merged.get("arch", "gpt2"), {})
    if merged.get("mlp", new_arch.get("mlp")) != base.get("mlp", ARCH_DEFAULTS.get(old, {}).get("mlp")):
        if "activation" not in overrides:
            merged.pop("activation", None)  # the old MLP's, which another has no use for
    return merged


_GPT2 = dict(vocab_size=50257, block_size=1024, bias=True, tie_weights=True, activation="gelu_tanh", init="gpt2")

# Character-level presets carry a typical char vocabulary; training replaces it with the data's.
PRESETS: dict[str, dict[str, Any]] = {
    # The lesson's TinyGPT: with these settings the same seed gives the same parameters.
    "lesson": dict(
        vocab_size=50, block_size=8, n_layer=2, n_head=4, n_embd=64,
        bias=True, tie_weights=False, activation="gelu", init="torch",
    ),
    # The lesson's homework model, set up for real training.
    "stretch": dict(vocab_size=65, block_size=256, n_layer=6, n_head=8, n_embd=256),
    # The usual character-level model (nanoGPT's shakespeare_char sizes).
    "baby": dict(vocab_size=65, block_size=256, n_layer=6, n_head=6, n_embd=384, dropout=0.2),
    "gpt2": dict(_GPT2, n_layer=12, n_head=12, n_embd=768),
    "gpt2-medium": dict(_GPT2, n_layer=24, n_head=16, n_embd=1024),
    "gpt2-large": dict(_GPT2, n_layer=36, n_head=20, n_embd=1280),
    "gpt2-xl": dict(_GPT2, n_layer=48, n_head=25, n_embd=1600),
    # The Llama family as published (each model's config.json on the Hugging Face Hub): the same
    # architecture, settings apart. `tinygpt params --preset NAME` gives the published count.
    "smollm2-135m": dict(arch="llama", vocab_size=49152, block_size=8192, n_layer=30, n_head=9, n_kv_head=3,
                         n_embd=576, intermediate_size=1536, rope_theta=100000.0),
    "smollm2-360m": dict(arch="llama", vocab_size=49152, block_size=8192, n_layer=32, n_head=15, n_kv_head=5,
                         n_embd=960, intermediate_size=2560, rope_theta=100000.0),
    "qwen2.5-0.5b": dict(arch="llama", vocab_size=151936, block_size=32768, n_layer=24, n_head=14, n_kv_head=2,
                         n_embd=896, intermediate_size=4864, rope_theta=1e6, layer_norm_eps=1e-6, qkv_bias=True),
    "qwen3-0.6b": dict(arch="llama", vocab_size=151936, block_size=40960, n_layer=28, n_head=16, n_kv_head=8,
                       n_embd=1024, head_size=128, intermediate_size=3072, rope_theta=1e6, layer_norm_eps=1e-6,
                       qk_norm=True),
    "tinyllama-1.1b": dict(arch="llama", vocab_size=32000, block_size=2048, n_layer=22, n_head=32, n_kv_head=4,
                           n_embd=2048, intermediate_size=5632, tie_weights=False),
    "llama-3.2-1b": dict(arch="llama", vocab_size=128256, block_size=131072, n_layer=16, n_head=32, n_kv_head=8,
                         n_embd=2048, intermediate_size=8192, rope_theta=500000.0, rope_scaling="llama3",
                         rope_factor=32.0, rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
                         rope_original_context=8192),
}
