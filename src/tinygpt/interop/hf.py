"""Hugging Face model folders, of every architecture tinygpt reads: GPT-2 (tinygpt.interop.hf_gpt2) and
the Llama family, LlamaForCausalLM, Qwen2ForCausalLM and Qwen3ForCausalLM (tinygpt.interop.hf_llama).

    is_hf_folder(path)          a folder whose config.json names a model_type (a run's never does)
    read_hf_weights(path)       model.safetensors, or the shards model.safetensors.index.json names
    config_from_hf(data)        config.json -> GPTConfig, by model_type
    folder_config(path)         the folder's GPTConfig, from its config.json
    load_hf(path)               the folder's model
    export_hf(model, tok, out)  the folder transformers' AutoModelForCausalLM loads, by config.arch (a reward
                                model's: AutoModelForSequenceClassification, one label)
    to_transformers(model)      the model as transformers' own class (needs the hf extra)
    hf_name(config, name)       a tinygpt parameter's or module's Hugging Face name (a PEFT key's stem)

A folder is plain JSON and safetensors: nothing here needs transformers but to_transformers.
Pickled checkpoints (pytorch_model.bin) are refused.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from ..config.model import GPTConfig
from ..errors import CheckpointError, MissingDependencyError
from ..weights import check_layers, model_from_tensors
from .hf_folder import MODEL_TYPES, head_from_hf, is_hf_config, is_hf_folder, read_hf_config, read_hf_weights

__all__ = ["config_from_hf", "export_hf", "folder_config", "hf_name", "is_hf_config", "is_hf_folder", "load_hf",
           "read_hf_weights", "to_transformers"]

def config_from_hf(data: Any, where: str) -> GPTConfig:
    """The GPTConfig of a Hugging Face config.json of a model_type tinygpt reads (MODEL_TYPES).

    Raises:
        CheckpointError: not a config.json, another model_type, or a field tinygpt does not compute.
    """
    if not isinstance(data, dict):
        raise CheckpointError(f"{where}: config.json is not a JSON object")
    kind = data.get("model_type")
    if kind in MODEL_TYPES:
        if kind == "gpt2":
            from .hf_gpt2 import config_from_hf as read
        else:
            from .hf_llama import config_from_hf as read
        config = read(data, where)
        if head_from_hf(data, where) == "reward":  # a reward model: its score for a head, nothing tied
            config = dataclasses.replace(config, head="reward", tie_weights=False)
        return config
    raise CheckpointError(f"{where}: config.json's model_type={kind!r} is not supported (tinygpt reads "
                          f"{', '.join(MODEL_TYPES)})")


def folder_config(path: str | Path) -> GPTConfig:
    """The GPTConfig of a Hugging Face folder, from its config.json (config_from_hf).

    Args:
        path: the folder.
    """
    return config_from_hf(read_hf_config(path), str(path))


def load_hf(path: str | Path, *, device: str | torch.device = "cpu", allow_nonfinite: bool = False) -> Any:
    """A Hugging Face folder's model as a tinygpt GPT in eval mode, its weights in the dtype stored.

    Args:
        path: the folder, as `save_pretrained` or `tinygpt export --format hf` writes it.
        device: where to put the weights.
        allow_nonfinite: accept NaN or infinite weights.

    Raises:
        CheckpointError: an architecture or config field tinygpt does not read, a pickle-only folder,
            a missing shard, missing tensors, or shapes that disagree with config.json.
    """
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such folder")
    config = folder_config(path)
    tensors = read_hf_weights(path)
    if config.arch == "gpt2":
        from .hf_gpt2 import from_hf_state_dict

        names = list(tensors)
    else:
        from .hf_llama import from_hf_state_dict, tinygpt_name

        names = [tinygpt_name(k) for k in tensors]
    check_layers(config, names, str(path))  # before a model of config's size is built
    tensors = from_hf_state_dict(tensors, config, str(path))
    return model_from_tensors(config, tensors, str(path), device=device, allow_nonfinite=allow_nonfinite)


def export_hf(model: Any, tokenizer: Any, out: str | Path) -> Path:
    """Write the model as the Hugging Face folder of its architecture (GPT2LMHeadModel, or for the llama
    layout LlamaForCausalLM, Qwen2ForCausalLM or Qwen3ForCausalLM; a reward model as the same family's
    *ForSequenceClassification with one label), with its tokenizer."""
    if model.config.arch == "gpt2":
        from .hf_gpt2 import export_hf as export_gpt2

        return export_gpt2(model, tokenizer, out)
    from .hf_llama import export_hf as export_llama

    return export_llama(model, tokenizer, out)


def to_transformers(model: Any) -> Any:
    """The model as transformers' own class in eval mode (needs the hf extra)."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise MissingDependencyError("transformers is not installed: pip install 'tinygpt[hf]'") from None
    if model.config.arch == "gpt2":
        from .hf_gpt2 import to_transformers as gpt2_transformers

        return gpt2_transformers(model)
    from .hf_llama import to_transformers as llama_transformers

    return llama_transformers(model)


def hf_name(config: GPTConfig, name: str) -> str:
    """The Hugging Face name of a tinygpt parameter or module of a model of `config`: GPT-2's under
    transformer., the llama layout's by hf_llama's map. PEFT's adapter keys are built on it."""
    if config.arch == "gpt2":
        from .hf_gpt2 import hf_name as gpt2_name

        return gpt2_name(name)
    from .hf_llama import hf_name as llama_name

    return llama_name(name)
