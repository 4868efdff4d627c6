"""Hugging Face GPT-2 folders in and out: config.json and model.safetensors (tinygpt.interop.hf reads
the folders and dispatches here by model_type; the tokenizer's files are tinygpt.interop.hf_tokenizer's;
tinygpt.checkpoint opens these folders like runs, and its import_hf turns one into a run folder).

tinygpt keeps GPT-2's parameter names, so interchange is a key map plus one list of transposed
weights, every shape asserted:

    tinygpt                    Hugging Face GPT2LMHeadModel
    wte.weight                 transformer.wte.weight
    h.N.attn.c_attn.weight     transformer.h.N.attn.c_attn.weight    transposed (see TRANSPOSED)
    ...                        transformer. + the same name
    lm_head.weight             lm_head.weight                        only when the head is untied
    score.weight               score.weight                          a reward model's head, in place of
                                                                     lm_head (GPT2ForSequenceClassification)

GPT-2's projections are `Conv1D` modules that store their weight as (in, out), the transpose of
`nn.Linear`'s (out, in). GPT-2 always has biases: a bias-free tinygpt model is written with zero
biases, which compute the same thing.

A folder is plain JSON and safetensors, so export and import need no transformers; it is
imported lazily by `to_transformers` only. Pickled checkpoints (`pytorch_model.bin`) are refused.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from ..config.model import GPTConfig
from ..errors import CheckpointError, ConfigError, MissingDependencyError, TokenizerError
from ..fileio import atomic_write, write_json
from ..model import GPT
from ..tokenizer.base import Tokenizer
from ..tokenizer.hf_folder import GENERATION_CONFIG
from ..weights import SCORE_KEY, TIED_KEY
from .hf_folder import CONFIG, WEIGHTS, check_export_target
from .hf_tokenizer import save_hf_tokenizer

MODEL_TYPE = "gpt2"
# The four projections GPT-2 stores as Conv1D (in, out); tinygpt's nn.Linear holds (out, in).
TRANSPOSED = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
# Buffers older GPT-2 checkpoints carry (the causal mask): not parameters, never needed.
BUFFERS = (".attn.bias", ".attn.masked_bias")
ACTIVATION_TO_HF = {"gelu_tanh": "gelu_new", "gelu": "gelu"}
# gelu_new, gelu_pytorch_tanh and gelu_fast are the same tanh approximation written three ways.
ACTIVATION_FROM_HF = {
    "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh", "gelu": "gelu",
}


# ---- names and shapes -------------------------------------------------------------------------


def hf_name(name: str) -> str:
    """The Hugging Face name of a tinygpt parameter."""
    return name if name in (TIED_KEY, SCORE_KEY) else "transformer." + name


def gpt2_shapes(config: GPTConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter a GPT-2 of this config has, by tinygpt name, in tinygpt's layout.

    Taken from the model itself (built on the meta device, biases on), so the map can never
    drift from model.py. A tied head is wte and is not listed.
    """
    with torch.device("meta"):
        model = GPT(dataclasses.replace(config, bias=True))
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    if config.tie_weights:
        shapes.pop(TIED_KEY)
    return shapes


def hf_shapes(config: GPTConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a GPT2LMHeadModel of this config stores, by Hugging Face name, in its layout."""
    return {
        hf_name(name): shape[::-1] if name.endswith(TRANSPOSED) else shape
        for name, shape in gpt2_shapes(config).items()
    }


def gpt2_tensors(model: GPT) -> dict[str, torch.Tensor]:
    """The model's parameters as GPT-2 has them (zero biases where the model has none), tinygpt names
    and layout, on the CPU. A tied head is left out: it is wte.weight."""
    state = model.state_dict()
    out = {}
    for name, shape in gpt2_shapes(model.config).items():
        t = state.get(name)
        if t is None:  # bias=False: GPT-2 always adds a bias, and a zero one changes nothing
            t = torch.zeros(shape, dtype=model.wte.weight.dtype)
        assert tuple(t.shape) == shape, (name, tuple(t.shape), shape)
        out[name] = t.detach().cpu()
    return out


def to_hf_state_dict(model: GPT) -> dict[str, torch.Tensor]:
    """The model's weights under Hugging Face GPT-2 names and layouts, ready for safetensors."""
    shapes = hf_shapes(model.config)
    out = {}
    for name, t in gpt2_tensors(model).items():
        t = t.t() if name.endswith(TRANSPOSED) else t
        out[hf_name(name)] = t.contiguous()
        assert tuple(t.shape) == shapes[hf_name(name)]
    return out


def from_hf_state_dict(tensors: dict[str, torch.Tensor], config: GPTConfig, where: str) -> dict[str, torch.Tensor]:
    """Hugging Face GPT-2 tensors -> tinygpt names and layouts, asserting that every tensor the config
    needs is there with its shape.

    Accepts both spellings on disk: `transformer.h.0...` (save_pretrained) and the bare `h.0...` of
    the original GPT-2 checkpoints. Other heads (e.g. GPT2DoubleHeadsModel's) are ignored.
    """
    named: dict[str, torch.Tensor] = {}
    for key, t in tensors.items():
        if key.endswith(BUFFERS):
            continue
        if key not in (TIED_KEY, SCORE_KEY) and not key.startswith("transformer."):
            if key.split(".")[0] not in ("wte", "wpe", "h", "ln_f"):
                continue  # another head's tensors: not part of a language model
            key = "transformer." + key
        named[key] = t
    expected = hf_shapes(config)
    if config.tie_weights:
        named.pop(TIED_KEY, None)  # some writers store the tied head too; it is wte by definition
    missing = [k for k in expected if k not in named]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise CheckpointError(f"{where}: the weights lack {', '.join(missing[:3])}{more}, which config.json needs")
    unexpected = sorted(set(named) - set(expected))
    if unexpected:
        raise CheckpointError(
            f"{where}: the weights hold {', '.join(unexpected[:3])}, which config.json has no place for "
            f"(n_layer={config.n_layer}, tie_word_embeddings={config.tie_weights})"
        )
    dtype = named["transformer.wte.weight"].dtype
    out = {}
    for key, shape in expected.items():
        t = named[key]
        if tuple(t.shape) != shape:
            raise CheckpointError(
                f"{where}: {key} has shape {tuple(t.shape)} but config.json (n_embd={config.n_embd}, "
                f"n_layer={config.n_layer}, vocab_size={config.vocab_size}, n_positions={config.block_size}) "
                f"needs {shape}"
            )
        if not t.is_floating_point():
            raise CheckpointError(f"{where}: {key} has dtype {t.dtype}, expected a floating-point tensor")
        name = key.removeprefix("transformer.")
        t = t.t() if name.endswith(TRANSPOSED) else t
        out[name] = t.to(dtype).contiguous()
    return out


# ---- config.json ------------------------------------------------------------------------------


def check_gpt2_computes(config: GPTConfig, target: str = "a Hugging Face GPT-2") -> None:
    """Refuse a config that GPT-2's architecture cannot express, before anything is written.

    Args:
        config: the model's architecture.
        target: what the export is for, for the message ("llama.cpp's gpt2", ...).

    Raises:
        ConfigError: the config sets scale_embeddings (GPT-2 adds its token embeddings unscaled).
    """
    if config.scale_embeddings:
        raise ConfigError(
            f"this model sets scale_embeddings (token embeddings times sqrt(n_embd) = {config.n_embd**0.5:g}), "
            f"which GPT-2 does not do: {target} would compute something else, so it cannot be exported"
        )


def hf_config(config: GPTConfig, eot_id: int | None = None) -> dict[str, Any]:
    """config.json for a GPT2LMHeadModel equal to a tinygpt model of `config` (a reward model's: a
    GPT2ForSequenceClassification of one label, the end of text its padding, reward_fields)."""
    return {
        "architectures": ["GPT2ForSequenceClassification" if config.head == "reward" else "GPT2LMHeadModel"],
        "model_type": MODEL_TYPE,
        "vocab_size": config.vocab_size,
        "n_positions": config.block_size,
        "n_ctx": config.block_size,  # the older name, still read by some tools (llama.cpp's converter)
        "n_embd": config.n_embd,
        "n_layer": config.n_layer,
        "n_head": config.n_head,
        "n_inner": None,  # 4 * n_embd
        "activation_function": ACTIVATION_TO_HF[config.activation],
        "resid_pdrop": config.dropout,
        "embd_pdrop": config.dropout,
        "attn_pdrop": config.dropout,
        "layer_norm_epsilon": config.layer_norm_eps,
        "initializer_range": 0.02,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "tie_word_embeddings": config.tie_weights,
        "use_cache": True,
        "bos_token_id": eot_id,
        "eos_token_id": eot_id,
        **reward_fields(config, eot_id),
    }


def reward_fields(config: GPTConfig, pad_id: int | None) -> dict[str, Any]:
    """What a reward model's config.json adds: one label, and the padding id transformers finds a text's last
    token by (the rightmost that is not padding: the end of text, which tinygpt's scores leave out too).

    Args:
        config: the model's architecture (nothing is added for a language model).
        pad_id: the tokenizer's end of text, or None.
    """
    if config.head != "reward":
        return {}
    return {"num_labels": 1, "id2label": {"0": "LABEL_0"}, "label2id": {"LABEL_0": 0}, "pad_token_id": pad_id}


def config_from_hf(data: Any, where: str) -> GPTConfig:
    """The GPTConfig of a Hugging Face GPT-2 config.json; anything GPT-2 allows that tinygpt's model
    does not compute the same way is refused. Missing keys take GPT2Config's defaults."""
    if not isinstance(data, dict):
        raise CheckpointError(f"{where}: config.json is not a JSON object")
    model_type = data.get("model_type")
    if model_type != MODEL_TYPE:
        raise CheckpointError(f'{where}: a {model_type!r} model, not GPT-2 (tinygpt reads model_type "gpt2")')
    activation = data.get("activation_function", "gelu_new")
    if not isinstance(activation, str) or activation not in ACTIVATION_FROM_HF:
        raise CheckpointError(
            f"{where}: activation_function {activation!r} is not supported "
            f"(tinygpt computes {', '.join(ACTIVATION_FROM_HF)})"
        )
    n_embd = data.get("n_embd", 768)
    if data.get("n_inner") is not None and not (isinstance(n_embd, int) and data["n_inner"] == 4 * n_embd):
        raise CheckpointError(f"{where}: n_inner={data['n_inner']!r}; tinygpt's MLP is 4 x n_embd (n_embd={n_embd!r})")
    for flag, needed in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                         ("add_cross_attention", False)):
        if data.get(flag, needed) != needed:
            raise CheckpointError(f"{where}: {flag}={data[flag]} is not supported (tinygpt needs {needed})")
    try:
        return GPTConfig(
            vocab_size=data.get("vocab_size", 50257),
            block_size=data.get("n_positions", data.get("n_ctx", 1024)),
            n_layer=data.get("n_layer", 12),
            n_head=data.get("n_head", 12),
            n_embd=n_embd,
            dropout=data.get("resid_pdrop", 0.1),
            bias=True,
            tie_weights=bool(data.get("tie_word_embeddings", True)),
            activation=ACTIVATION_FROM_HF[activation],
            init="gpt2",
            layer_norm_eps=data.get("layer_norm_epsilon", 1e-5),
        )
    except ConfigError as e:
        raise CheckpointError(f"{where}: config.json: {e}") from None


# ---- export -----------------------------------------------------------------------------------


def export_hf(model: GPT, tokenizer: Tokenizer | None, out: str | Path) -> Path:
    """Write a Hugging Face GPT-2 folder that transformers loads as GPT2LMHeadModel and AutoTokenizer.

    Args:
        model: the GPT.
        tokenizer: its tokenizer (char, bpe or gpt2), written as tokenizer.json + tokenizer_config.json
            (GPT-2's BPE also as vocab.json + merges.txt); None writes the model alone.
        out: the folder, new or an earlier export (its files are replaced atomically).

    Returns:
        The folder.
    """
    out = Path(out)
    check_gpt2_computes(model.config)
    check_export_target(out)
    if tokenizer is not None and tokenizer.vocab_size > model.config.vocab_size:
        raise TokenizerError(f"the tokenizer has {tokenizer.vocab_size} tokens, the model {model.config.vocab_size}")
    out.mkdir(parents=True, exist_ok=True)
    eot = tokenizer.eot_id if tokenizer is not None else None
    state = to_hf_state_dict(model)
    atomic_write(out / WEIGHTS, lambda tmp: save_file(state, str(tmp), metadata={"format": "pt"}))
    generation = {"bos_token_id": eot, "eos_token_id": eot, "pad_token_id": eot} if eot is not None else {}
    template = getattr(tokenizer, "chat_template", None)
    if template is not None:  # a chat run's replies end at its end of turn (and at <|endoftext|>, where there is one)
        end = tokenizer.special_ids()[template.end]
        generation["eos_token_id"] = [end, eot] if eot is not None else end
    if model.config.head == "lm":
        write_json(out / GENERATION_CONFIG, generation)
    else:  # a reward model generates nothing
        (out / GENERATION_CONFIG).unlink(missing_ok=True)
    save_hf_tokenizer(tokenizer, out, model.config.block_size)
    write_json(out / CONFIG, hf_config(model.config, eot))  # last: a folder without it is not a model yet
    return out


def to_transformers(model: GPT) -> Any:
    """The model as a `transformers.GPT2LMHeadModel` (a reward model: GPT2ForSequenceClassification) in eval
    mode (needs the hf extra)."""
    try:
        from transformers import GPT2Config, GPT2ForSequenceClassification, GPT2LMHeadModel
    except ImportError:
        raise MissingDependencyError("transformers is not installed: pip install 'tinygpt[hf]'") from None
    check_gpt2_computes(model.config, "transformers' GPT-2")
    fields = {k: v for k, v in hf_config(model.config).items() if k not in ("architectures", "model_type")}
    config = GPT2Config(**fields)
    hf = (GPT2ForSequenceClassification if model.config.head == "reward" else GPT2LMHeadModel)(config)
    result = hf.load_state_dict(to_hf_state_dict(model), strict=False)
    # a tied head is not stored (it is wte), and the causal-mask buffers are not weights
    missing = [k for k in result.missing_keys if k != TIED_KEY and not k.endswith(BUFFERS)]
    if missing or result.unexpected_keys:
        raise CheckpointError(
            f"transformers' GPT-2 disagrees: missing {missing[:3]}, unexpected {result.unexpected_keys[:3]}"
        )
    hf.tie_weights()
    return hf.to(model.wte.weight.dtype).eval()
