"""Hugging Face folders of the Llama family (LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM) in
and out: config.json and the safetensors weights, one file or shards (tinygpt.interop.hf dispatches
here by model_type; the tokenizer is tinygpt.interop.hf_tokenizer's).

tinygpt's llama layout (config.arch "llama") keeps Hugging Face's projection names inside its blocks,
so interchange is a key map, every shape asserted, nothing transposed or split:

    tinygpt                      Hugging Face
    wte.weight                   model.embed_tokens.weight
    h.N.ln_1.weight              model.layers.N.input_layernorm.weight
    h.N.attn.q_proj.weight       model.layers.N.self_attn.q_proj.weight    (k_proj, v_proj, o_proj; biases;
                                                                             Qwen3's q_norm, k_norm alike)
    h.N.ln_2.weight              model.layers.N.post_attention_layernorm.weight
    h.N.mlp.gate_proj.weight     model.layers.N.mlp.gate_proj.weight       (up_proj, down_proj alike)
    ln_f.weight                  model.norm.weight
    lm_head.weight               lm_head.weight                            only when the head is untied
    score.weight                 score.weight                              a reward model's head, in place of
                                                                           lm_head (*ForSequenceClassification)

The same map names modules (h.N.attn.q_proj <-> model.layers.N.self_attn.q_proj), which is what a
PEFT adapter's keys are built from. A config.json field that changes what the model computes and that
tinygpt does not implement (sliding-window attention, a rope_type other than default, linear and
llama3, experts, quantized weights, another activation) is refused, naming the field. Weights load
in the dtype they are stored in (bfloat16 for the published models).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from ..config.model import GPTConfig
from ..errors import CheckpointError, ConfigError, MissingDependencyError, TokenizerError
from .hf_folder import CLASSIFIER

# model_type -> the architecture transformers names in config.json (a reward model's: Llama... + CLASSIFIER)
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
FAMILY_NAMES = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3"}
# tinygpt name prefix <-> Hugging Face's, the block's parts after `h.N.` / `model.layers.N.`
_OUTSIDE = (("wte.", "model.embed_tokens."), ("ln_f.", "model.norm."), ("lm_head.", "lm_head."), ("score.", "score."))
_BLOCK = (("ln_1", "input_layernorm"), ("ln_2", "post_attention_layernorm"), ("attn", "self_attn"), ("mlp", "mlp"))
# tensors older checkpoints carry that are not weights (the rotary frequencies, recomputed from the config)
BUFFERS = (".rotary_emb.inv_freq",)
ROPE_TYPES = {"default": "none", "linear": "linear", "llama3": "llama3"}
# config.json fields whose other values change the math in ways tinygpt does not compute, with the value
# (or values) that means "off"
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "use_sliding_window": (False, None),
    "rope_interleaved": (False, None),
    "partial_rotary_factor": (1.0, None),
    "quantization_config": (None,),
    "num_experts": (None, 0),
    "num_local_experts": (None, 0),
    "attn_logit_softcapping": (None,),
    "final_logit_softcapping": (None,),
    "hidden_act": ("silu",),
}
DEFAULT_CONTEXT = {"llama": 2048, "qwen2": 32768, "qwen3": 32768}  # transformers' max_position_embeddings


def _renamed(name: str, to_hf: bool) -> str:
    """A parameter's or module's name in the other naming (see the module docstring)."""
    block, outside = (r"h\.(\d+)\.([^.]+)(.*)", "model.layers.") if to_hf else (r"model\.layers\.(\d+)\.([^.]+)(.*)", "h.")
    parts = dict(_BLOCK) if to_hf else {theirs: ours for ours, theirs in _BLOCK}
    m = re.match(block, name)
    if m:
        return f"{outside}{m.group(1)}.{parts.get(m.group(2), m.group(2))}{m.group(3)}"
    for ours, theirs in _OUTSIDE:
        old, new = (ours, theirs) if to_hf else (theirs, ours)
        if name.startswith(old):
            return new + name[len(old):]
    return name


def hf_name(name: str) -> str:
    """The Hugging Face name of a tinygpt parameter or module of the llama layout."""
    return _renamed(name, to_hf=True)


def tinygpt_name(name: str) -> str:
    """The tinygpt name of a Hugging Face parameter or module (the inverse of hf_name)."""
    return _renamed(name, to_hf=False)


def model_type(config: GPTConfig) -> str:
    """The Hugging Face model_type a llama-layout config is: qwen3 with qk-norm, qwen2 with q/k/v biases
    alone, else llama."""
    return "qwen3" if config.qk_norm else "qwen2" if config.qkv_bias and not config.bias else "llama"


# ---- config.json ------------------------------------------------------------------------------


def _refuse(where: str, field: str, value: Any, why: str) -> CheckpointError:
    return CheckpointError(f"{where}: config.json's {field}={value!r} is not supported ({why})")


def config_from_hf(data: dict[str, Any], where: str) -> GPTConfig:
    """The GPTConfig of a llama, qwen2 or qwen3 config.json, refusing (one line, naming the field) what
    tinygpt's model does not compute. Missing keys take transformers' defaults.

    Raises:
        CheckpointError: an unsupported field or value, or values GPTConfig refuses.
    """
    kind = data.get("model_type")
    for field, neutral in NEUTRAL.items():
        if field in data and data[field] not in neutral:
            raise _refuse(where, field, data[field], "tinygpt computes " + ("SiLU" if field == "hidden_act" else
                                                                            f"it as {neutral[0]!r}"))
    layer_types = data.get("layer_types")
    if layer_types is not None and any(t != "full_attention" for t in layer_types):
        raise _refuse(where, "layer_types", sorted(set(layer_types)), "tinygpt's attention is full attention")
    rope = data.get("rope_parameters") or data.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise _refuse(where, "rope_scaling", rope, "expected an object")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise _refuse(where, "rope_scaling.rope_type", rope_type, f"tinygpt implements {', '.join(ROPE_TYPES)}")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise _refuse(where, "rope_parameters.partial_rotary_factor", rope["partial_rotary_factor"],
                      "tinygpt turns every dimension of a head")
    bias, qkv_bias = False, False
    if kind == "qwen2":
        qkv_bias = True  # Qwen2's q, k and v projections always have biases; o_proj and the MLP none
    else:
        attention, mlp = bool(data.get("attention_bias", False)), bool(data.get("mlp_bias", False))
        if attention != mlp:
            field = "attention_bias" if attention else "mlp_bias"
            raise _refuse(where, field, True, "tinygpt's biases are on every projection or on q, k and v alone")
        bias = attention
    heads, hidden = data.get("num_attention_heads", 32), data.get("hidden_size", 4096)
    head_dim = data.get("head_dim")
    natural = hidden // heads if isinstance(hidden, int) and isinstance(heads, int) and heads else None
    scaled = ROPE_TYPES[rope_type] != "none"
    try:
        return GPTConfig(
            arch="llama",
            vocab_size=data.get("vocab_size", 32000),
            block_size=data.get("max_position_embeddings", DEFAULT_CONTEXT.get(kind, 2048)),
            n_layer=data.get("num_hidden_layers", 32),
            n_head=heads,
            n_embd=hidden,
            n_kv_head=data.get("num_key_value_heads") or heads,
            head_size=None if head_dim is None or (head_dim == natural and hidden % heads == 0) else head_dim,
            intermediate_size=data.get("intermediate_size", 11008),
            bias=bias,
            qkv_bias=qkv_bias,
            qk_norm=kind == "qwen3",
            tie_weights=bool(data.get("tie_word_embeddings", False)),
            layer_norm_eps=data.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope.get("rope_theta", data.get("rope_theta", 10000.0))),
            rope_scaling=ROPE_TYPES[rope_type],
            rope_factor=float(rope.get("factor", 1.0)) if scaled else 1.0,
            rope_low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
            rope_high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
            rope_original_context=int(rope.get("original_max_position_embeddings", 8192)),
            dropout=0.0,
            init="gpt2",
        )
    except (ConfigError, TypeError, ValueError) as e:
        raise CheckpointError(f"{where}: config.json: {e}") from None


def check_exportable(config: GPTConfig, target: str = "a Hugging Face Llama") -> None:
    """Refuse a llama-layout config transformers' Llama, Qwen2 and Qwen3 cannot express.

    Raises:
        ConfigError: learned positions, LayerNorm, a GELU MLP, scaled embeddings, or qk-norm beside
            q/k/v biases alone.
    """
    for field, want in (("positions", "rope"), ("norm", "rmsnorm"), ("mlp", "swiglu")):
        if getattr(config, field) != want:
            raise ConfigError(f"this model's {field} is {getattr(config, field)!r}: {target} has {want!r} only, so it "
                              "cannot be exported")
    if config.scale_embeddings:
        raise ConfigError(f"this model sets scale_embeddings, which {target} does not do: it cannot be exported")
    if config.qk_norm and config.qkv_bias and not config.bias:
        raise ConfigError(f"this model has qk-norm and q/k/v biases alone, which none of {', '.join(ARCHITECTURES)} "
                          "has: it cannot be exported")


def hf_config(config: GPTConfig, bos_id: int | None = None, eos_id: int | None = None) -> dict[str, Any]:
    """config.json for the transformers model (model_type) equal to a llama-layout tinygpt model (a reward
    model's: the family's *ForSequenceClassification of one label, padded with the end of text)."""
    from .hf_gpt2 import reward_fields

    kind = model_type(config)
    rope: dict[str, Any] = {"rope_type": "default" if config.rope_scaling == "none" else config.rope_scaling,
                            "rope_theta": config.rope_theta}
    if config.rope_scaling != "none":
        rope["factor"] = config.rope_factor
    if config.rope_scaling == "llama3":
        rope.update(low_freq_factor=config.rope_low_freq_factor, high_freq_factor=config.rope_high_freq_factor,
                    original_max_position_embeddings=config.rope_original_context)
    out: dict[str, Any] = {
        "architectures": [architecture(config)],
        "model_type": kind,
        "vocab_size": config.vocab_size,
        "hidden_size": config.n_embd,
        "intermediate_size": config.mlp_width,
        "num_hidden_layers": config.n_layer,
        "num_attention_heads": config.n_head,
        "num_key_value_heads": config.kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": config.block_size,
        "rms_norm_eps": config.layer_norm_eps,
        "rope_theta": config.rope_theta,  # the older spelling, beside rope_parameters (transformers 4 reads it)
        "rope_scaling": None if config.rope_scaling == "none" else rope,
        "rope_parameters": rope,
        "tie_word_embeddings": config.tie_weights,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
    }
    if kind == "qwen2":
        out.update(use_sliding_window=False, sliding_window=None)
    else:
        out["attention_bias"] = config.bias
    if kind == "llama":
        out["mlp_bias"] = config.bias
    if kind == "qwen3":
        out.update(use_sliding_window=False, sliding_window=None)
    return {**out, **reward_fields(config, eos_id)}


def architecture(config: GPTConfig) -> str:
    """The transformers class a llama-layout config is: LlamaForCausalLM, ... or, for a reward model,
    LlamaForSequenceClassification, ..."""
    kind = model_type(config)
    return FAMILY_NAMES[kind] + CLASSIFIER if config.head == "reward" else ARCHITECTURES[kind]


# ---- weights ----------------------------------------------------------------------------------


def expected_shapes(config: GPTConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of a llama-layout model of this config, by tinygpt name (a tied head left out),
    from the model itself built on the meta device, so the map can never drift from model.py."""
    from ..model import GPT
    from ..weights import TIED_KEY

    with torch.device("meta"):
        model = GPT(config)
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    if config.tie_weights:
        shapes.pop(TIED_KEY)
    return shapes


def from_hf_state_dict(tensors: dict[str, torch.Tensor], config: GPTConfig, where: str) -> dict[str, torch.Tensor]:
    """Hugging Face tensors -> tinygpt names, every tensor the config needs present with its shape, in
    the dtype it is stored in.

    Raises:
        CheckpointError: a tensor missing, one with no place in the config, or a shape that disagrees.
    """
    from ..weights import TIED_KEY

    named = {tinygpt_name(k): t for k, t in tensors.items() if not k.endswith(BUFFERS)}
    if config.tie_weights:
        named.pop(TIED_KEY, None)  # some writers store the tied head too; it is the embedding by definition
    expected = expected_shapes(config)
    missing = [hf_name(k) for k in expected if k not in named]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise CheckpointError(f"{where}: the weights lack {', '.join(missing[:3])}{more}, which config.json needs")
    unexpected = sorted(hf_name(k) for k in set(named) - set(expected))
    if unexpected:
        raise CheckpointError(f"{where}: the weights hold {', '.join(unexpected[:3])}, which config.json has no place "
                              f"for (num_hidden_layers={config.n_layer}, tie_word_embeddings={config.tie_weights})")
    for name, shape in expected.items():
        t = named[name]
        if tuple(t.shape) != shape:
            raise CheckpointError(f"{where}: {hf_name(name)} has shape {tuple(t.shape)} but config.json needs {shape}")
        if not t.is_floating_point():
            raise CheckpointError(f"{where}: {hf_name(name)} has dtype {t.dtype}, expected a floating-point tensor")
    dtypes = {t.dtype for t in named.values()}
    if len(dtypes) > 1:  # one dtype for the model: the embedding's
        return {k: t.to(named["wte.weight"].dtype) for k, t in named.items()}
    return named


def to_hf_state_dict(state: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """A llama-layout model's weights (a state dict, a tied head once as wte) under Hugging Face's names."""
    from ..weights import TIED_KEY

    expected = expected_shapes(config)
    out = {}
    for name, shape in expected.items():
        t = state[name]
        assert tuple(t.shape) == shape, (name, tuple(t.shape), shape)
        out[hf_name(name)] = t.detach().cpu().contiguous()
    if config.tie_weights:
        out.pop(hf_name(TIED_KEY), None)
    return out


def transformers_class(config: GPTConfig) -> tuple[Any, Any]:
    """(config class, model class) of transformers for a llama-layout config (needs transformers)."""
    import transformers

    family = FAMILY_NAMES[model_type(config)]
    return getattr(transformers, family + "Config"), getattr(transformers, architecture(config))


# ---- export -----------------------------------------------------------------------------------


def export_hf(model: Any, tokenizer: Any, out: str | Path) -> Path:
    """Write a llama-layout model as the Hugging Face folder AutoModelForCausalLM loads (LlamaForCausalLM,
    Qwen2ForCausalLM or Qwen3ForCausalLM, by model_type), with its tokenizer.

    Args:
        model: the GPT (config.arch "llama"), in any dtype: the weights are written as they are.
        tokenizer: its tokenizer: a pretrained one (its tokenizer.json, special tokens and Jinja chat
            template as they came), or a tinygpt kind (see save_hf_tokenizer); None writes the model alone.
        out: the folder, new or an earlier export (its files are replaced atomically).

    Raises:
        ConfigError: a config transformers' classes cannot express (check_exportable).
        CheckpointError: `out` is something else than an earlier export.
        TokenizerError: a tokenizer larger than the model's vocabulary.
    """
    from safetensors.torch import save_file

    from ..fileio import atomic_write, write_json
    from ..tokenizer.chat import stop_ids
    from ..tokenizer.hf import HFTokenizer
    from ..tokenizer.hf_folder import GENERATION_CONFIG
    from .hf_folder import CONFIG, WEIGHTS, check_export_target
    from .hf_tokenizer import save_hf_tokenizer

    out, config = Path(out), model.config
    check_exportable(config)
    check_export_target(out)
    if tokenizer is not None and tokenizer.vocab_size > config.vocab_size:
        raise TokenizerError(f"the tokenizer has {tokenizer.vocab_size} tokens, the model {config.vocab_size}")
    out.mkdir(parents=True, exist_ok=True)
    state = to_hf_state_dict(model.state_dict(), config)
    atomic_write(out / WEIGHTS, lambda tmp: save_file(state, str(tmp), metadata={"format": "pt"}))
    bos = getattr(tokenizer, "bos_id", None) if isinstance(tokenizer, HFTokenizer) else None
    eos = tokenizer.eot_id if tokenizer is not None else None
    stops = sorted(stop_ids(tokenizer)) if tokenizer is not None else []
    generation: dict[str, Any] = {"bos_token_id": bos, "eos_token_id": stops[0] if len(stops) == 1 else stops or eos}
    if eos is not None:
        generation["pad_token_id"] = eos
    if config.head == "lm":
        write_json(out / GENERATION_CONFIG, {k: v for k, v in generation.items() if v is not None})
    else:  # a reward model generates nothing
        (out / GENERATION_CONFIG).unlink(missing_ok=True)
    save_hf_tokenizer(tokenizer, out, config.block_size)
    write_json(out / CONFIG, {**hf_config(config, bos, eos), "torch_dtype": str(state["model.embed_tokens.weight"].dtype)
                              .removeprefix("torch."), "transformers_version": _transformers_version()})
    return out


def _transformers_version() -> str:
    """The version transformers writes in config.json (the installed one, or the oldest that reads the folder)."""
    try:
        from importlib.metadata import version

        return version("transformers")
    except Exception:  # not installed: the folder needs nothing of it to be written
        return "4.46.0"


def to_transformers(model: Any) -> Any:
    """The model as transformers' own LlamaForCausalLM, Qwen2ForCausalLM or Qwen3ForCausalLM, in eval mode
    and the model's dtype (needs the hf extra)."""
    try:
        config_class, model_class = transformers_class(model.config)
    except ImportError:
        raise MissingDependencyError("transformers is not installed: pip install 'tinygpt[hf]'") from None
    check_exportable(model.config, "transformers' " + model_class.__name__)
    fields = {k: v for k, v in hf_config(model.config).items() if k not in ("architectures", "model_type")}
    hf = model_class(config_class(**fields))
    state = to_hf_state_dict(model.state_dict(), model.config)
    result = hf.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if not (model.config.tie_weights and k == "lm_head.weight")]
    if missing or result.unexpected_keys:
        raise CheckpointError(f"transformers' {model_class.__name__} disagrees: missing {missing[:3]}, "
                              f"unexpected {result.unexpected_keys[:3]}")
    hf.tie_weights()
    return hf.to(model.wte.weight.dtype).eval()
