"""Configuration dataclasses, presets and their JSON round-trip. Pure Python: no torch here."""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from dataclasses import dataclass
from typing import Any

from .errors import ConfigError

# The module layouts model.py builds: GPT-2's (fused c_attn, c_fc; learned positions, LayerNorm, GELU)
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


def _check(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"{field}: {message}")


MAX_THREADS = 1024  # torch.set_num_threads takes a C int; more threads than this is a typo
MAX_SEED = 2**63 - 1  # torch seeds are 64-bit; this leaves room for the seed + rank / + step offsets training adds
FLOAT32_MAX = 3.4028234663852886e38  # the largest finite float32 (torch.finfo(torch.float32).max)


def _finite(obj: Any, names: tuple[str, ...]) -> None:
    """Each field must be a real, finite number (or None): NaN slips past every `>=` check, and inf
    past most, and either would reach the optimizer (a file's `lr = nan` or `weight_decay = inf`)."""
    for name in names:
        value = getattr(obj, name)
        if value is None:
            continue
        _check(isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value), name,
               f"must be a finite number, got {value!r}")


def _coerce(name: str, value: Any, annotation: Any) -> Any:
    """Check one JSON/TOML value against a dataclass field's type; ints are accepted for floats."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(annotation)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _coerce(name, value, option)
            except ConfigError as e:
                errors.append(e)
        raise errors[0]
    if annotation is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif annotation is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif annotation in (bool, str):
        if isinstance(value, annotation):
            return value
    elif origin is tuple:
        if isinstance(value, (list, tuple)):
            (item,) = {a for a in typing.get_args(annotation) if a is not Ellipsis}
            return tuple(_coerce(name, v, item) for v in value)
    else:  # pragma: no cover - a field type this helper does not know is a programming error
        raise TypeError(f"unsupported field type {annotation!r} for {name}")
    expected = getattr(annotation, "__name__", str(annotation))
    raise ConfigError(f"{name}: expected {expected}, got {type(value).__name__} {value!r}")


def from_mapping(cls, data: dict[str, Any], *, where: str = ""):
    """Build dataclass `cls` from a plain mapping, refusing unknown keys and wrong types."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where or cls.__name__}: expected a JSON object, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - fields)
    if unknown:
        prefix = f"{where}: " if where else ""
        raise ConfigError(f"{prefix}unknown key(s) for {cls.__name__}: {', '.join(unknown)}")
    kwargs = {k: _coerce(k, v, hints[k]) for k, v in data.items()}
    return cls(**kwargs)


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

    def __post_init__(self) -> None:
        _check(self.arch in ARCHS, "arch", f"must be one of {', '.join(ARCHS)}, got {self.arch!r}")
        for name, value in ARCH_DEFAULTS[self.arch].items():
            if getattr(self, name) is None:
                setattr(self, name, value)
        if self.activation is None:
            self.activation = MLP_ACTIVATIONS.get(self.mlp, "gelu_tanh")
        _finite(self, ("dropout", "layer_norm_eps", "rope_theta", "rope_factor", "rope_low_freq_factor",
                       "rope_high_freq_factor"))
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "rope_original_context",
                     "intermediate_size", "n_kv_head", "head_size"):
            value = getattr(self, name)
            if value is None:
                continue
            _check(isinstance(value, int) and not isinstance(value, bool), name, f"must be an integer, got {value!r}")
            _check(value >= 1, name, f"must be >= 1, got {value}")
        for name, allowed in (("positions", POSITIONS), ("norm", NORMS), ("mlp", MLPS),
                              ("rope_scaling", ROPE_SCALINGS), ("init", INITS)):
            value = getattr(self, name)
            _check(value in allowed, name, f"must be one of {', '.join(allowed)}, got {value!r}")
        for name in ("bias", "tie_weights", "scale_embeddings", "qk_norm", "qkv_bias", "zero_init"):
            _check(isinstance(getattr(self, name), bool), name, f"must be true or false, got {getattr(self, name)!r}")
        if self.head_size is None:
            _check(
                self.n_embd % self.n_head == 0,
                "n_embd",
                f"{self.n_embd} is not divisible by n_head={self.n_head}",
            )
        _check(self.n_head % self.kv_heads == 0, "n_kv_head",
               f"{self.kv_heads} key/value heads cannot serve n_head={self.n_head} query heads evenly")
        _check(
            isinstance(self.dropout, (int, float)) and 0.0 <= self.dropout < 1.0,
            "dropout",
            f"must be in [0, 1), got {self.dropout!r}",
        )
        if self.arch == "gpt2":
            for name, value in GPT2_ONLY.items():
                _check(getattr(self, name) == value or (name == "n_kv_head" and self.kv_heads == self.n_head), name,
                       f"{getattr(self, name)!r} needs arch llama (GPT-2's layout has {value!r} only)")
        if self.mlp in MLP_ACTIVATIONS:
            want = MLP_ACTIVATIONS[self.mlp]
            _check(self.activation == want, "activation", f"a {self.mlp} MLP's is {want}, got {self.activation!r}")
        else:
            _check(self.activation in ACTIVATIONS, "activation",
                   f"must be one of {ACTIVATIONS}, got {self.activation!r}")
        _check(
            isinstance(self.layer_norm_eps, (int, float)) and self.layer_norm_eps > 0,
            "layer_norm_eps",
            f"must be > 0, got {self.layer_norm_eps!r}",
        )
        _check(self.rope_theta > 1, "rope_theta", f"must be > 1, got {self.rope_theta!r}")
        _check(self.rope_factor > 0, "rope_factor", f"must be > 0, got {self.rope_factor!r}")
        if self.rope_scaling == "llama3":
            _check(0 < self.rope_low_freq_factor < self.rope_high_freq_factor, "rope_low_freq_factor",
                   f"must be > 0 and below rope_high_freq_factor={self.rope_high_freq_factor!r}, "
                   f"got {self.rope_low_freq_factor!r}")
        _check(self.positions == "rope" or (self.rope_scaling == "none" and self.rope_factor == 1.0), "rope_scaling",
               "applies to rotary positions (positions rope)")
        if self.head_size is not None:
            _check(self.head_size % 2 == 0 or self.positions != "rope", "head_size",
                   f"rotary positions turn pairs of a head's dimensions: must be even, got {self.head_size}")
        else:
            _check(self.head_dim % 2 == 0 or self.positions != "rope", "n_head",
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
    GPT-2's biases, learned positions and GELU), and another MLP its own activation."""
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


@dataclass
class SampleConfig:
    """How the next token is chosen from the logits.

    Args:
        temperature: logits are divided by it; 0 means greedy (and so does anything below 1e-5,
            where dividing would overflow the logits to inf).
        top_k: keep only the k most likely tokens.
        top_p: keep the smallest set of tokens whose probability reaches p (always the top one).
        repetition_penalty: alpha > 0; for tokens already in the sequence, positive logits are
            divided by alpha and negative ones multiplied by it. 1.0 turns it off.
        greedy: take the argmax (after the repetition penalty).
    """

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    repetition_penalty: float = 1.0
    greedy: bool = False

    def __post_init__(self) -> None:
        # not a bool, which Python counts as an int: top_p=True passed as 1
        t = self.temperature
        _check(isinstance(t, (int, float)) and not isinstance(t, bool) and not math.isnan(t) and 0 <= t < math.inf,
               "temperature", f"must be a finite number >= 0, got {t!r}")
        if self.top_k is not None:
            _check(isinstance(self.top_k, int) and not isinstance(self.top_k, bool) and self.top_k >= 1,
                   "top_k", f"must be an integer >= 1, got {self.top_k!r}")
        if self.top_p is not None:
            _check(isinstance(self.top_p, (int, float)) and not isinstance(self.top_p, bool) and 0 < self.top_p <= 1,
                   "top_p", f"must be a number in (0, 1], got {self.top_p!r}")
        a = self.repetition_penalty
        _check(isinstance(a, (int, float)) and not isinstance(a, bool) and not math.isnan(a) and 0 < a < math.inf,
               "repetition_penalty", f"must be a finite number > 0, got {a!r}")
        _check(isinstance(self.greedy, bool), "greedy", f"must be true or false, got {self.greedy!r}")

    @property
    def is_greedy(self) -> bool:
        return self.greedy or self.temperature < 1e-5


# The projections of a block that LoRA can adapt, by their names inside the block, in block order:
# GPT-2's, and the llama layout's (Hugging Face's names, as PEFT's target_modules give them), with
# the short names that stand for them, and the groups attn and mlp (a block's attention projections,
# its MLP's: which ones is the model's layout's to say). A bare "c_proj" is both attention's and the
# MLP's in GPT-2, so it is refused rather than guessed.
LORA_TARGETS = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
LLAMA_LORA_TARGETS = ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
                      "mlp.down_proj")
LORA_GROUPS = ("attn", "mlp")
LORA_TARGET_NAMES: dict[str, str] = {
    **{name: name for name in (*LORA_TARGETS, *LLAMA_LORA_TARGETS, *LORA_GROUPS)},
    **{name.split(".")[1]: name for name in ("attn.c_attn", "mlp.c_fc", *LLAMA_LORA_TARGETS)},
}
# the targets when none are given, PEFT's defaults: GPT-2's c_attn (its queries, keys and values in one
# matrix), and the llama layout's q_proj and v_proj (the LoRA paper found adapting queries and values as
# good as adapting more, at a fixed budget)
LORA_DEFAULT_TARGETS = {"gpt2": ("attn.c_attn",), "llama": ("attn.q_proj", "attn.v_proj")}


@dataclass
class LoraConfig:
    """Low-rank adapters (LoRA): each adapted projection computes W x + b + (alpha / rank) B A dropout(x),
    with W and b frozen, A (rank, in) and B (out, rank) trained.

    Args:
        rank: r, the adapters' inner size. Each adapter adds rank x (in + out) parameters.
        alpha: the adapters' output is scaled by alpha / rank, so that a new rank needs no new
            learning rate (the LoRA paper's reason). The defaults (8, 8) are PEFT's.
        targets: the projections to adapt in every block: GPT-2's c_attn, attn.c_proj, c_fc, mlp.c_proj;
            the llama layout's q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj; or the
            groups attn and mlp (every projection of the attention or the MLP); a comma-separated
            string is accepted. Kept as full names (attn.c_attn, attn.q_proj, ...) and groups;
            resolved_for(config) gives the model's own, in block order. None (the default): PEFT's
            for the model's layout (LORA_DEFAULT_TARGETS: c_attn for GPT-2, the fewest parameters,
            rank x 4 n_embd a block; q_proj and v_proj for the llama layout).
        dropout: dropout on the adapters' input during training (the frozen path sees x unchanged).
    """

    rank: int = 8
    alpha: float = 8.0
    targets: tuple[str, ...] | None = None
    dropout: float = 0.0

    def __post_init__(self) -> None:
        _check(isinstance(self.rank, int) and not isinstance(self.rank, bool) and self.rank >= 1, "lora rank",
               f"must be an integer >= 1, got {self.rank!r}")
        _check(isinstance(self.alpha, (int, float)) and not isinstance(self.alpha, bool)
               and 0 < self.alpha < math.inf, "lora alpha", f"must be a finite number > 0, got {self.alpha!r}")
        self.alpha = float(self.alpha)
        _check(self.scaling <= FLOAT32_MAX, "lora alpha", f"alpha / rank scales the adapters' output in float32, "
               f"where {self.scaling:g} is infinite; got alpha {self.alpha:g} at rank {self.rank}")
        _check(isinstance(self.dropout, (int, float)) and not isinstance(self.dropout, bool)
               and 0.0 <= self.dropout < 1.0, "lora dropout", f"must be in [0, 1), got {self.dropout!r}")
        self.targets = None if self.targets is None else lora_targets(self.targets)

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def resolved_for(self, config: GPTConfig) -> LoraConfig:
        """These settings with the targets a model of `config` has, as full names in block order: the
        groups expanded, the default chosen for its layout.

        Raises:
            ConfigError: a target the model's layout does not have (c_attn on the llama layout, q_proj on GPT-2).
        """
        layout = LORA_TARGETS if config.arch == "gpt2" else tuple(
            t for t in LLAMA_LORA_TARGETS if t != "mlp.gate_proj" or config.mlp == "swiglu")
        chosen = set(self.targets if self.targets is not None else LORA_DEFAULT_TARGETS[config.arch])
        for name in chosen:
            _check(name in layout or name in LORA_GROUPS, "lora targets",
                   f"{name} is not a projection of this model's blocks ({config.arch} layout: {', '.join(layout)}, "
                   "or the groups attn and mlp)")
        targets = tuple(t for t in layout if t in chosen or t.split(".")[0] in chosen)
        return dataclasses.replace(self, targets=targets)

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "targets": None if self.targets is None else list(self.targets)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LoraConfig:
        return from_mapping(cls, data)


def lora_targets(targets: str | tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """Full projection names (attn.c_attn, attn.q_proj, ...) and groups (attn, mlp), in a fixed order,
    for LoRA targets as a user gives them (LoraConfig.resolved_for picks a model's own).

    Args:
        targets: names and groups (see LoraConfig), as a sequence or one comma-separated string.

    Raises:
        ConfigError: no target, an unknown name, or the ambiguous "c_proj".
    """
    names = targets.split(",") if isinstance(targets, str) else targets
    _check(isinstance(names, (tuple, list)) and all(isinstance(n, str) for n in names), "lora targets",
           f"expected names such as c_attn,mlp, got {targets!r}")
    chosen: set[str] = set()
    for name in (n.strip() for n in names if n.strip()):
        if name == "c_proj":
            raise ConfigError("lora targets: c_proj is ambiguous: say attn.c_proj or mlp.c_proj")
        _check(name in LORA_TARGET_NAMES, "lora targets",
               f"unknown target {name!r}; choose from {', '.join(LORA_TARGET_NAMES)}")
        chosen.add(LORA_TARGET_NAMES[name])
    _check(bool(chosen), "lora targets", "name at least one projection (c_attn, attn.c_proj, c_fc, mlp.c_proj; "
           "q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj; or attn, mlp)")
    return tuple(t for t in (*LORA_TARGETS, *LLAMA_LORA_TARGETS, *LORA_GROUPS) if t in chosen)


DEFAULT_LR = 1e-3  # TrainConfig.lr when it is left to choose and nothing sized the model
# "adamw" trains every parameter with AdamW; "muon" trains the 2-D weight matrices inside the blocks
# with torch.optim.Muon (momentum orthogonalized by a Newton-Schulz iteration) and the rest (the
# embeddings, the head, norms, biases) with AdamW
OPTIMIZERS = ("adamw", "muon")
# TrainConfig.muon_lr's default, measured (AMD EPYC Zen 5, 4 x 128 models on Shakespeare's
# characters, 300 steps of 16 x 64 tokens, val loss; AdamW at 1e-3: 2.087 llama, 2.487 gpt2):
# llama block 1.946 / 1.919 / 1.950 / 2.064 at 0.01 / 0.02 / 0.04 / 0.08; gpt2 block 2.189 /
# 2.011 / 1.984 at 0.01 / 0.02 / 0.04. Muon's weight decay 0.1 against 0: 1.917 against 1.919.
MUON_LR = 0.02
MUON_MOMENTUM = 0.95  # Keller Jordan's and torch.optim.Muon's
# what follows the warmup: cosine decay to min_lr over the run, the rate held, lr x sqrt(warmup / step),
# or warmup-stable-decay (the rate held, then a linear decay to min_lr over the run's last steps)
LR_SCHEDULES = ("cosine", "constant", "inverse-sqrt", "wsd")
DATA_ORDERS = ("random", "sequential")  # TrainConfig.data_order
LENGTHLESS_SCHEDULES = ("constant", "inverse-sqrt")  # those that need no known length
DECAY_FRACTION = 0.2  # WSD's decay: the last fifth of the steps (Hagele et al. 2024 found 20% matches cosine)

# The recipe a new `tinygpt train` run gets where its flags leave the choice open, the winner of
# `tinygpt bench --recipes` (the README's table): the modern block, the llama layout (rotary positions,
# RMSNorm, SwiGLU, no biases) with QK-norm, zero-initialised output projections and an untied head,
# trained by Muon with warmup-stable-decay. GPTConfig() and TrainConfig() keep GPT-2's block and AdamW
# with cosine (the lesson's objects, and what `--arch gpt2 --optimizer adamw --lr-schedule cosine`
# trains); the model half applies only where no --arch and no --preset is given.
RECIPE_MODEL: dict[str, Any] = dict(arch="llama", qk_norm=True, zero_init=True, tie_weights=False)
RECIPE_TRAIN: dict[str, Any] = dict(optimizer="muon", lr_schedule="wsd")


@dataclass
class TrainConfig:
    """How a model is trained. Every field is a `tinygpt train` flag and a config-file key.

    Args:
        batch_size: sequences per micro-step, per process.
        grad_accum: micro-steps per optimizer step.
        lr: peak learning rate, reached after `warmup` steps. None (the default): DEFAULT_LR, or
            for a model sized for a time budget the rate for its width (ModelChoice.lr), or on
            resume the run's own, or fine-tuning's (FinetuneConfig.default_lr); train() fills it in
            before the first step.
        min_lr: where the cosine or WSD decay ends (default lr / 10).
        warmup: steps of linear warmup, at most a tenth of the run's steps (of max_iters as the run began,
            or of a time budget's estimate) so that a short run reaches its peak rate and its decay.
        lr_schedule: what follows the warmup: "cosine" (decay to min_lr over the run), "constant"
            (lr held, nanoGPT's fine-tuning recipe), "inverse-sqrt" (lr x sqrt(warmup / (step + 1)),
            which needs no known length) or "wsd" (warmup-stable-decay: lr held, then a linear decay
            to min_lr over the last decay_fraction of the steps; the run keeps a checkpoint of the
            step before the decay, from which it can be continued with another length).
        decay_fraction: with wsd, the share of the run's steps its decay takes, in (0, 1].
        max_iters: optimizer steps; the cosine decay spans them. Without it and without max_time, 2000.
        max_time: wall-clock budget in seconds; training stops at whichever limit comes first.
        weight_decay: AdamW weight decay, applied to matrices and embeddings only (with muon: the
            embeddings and an untied head).
        beta1, beta2: AdamW betas.
        optimizer: OPTIMIZERS: "adamw", or "muon" for the 2-D weight matrices inside the blocks
            (torch.optim.Muon) beside AdamW at `lr` for the embeddings, the head, norms and biases.
        muon_lr: muon's peak rate for the block matrices (default MUON_LR), under the same
            schedule as lr (each step's rate is lr's times muon_lr / lr); torch.optim.Muon scales
            it by sqrt(max(1, rows / columns)) for each matrix, as Keller Jordan's Muon does.
        muon_weight_decay: muon's decoupled weight decay on the block matrices (the weights shrink
            by rate x decay each step, as AdamW's).
        muon_momentum: muon's (Nesterov) momentum.
        grad_clip: clip the global gradient norm to this (0 turns clipping off).
        eval_interval: steps between evaluations and checkpoints.
        eval_iters: batches per split in each evaluation.
        seed: seeds the model's initialization, dropout and the batch order.
        device: auto, cpu, cuda, cuda:N or mps.
        dtype: auto, float32, bfloat16 or float16 (CUDA only): the autocast dtype.
        compile: torch.compile the model for training.
        fsdp: under torchrun, shard parameters, gradients and optimizer state across the processes
            (FSDP2) instead of replicating them (DDP); one process has nothing to shard. Not with
            muon, which orthogonalizes each matrix whole (refused).
        dist_timeout: seconds a process waits for the others in a collective before the job fails.
        data_order: DATA_ORDERS: how the training batches go through the train split. "random":
            windows at random offsets (nanoGPT's sampling); "sequential": consecutive windows from
            the start, each global batch the next batch_size x processes x block_size tokens (the
            llm.c / nanochat stream), every process reading only its own rows of it, wrapping round
            at the end; the checkpoint keeps the position, so a resume goes on with the next unseen
            tokens. None (the default): sequential for a data folder of shards, random for one file.
    """

    batch_size: int = 12
    grad_accum: int = 1
    lr: float | None = None
    min_lr: float | None = None
    warmup: int = 100
    lr_schedule: str = "cosine"
    decay_fraction: float = DECAY_FRACTION
    max_iters: int | None = None
    max_time: float | None = None
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    optimizer: str = "adamw"
    muon_lr: float | None = None
    muon_weight_decay: float = 0.0
    muon_momentum: float = MUON_MOMENTUM
    grad_clip: float = 1.0
    eval_interval: int = 250
    eval_iters: int = 20
    seed: int = 1337
    device: str = "auto"
    dtype: str = "auto"
    compile: bool = False
    fsdp: bool = False
    dist_timeout: float = 600.0
    data_order: str | None = None

    def __post_init__(self) -> None:
        _finite(self, ("lr", "min_lr", "max_time", "weight_decay", "beta1", "beta2", "grad_clip", "dist_timeout",
                       "muon_lr", "muon_weight_decay", "muon_momentum", "decay_fraction"))
        for name in ("batch_size", "grad_accum", "eval_interval", "eval_iters"):
            value = getattr(self, name)
            _check(isinstance(value, int) and not isinstance(value, bool) and value >= 1, name,
                   f"must be an integer >= 1, got {value!r}")
        for name in ("warmup", "seed"):
            value = getattr(self, name)
            _check(isinstance(value, int) and not isinstance(value, bool) and value >= 0, name,
                   f"must be an integer >= 0, got {value!r}")
        _check(self.seed <= MAX_SEED, "seed", f"must be at most 2**63 - 1, got {self.seed!r}")
        if self.max_iters is not None:
            _check(isinstance(self.max_iters, int) and self.max_iters >= 1, "max_iters",
                   f"must be an integer >= 1, got {self.max_iters!r}")
        if self.max_time is not None:
            _check(self.max_time > 0 and math.isfinite(self.max_time), "max_time",
                   f"must be a positive duration, got {self.max_time!r}")
        if self.lr is not None:
            _check(self.lr > 0 and math.isfinite(self.lr), "lr", f"must be > 0, got {self.lr!r}")
        if self.min_lr is not None:
            # against an lr left to choose, it is checked again once train() has chosen one
            top, bound = (math.inf, ">= 0") if self.lr is None else (self.lr, f"in [0, lr={self.lr}]")
            _check(0 <= self.min_lr <= top, "min_lr", f"must be {bound}, got {self.min_lr!r}")
        _check(self.weight_decay >= 0, "weight_decay", f"must be >= 0, got {self.weight_decay!r}")
        for name in ("beta1", "beta2"):
            _check(0 <= getattr(self, name) < 1, name, f"must be in [0, 1), got {getattr(self, name)!r}")
        _check(self.dist_timeout > 0 and math.isfinite(self.dist_timeout), "dist_timeout",
               f"must be a positive duration, got {self.dist_timeout!r}")
        _check(self.grad_clip >= 0, "grad_clip", f"must be >= 0 (0 turns clipping off), got {self.grad_clip!r}")
        _check(self.lr_schedule in LR_SCHEDULES, "lr_schedule",
               f"must be one of {', '.join(LR_SCHEDULES)}, got {self.lr_schedule!r}")
        _check(0 < self.decay_fraction <= 1, "decay_fraction", f"must be in (0, 1], got {self.decay_fraction!r}")
        _check(self.optimizer in OPTIMIZERS, "optimizer",
               f"must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}")
        if self.muon_lr is not None:
            _check(self.muon_lr > 0, "muon_lr", f"must be > 0, got {self.muon_lr!r}")
        _check(self.muon_weight_decay >= 0, "muon_weight_decay", f"must be >= 0, got {self.muon_weight_decay!r}")
        _check(0 <= self.muon_momentum < 1, "muon_momentum", f"must be in [0, 1), got {self.muon_momentum!r}")
        _check(self.data_order in (None, *DATA_ORDERS), "data_order",
               f"must be one of {', '.join(DATA_ORDERS)}, got {self.data_order!r}")
        if self.fsdp and self.optimizer == "muon":
            raise ConfigError("fsdp: FSDP2 shards each weight matrix across the processes and Muon orthogonalizes "
                              "whole matrices: train muon under DDP (no --fsdp), or fsdp with --optimizer adamw")

    @property
    def final_lr(self) -> float:
        return self.lr / 10 if self.min_lr is None else self.min_lr

    @property
    def matrix_lr(self) -> float:
        """Muon's peak rate for the block matrices: muon_lr, or MUON_LR left to choose."""
        return MUON_LR if self.muon_lr is None else self.muon_lr

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        return from_mapping(cls, data)


FINETUNE_METHODS = ("full", "lora")
KEEP = ("last", "best")
# Fine-tuning moves a trained model a little: far below pretraining's DEFAULT_LR. nanoGPT's GPT-2
# recipe trains every weight at 3e-5; LoRA's adapters start at zero and take a larger step
# (litgpt's LoRA recipes use 2e-4 to 3e-4, PEFT's examples 1e-4 to 3e-4).
FINETUNE_LR = {"full": 3e-5, "lora": 2e-4}


@dataclass
class FinetuneConfig:
    """How a pretrained model is fine-tuned (tinygpt.finetune); the optimization itself is a TrainConfig.

    Args:
        method: "full" (every weight not frozen trains) or "lora" (low-rank adapters on the chosen
            projections; every base weight frozen and untouched, the run stores only the adapters).
        lora_rank, lora_alpha, lora_targets, lora_dropout: the adapters (see LoraConfig), with lora.
        freeze_embeddings: with full, the token and position embeddings do not train.
        freeze_layers: with full, the first N blocks do not train.
        keep: "last" keeps the last checkpoint; "best" only the one with the lowest validation loss
            (saved at an evaluation only when it improves, as nanoGPT's always_save_checkpoint=False),
            the base's own at step 0 included: a run that only gets worse keeps the base (LoRA: the
            adapters at zero), never a model worse than it.
        block_size: the training window, at most the base's context (default: all of it), which the model keeps.
        dropout: the model's dropout while fine-tuning (default: the base's), kept in config.json.
        grad_checkpoint: recompute each block's activations in backward instead of keeping them
            (torch.utils.checkpoint): less memory for about a third more compute.
        reference: a text file whose loss before and after is the report's forgetting measure;
            default the base's own validation split when the base is a tinygpt run that records it.
        prompts: texts sampled before and after, with the same seed, for the report (default: the
            start of the validation split).
        sample_tokens: tokens each report sample generates.
        report_tokens: the report's losses are over at most this many tokens of each text.
    """

    method: str = "full"
    lora_rank: int = 8
    lora_alpha: float = 8.0
    lora_targets: tuple[str, ...] | None = None
    lora_dropout: float = 0.0
    freeze_embeddings: bool = False
    freeze_layers: int = 0
    keep: str = "last"
    block_size: int | None = None
    dropout: float | None = None
    grad_checkpoint: bool = False
    reference: str | None = None
    prompts: tuple[str, ...] = ()
    sample_tokens: int = 48
    report_tokens: int = 20_000

    def __post_init__(self) -> None:
        _finite(self, ("lora_alpha", "lora_dropout", "dropout"))
        _check(self.method in FINETUNE_METHODS, "method", f"must be one of {', '.join(FINETUNE_METHODS)}, "
               f"got {self.method!r}")
        _check(self.keep in KEEP, "keep", f"must be one of {', '.join(KEEP)}, got {self.keep!r}")
        self.lora_targets = self.lora.targets  # checks rank, alpha, dropout and targets, and names them in full
        for name in ("freeze_embeddings", "grad_checkpoint"):
            _check(isinstance(getattr(self, name), bool), name, f"must be true or false, got {getattr(self, name)!r}")
        _check(isinstance(self.freeze_layers, int) and not isinstance(self.freeze_layers, bool)
               and self.freeze_layers >= 0, "freeze_layers", f"must be an integer >= 0, got {self.freeze_layers!r}")
        if self.method == "lora" and (self.freeze_embeddings or self.freeze_layers):
            raise ConfigError("freeze_embeddings and freeze_layers go with method full: LoRA already trains its "
                              "adapters alone")
        for name in ("block_size", "sample_tokens", "report_tokens"):
            value = getattr(self, name)
            _check(value is None and name == "block_size" or isinstance(value, int) and not isinstance(value, bool)
                   and value >= 1, name, f"must be an integer >= 1, got {value!r}")
        if self.dropout is not None:
            _check(0.0 <= self.dropout < 1.0, "dropout", f"must be in [0, 1), got {self.dropout!r}")
        _check(self.reference is None or isinstance(self.reference, str) and bool(self.reference), "reference",
               f"must be a file name, got {self.reference!r}")
        _check(all(isinstance(p, str) and p for p in self.prompts), "prompts",
               f"must be non-empty texts, got {self.prompts!r}")

    @property
    def lora(self) -> LoraConfig:
        return LoraConfig(rank=self.lora_rank, alpha=self.lora_alpha, targets=self.lora_targets,
                          dropout=self.lora_dropout)

    @property
    def default_lr(self) -> float:
        """The learning rate when the TrainConfig leaves it to choose: FINETUNE_LR for the method."""
        return FINETUNE_LR[self.method]

    def to_dict(self) -> dict[str, Any]:
        targets = None if self.lora_targets is None else list(self.lora_targets)
        return {**dataclasses.asdict(self), "lora_targets": targets, "prompts": list(self.prompts)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> FinetuneConfig:
        return from_mapping(cls, data)


_NUMBER = r"(\d+(?:\.\d*)?|\.\d+)"
# Days, hours, minutes, seconds: largest first, each at most once, spaces allowed between parts.
_DURATION = re.compile(r"\s*".join(f"(?:{_NUMBER}\\s*{unit})?" for unit in "dhms"))
_DURATION_SECONDS = (86400.0, 3600.0, 60.0, 1.0)


def parse_duration(text: str, what: str = "duration") -> float:
    """Seconds in a duration such as "90s", "10m", "1h", "1h30m", "1.5h" or a bare "90" (seconds).

    One syntax for every time budget (`tinygpt train --max-time`, `tinygpt chinchilla --time`).

    Args:
        text: the duration as the user typed it; units d, h, m, s, largest first, each at most once.
        what: the name the error message starts with (e.g. "--max-time").

    Raises:
        ConfigError: the text is not such a duration, or it is zero.
    """
    raw = text.strip().lower() if isinstance(text, str) else ""
    if re.fullmatch(_NUMBER, raw):
        seconds = float(raw)
    else:
        match = _DURATION.fullmatch(raw)
        if not raw or match is None:
            raise ConfigError(f"{what}: expected something like 90s, 10m, 1h or 1h30m, got {text!r}")
        seconds = sum(float(n) * unit for n, unit in zip(match.groups(), _DURATION_SECONDS) if n is not None)
    if not 0 < seconds < math.inf:
        raise ConfigError(f"{what}: must be finite and more than zero, got {text!r}")
    return seconds
