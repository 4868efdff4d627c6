"""The files of a Hugging Face model folder, whatever its architecture: what tells one apart from a run
folder, its weights (one file or shards) and the check before an export writes one. Below
tinygpt.interop.hf (which reads and writes the folders of each architecture) and the architecture
modules (hf_gpt2, hf_llama).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError
from ..fileio import check_folder_path, read_json
from ..weights import read_weights

# Hugging Face's names; a tinygpt run folder uses the first two too (tinygpt.run_folder), which is why a
# Hugging Face folder is told apart by the model_type in its config.json (is_hf_folder)
CONFIG = "config.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
PICKLES = ("pytorch_model.bin", "pytorch_model.bin.index.json")
FAMILY = ("llama", "qwen2", "qwen3")  # the model_types of tinygpt.interop.hf_llama
MODEL_TYPES = ("gpt2", *FAMILY)
CLASSIFIER = "ForSequenceClassification"  # a reward model's architecture: GPT2ForSequenceClassification, ...


def is_hf_config(data: Any) -> bool:
    """True for the content of a Hugging Face config.json: it names a `model_type` (a run's never does)."""
    return isinstance(data, dict) and "model_type" in data


def read_hf_config(path: str | Path, error: type[Exception] = CheckpointError) -> Any:
    """A Hugging Face folder's config.json as read.

    Args:
        path: the folder.
        error: the exception a missing or broken file raises.
    """
    return read_json(Path(path) / CONFIG, error)


def head_from_hf(data: dict[str, Any], where: str) -> str:
    """The head a Hugging Face config.json's architectures name: "reward" for a *ForSequenceClassification
    with one label (a reward model, as TRL's RewardTrainer writes it), else "lm".

    Args:
        data: the config.json.
        where: the folder, for the message.

    Raises:
        CheckpointError: a sequence classifier of more than one label, which tinygpt does not compute.
    """
    names = data.get("architectures") or []
    if not any(isinstance(n, str) and n.endswith(CLASSIFIER) for n in names):
        return "lm"
    labels = data.get("num_labels", len(data.get("id2label") or {}) or 2)
    if labels != 1:
        raise CheckpointError(f"{where}: a sequence classifier of {labels!r} labels; tinygpt reads a reward model's "
                              "one score (num_labels 1)")
    return "reward"


def is_hf_folder(path: str | Path) -> bool:
    """True for a Hugging Face model folder: its config.json is a Hugging Face one (is_hf_config)."""
    file = Path(path) / CONFIG
    if not file.is_file():
        return False
    try:
        data = read_json(file, CheckpointError)
    except CheckpointError:
        return False
    return is_hf_config(data)


def read_hf_weights(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a Hugging Face folder, by its name there: model.safetensors, or each shard that
    model.safetensors.index.json names (all of them in the folder), in the dtype stored.

    Raises:
        CheckpointError: a shard missing, a folder of pickles only, or no weights.
    """
    path = Path(path)
    if (path / WEIGHTS).is_file():
        return read_weights(path / WEIGHTS)[0]
    if (path / INDEX).is_file():  # sharded: the index maps each tensor to its file
        index = read_json(path / INDEX, CheckpointError)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{path / INDEX}: no weight_map")
        shards = sorted({str(s) for s in weight_map.values()})
        missing = [s for s in shards if not (path / s).is_file() or (path / s).parent != path]
        if missing:
            raise CheckpointError(f"{path / INDEX}: names {len(missing)} shard{'s' if len(missing) > 1 else ''} that "
                                  f"{'are' if len(missing) > 1 else 'is'} not in the folder ({', '.join(missing[:3])})")
        tensors: dict[str, torch.Tensor] = {}
        for shard in shards:
            tensors.update(read_weights(path / shard)[0])
        absent = sorted(set(weight_map) - set(tensors))
        if absent:
            raise CheckpointError(f"{path / INDEX}: maps {absent[0]} to {weight_map[absent[0]]}, which does not hold it")
        return tensors
    pickles = [name for name in PICKLES if (path / name).exists()]
    if pickles:
        raise CheckpointError(
            f"{path}: only {pickles[0]}, a pickle, which tinygpt never loads (unpickling a file can run any "
            "code in it); convert it to safetensors with transformers: "
            f"AutoModelForCausalLM.from_pretrained('{path}').save_pretrained('{path}-safetensors')"
        )
    raise CheckpointError(f"{path}: no {WEIGHTS} (nor {INDEX})")


def check_export_target(out: Path) -> None:
    """Refuse to write over anything that is not an earlier export (a run, a file, a foreign folder), and
    a folder that cannot be made or written in."""
    check_folder_path(out, CheckpointError)
    if out.is_dir() and any(out.iterdir()) and not is_hf_folder(out):
        raise CheckpointError(f"{out} is not empty and not a Hugging Face model folder; export to a new folder")
