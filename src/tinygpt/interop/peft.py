"""Hugging Face PEFT's LoRA adapter format, as PEFT's `save_pretrained` writes it and
`PeftModel.from_pretrained` reads it: adapter_config.json and adapter_model.safetensors
(tinygpt.checkpoint keeps adapter runs in this format, tinygpt.run_folder its own bookkeeping in a file beside).

    peft_config(lora, config, base)          adapter_config.json for tinygpt's LoRA settings
    to_peft_state_dict(tensors, config)      tinygpt's adapter tensors under PEFT's keys
    lora_from_peft(data, keys, config)       adapter_config.json + the file's keys -> the LoRA settings
                                             and each key's tinygpt name, everything tinygpt cannot
                                             compute refused

A PEFT key is the adapted module's Hugging Face name under `base_model.model.`, then lora_A.weight
or lora_B.weight; target_modules holds the same names inside a block:

    tinygpt                      PEFT, on a GPT-2 base
    h.0.attn.c_attn.lora_A       base_model.model.transformer.h.0.attn.c_attn.lora_A.weight
    targets ("attn.c_attn",)     "target_modules": ["attn.c_attn"], "fan_in_fan_out": true

    tinygpt                      PEFT, on a Llama-family base (Llama, Qwen2, Qwen3)
    h.0.attn.q_proj.lora_A       base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight
    targets ("attn.q_proj",)     "target_modules": ["self_attn.q_proj"], "fan_in_fan_out": false

The Hugging Face name comes from the architecture's own map (tinygpt.interop.hf.hf_name: GPT-2's,
the llama layout's), and FAN_IN_FAN_OUT says, for each config.arch, whether transformers'
projections are Conv1D (GPT-2's, weights (in, out)) or nn.Linear (the Llama family's). The tensors
need no change: PEFT's lora_A is (r, in) and lora_B (out, r) whatever the base layer's layout, so
fan_in_fan_out only tells PEFT how to fold B A into a Conv1D's (in, out) weight.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn as nn

from ..config.lora import LoraConfig
from ..config.model import GPTConfig
from ..errors import CheckpointError, ConfigError
from ..model import GPT
from .hf import hf_name

# config.arch -> PEFT's fan_in_fan_out: transformers' GPT-2 projections are Conv1D, weights (in, out);
# the Llama family's are nn.Linear, (out, in) as tinygpt's
FAN_IN_FAN_OUT = {"gpt2": True, "llama": False}
PREFIX = "base_model.model."  # PeftModel wraps the model, which wraps transformers' own
MATRICES = {".lora_A.weight": ".lora_A", ".lora_B.weight": ".lora_B"}  # PEFT's ending -> tinygpt's
# adapter_config.json fields for what tinygpt's LoRA does not compute, with the values that mean "not used"
UNUSED: dict[str, tuple[Any, ...]] = {
    "use_dora": (False, None),
    "bias": ("none", None),
    "lora_bias": (False, None),
    "modules_to_save": (None, []),
    "rank_pattern": ({}, None),
    "alpha_pattern": ({}, None),
    "layer_replication": (None, []),
    "trainable_token_indices": (None, {}, []),
    "target_parameters": (None, []),
    "use_qalora": (False, None),
    "alora_invocation_tokens": (None, []),
    "use_bdlora": (None, False),
}


def _fan_in_fan_out(config: GPTConfig) -> bool:
    if config.arch not in FAN_IN_FAN_OUT:
        raise ConfigError(f"PEFT adapters of the {config.arch} layout are not supported (tinygpt writes them for "
                          f"the {', '.join(FAN_IN_FAN_OUT)} layouts)")
    return FAN_IN_FAN_OUT[config.arch]


def hf_module(config: GPTConfig, name: str) -> str:
    """The Hugging Face name of a module of a tinygpt model of `config` (h.0.attn.c_attn ->
    transformer.h.0.attn.c_attn for GPT-2, h.0.attn.q_proj -> model.layers.0.self_attn.q_proj for the
    llama layout)."""
    _fan_in_fan_out(config)
    return hf_name(config, name)


def _in_block(hf_name: str) -> str:
    """A module's name inside its block: transformer.h.3.attn.c_attn -> attn.c_attn."""
    return re.search(r"\.\d+\.(.+)$", hf_name).group(1)


def _number(x: float) -> int | float:
    return int(x) if float(x).is_integer() else x


def peft_config(lora: LoraConfig, config: GPTConfig, base: str) -> dict[str, Any]:
    """adapter_config.json as PEFT writes it for these LoRA settings on a base of `config`.

    Args:
        lora: the settings (rank, alpha, targets, dropout).
        config: the base model's architecture, which names its modules.
        base: base_model_name_or_path, what AutoPeftModel loads the base from.
    """
    fan_in_fan_out = _fan_in_fan_out(config)
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "revision": None,
        "r": lora.rank,
        "lora_alpha": _number(lora.alpha),
        "lora_dropout": lora.dropout,
        "target_modules": [_in_block(hf_module(config, f"h.0.{t}")) for t in lora.targets],
        "fan_in_fan_out": fan_in_fan_out,
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "init_lora_weights": True,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "inference_mode": True,
    }


def _peft_key(config: GPTConfig, name: str) -> str:
    """h.0.attn.c_attn.lora_A -> base_model.model.transformer.h.0.attn.c_attn.lora_A.weight"""
    module, matrix = name.rsplit(".", 1)
    return f"{PREFIX}{hf_module(config, module)}.{matrix}.weight"


def to_peft_state_dict(tensors: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """Adapter tensors by tinygpt name (tinygpt.lora.adapter_state_dict) under PEFT's keys."""
    return {_peft_key(config, name): t for name, t in tensors.items()}


def _projections(config: GPTConfig) -> dict[str, str]:
    """Hugging Face name -> tinygpt name of every linear layer of a block, for a model of `config`
    (built on the meta device, so the map is model.py's own)."""
    with torch.device("meta"):
        model = GPT(config)
    return {hf_module(config, name): name for name, m in model.named_modules()
            if name.startswith("h.") and isinstance(m, nn.Linear)}


def lora_from_peft(
    data: Any, keys: Iterable[str], config: GPTConfig, where: str
) -> tuple[LoraConfig, dict[str, str]]:
    """The LoRA settings of a PEFT adapter, and the tinygpt name of each of its tensors.

    The adapted modules are read from the tensors' keys (what PEFT loads), so target_modules as a
    list or a regular expression alike; every block must be adapted the same way, as tinygpt's
    adapters are. use_rslora (alpha / sqrt(r)) is kept as the alpha giving the same scale.

    Args:
        data: adapter_config.json's content.
        keys: the keys of adapter_model.safetensors.
        config: the base model's architecture.
        where: the adapter's folder, for messages.

    Raises:
        CheckpointError: not a LoRA adapter, a setting or tensor tinygpt's LoRA does not compute
            (DoRA, trained biases, modules_to_save, per-module ranks, some blocks only, a module
            tinygpt cannot adapt), naming it.
    """
    if not isinstance(data, dict):
        raise CheckpointError(f"{where}: adapter_config.json is not a JSON object")
    kind = data.get("peft_type")
    if kind != "LORA":
        raise CheckpointError(f"{where}: a PEFT {kind} adapter (adapter_config.json's peft_type); "
                              "tinygpt reads LoRA adapters" if kind else
                              f"{where}: adapter_config.json names no peft_type (PEFT's LoRA adapters say \"LORA\")")
    for field, unused in UNUSED.items():
        if data.get(field, unused[0]) not in unused:
            raise CheckpointError(f"{where}: adapter_config.json sets {field}={data[field]!r}, which tinygpt's "
                                  "LoRA does not compute")
    modules = _projections(config)
    names: dict[str, str] = {}
    for key in keys:
        ending = next((e for e in MATRICES if key.endswith(e)), None)
        module = key.removeprefix(PREFIX)[: -len(ending)] if ending and key.startswith(PREFIX) else None
        if module not in modules:
            raise CheckpointError(f"{where}: {key} is not a LoRA matrix of a projection in the base's blocks "
                                  f"(PEFT's are {PREFIX}<module>.lora_A.weight and .lora_B.weight)")
        names[key] = modules[module] + MATRICES[ending]
    if not names:
        raise CheckpointError(f"{where}: adapter_model.safetensors holds no LoRA matrices")
    adapted = {name.rsplit(".", 1)[0] for name in names.values()}
    targets = sorted({m.split(".", 2)[2] for m in adapted})
    missing = [f"h.{i}.{t}.{m}" for i in range(config.n_layer) for t in targets for m in ("lora_A", "lora_B")
               if f"h.{i}.{t}.{m}" not in names.values()]
    if missing:
        hf = hf_module(config, missing[0].rsplit(".", 1)[0])
        raise CheckpointError(f"{where}: {len(missing)} of the LoRA matrices of {', '.join(targets)} are not there "
                              f"({PREFIX}{hf}.{missing[0].rsplit('.', 1)[1]}.weight first); tinygpt's adapters "
                              f"adapt every one of the base's {config.n_layer} blocks alike")
    rank, alpha = data.get("r", 8), data.get("lora_alpha", 8)
    if data.get("use_rslora") and isinstance(rank, int) and isinstance(alpha, (int, float)) and rank > 0:
        alpha = alpha * math.sqrt(rank)  # scaled by alpha / sqrt(r): the same as alpha sqrt(r) / r
    try:
        lora = LoraConfig(rank=rank, alpha=alpha, targets=targets, dropout=data.get("lora_dropout", 0.0))
    except ConfigError as e:
        raise CheckpointError(f"{where}: adapter_config.json: {e}") from None
    return lora, names
