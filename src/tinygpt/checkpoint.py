"""Run folders: weights in safetensors, config.json, the tokenizer, and the training state.

    RUN/config.json         the GPTConfig, as JSON
    RUN/model.safetensors   the weights (a tied head is stored once, as wte.weight)
    RUN/tokenizer.json      the tokenizer, when there is one
    RUN/train_state.pt      optimizer, schedule, RNG states, data position, step (training runs)

Every file is written atomically: to a temporary file in the same folder, fsync, rename. The
weights and the training state are two files, so a save renames the weights first and the state
last; a kill between the two renames leaves the new state complete as `train_state.pt.tmp`, and
the next resume finishes the rename (both files carry the step, so the pair is checked).
Nothing here unpickles: safetensors for tensors, torch.load(weights_only=True) for the state.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from .config import GPTConfig
from .errors import CheckpointError, ConfigError
from .fileio import atomic_write, fsync_dir, read_json, write_json
from .model import GPT

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
TOKENIZER = "tokenizer.json"
STATE = "train_state.pt"
TIED_KEY = "lm_head.weight"


def _weights(model: GPT, state: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    if getattr(model, "inference_only", False):  # set by tinygpt.quantize: int8 or packed weights
        raise CheckpointError("a model converted by tinygpt.quantize is for inference only: save it before quantizing")
    state = dict(model.state_dict() if state is None else state)
    if model.config.tie_weights:
        state.pop(TIED_KEY, None)  # the same tensor as wte.weight
    return {k: v.detach().contiguous().cpu() for k, v in state.items()}


def save(
    model: GPT,
    path: str | Path,
    tokenizer=None,
    *,
    step: int | None = None,
    state_dict: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write a run folder that `tinygpt.load` reads: config.json, model.safetensors, tokenizer.json.

    Args:
        model: the GPT (a compiled or wrapped model: pass the underlying module).
        path: the folder; created if needed. Files already there are replaced atomically.
        tokenizer: saved beside the weights when given.
        step: the training step the weights belong to (stored in the safetensors metadata).
        state_dict: the weights to write instead of model.state_dict() (a sharded model's,
            gathered in full).
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    write_json(path / CONFIG, model.config.to_dict())
    if tokenizer is not None:
        tokenizer.save(path / TOKENIZER)
    metadata = {"format": "pt", "step": str(step if step is not None else -1)}
    atomic_write(path / WEIGHTS, lambda tmp: save_file(_weights(model, state_dict), str(tmp), metadata=metadata))
    return path


def load_config(path: str | Path) -> GPTConfig:
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such run folder")
    if not (path / CONFIG).exists() or not (path / WEIGHTS).exists():
        raise CheckpointError(f"{path}: not a tinygpt run (it needs {CONFIG} and {WEIGHTS})")
    try:
        return GPTConfig.from_dict(read_json(path / CONFIG, CheckpointError))
    except ConfigError as e:
        raise CheckpointError(f"{path / CONFIG}: {e}") from None


def _read_weights(file: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    try:
        with safe_open(str(file), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}, (f.metadata() or {})
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"{file}: corrupt or truncated safetensors file ({e})") from None


def weights_step(path: str | Path) -> int:
    """The training step stored with a run's weights (-1 when saved outside training)."""
    _, meta = _read_weights(Path(path) / WEIGHTS)
    return int(meta.get("step", -1))


def is_hf_folder(path: str | Path) -> bool:
    """True for a Hugging Face model folder: its config.json names a `model_type` (a run's never does)."""
    file = Path(path) / CONFIG
    if not file.is_file():
        return False
    try:
        data = read_json(file, CheckpointError)
    except CheckpointError:
        return False
    return isinstance(data, dict) and "model_type" in data


def load(
    path: str | Path,
    *,
    device: str | torch.device = "cpu",
    allow_nonfinite: bool = False,
) -> GPT:
    """Load a run folder's model, in eval mode.

    Args:
        path: a folder written by `tinygpt.save` or `tinygpt train`, or a Hugging Face GPT-2
            folder (config.json with model_type "gpt2" + model.safetensors).
        device: where to put the weights.
        allow_nonfinite: accept NaN or infinite weights (refused by default).

    Raises:
        CheckpointError: not a run, a corrupt file, or a config.json that disagrees with the weights.
    """
    path = Path(path)
    if is_hf_folder(path):
        from .hf_gpt2 import load_hf  # a peer module; imported here so run folders never need it

        return load_hf(path, device=device, allow_nonfinite=allow_nonfinite)
    config = load_config(path)
    tensors, _ = _read_weights(path / WEIGHTS)
    return model_from_tensors(config, tensors, str(path), device=device, allow_nonfinite=allow_nonfinite)


def model_from_tensors(
    config: GPTConfig,
    tensors: dict[str, torch.Tensor],
    where: str,
    *,
    device: str | torch.device = "cpu",
    allow_nonfinite: bool = False,
) -> GPT:
    """Build a GPT in eval mode from tinygpt-named tensors, checking every name, shape and value.

    Args:
        config: the architecture the tensors must fit.
        tensors: parameter name -> tensor; a tied head is given as wte.weight alone.
        where: the folder they came from, for error messages.
        device: where to put the weights.
        allow_nonfinite: accept NaN or infinite weights.
    """
    with torch.device("meta"):
        model = GPT(config)
    expected = {k: v.shape for k, v in model.state_dict().items()}
    if config.tie_weights:
        expected.pop(TIED_KEY)
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        detail = f"missing {missing[:3]}" if missing else f"unexpected {unexpected[:3]}"
        raise CheckpointError(f"{where}: config.json disagrees with the weights ({detail})")
    for name, shape in expected.items():
        t = tensors[name]
        if t.shape != shape:
            raise CheckpointError(
                f"{where}: config.json disagrees with the weights: {name} has shape {tuple(t.shape)}, "
                f"the config needs {tuple(shape)}"
            )
        if not t.is_floating_point():
            raise CheckpointError(f"{where}: {name} has dtype {t.dtype}, expected a floating-point tensor")
        if not allow_nonfinite and not bool(torch.isfinite(t).all()):
            raise CheckpointError(f"{where}: {name} holds NaN or infinite values")
    tensors = dict(tensors)
    if config.tie_weights:
        tensors[TIED_KEY] = tensors["wte.weight"]
    model.load_state_dict(tensors, strict=True, assign=True)
    if config.tie_weights:
        model.lm_head.weight = model.wte.weight  # assign=True replaced the Parameter; tie again
    return model.to(device).eval()


def load_run(
    path: str | Path, device: str | torch.device = "auto", *, tokenizer_required: bool = True
) -> tuple[GPT, Any]:
    """A model and its tokenizer, from a run folder or a Hugging Face GPT-2 folder: what `sample`,
    `eval`, `serve` and `export` start from.

    Args:
        path: the folder.
        device: "auto", "cpu", "cuda", "mps" or a torch.device.
        tokenizer_required: raise if the folder has no tokenizer (else the tokenizer is None).

    Raises:
        CheckpointError, TokenizerError: the folder cannot be used (a folder without a tokenizer
            included).
    """
    from .device import resolve_device
    from .errors import TokenizerError
    from .tokenizer import load_tokenizer

    if not isinstance(device, torch.device):
        device = resolve_device(device)
    model = load(path, device=device)
    if is_hf_folder(path):
        from .hf_gpt2 import load_hf_tokenizer

        tokenizer = load_hf_tokenizer(path)
    else:
        tokenizer = load_tokenizer(path) if (Path(path) / TOKENIZER).exists() else None
    if tokenizer is None:
        if tokenizer_required:
            wanted = "tokenizer.json, or GPT-2's vocab.json + merges.txt" if is_hf_folder(path) else TOKENIZER
            raise TokenizerError(f"{path}: no tokenizer ({wanted})")
        return model, None
    if tokenizer.vocab_size > model.config.vocab_size:
        raise TokenizerError(
            f"{path}: the tokenizer has {tokenizer.vocab_size:,} tokens but the model only {model.config.vocab_size:,}"
        )
    return model, tokenizer


# ---- training state ---------------------------------------------------------------------------


def save_training(
    run: Path, model: GPT, state: dict[str, Any], tokenizer=None, *, state_dict: dict[str, torch.Tensor] | None = None
) -> None:
    """Save weights and training state as one consistent pair (see the module docstring); state_dict as in save()."""
    run = Path(run)
    step = int(state["step"])
    state_tmp = run / (STATE + ".tmp")
    weights_replaced = False
    try:
        torch.save(state, state_tmp)  # complete and synced before the weights are replaced
        with open(state_tmp, "rb+") as f:
            os.fsync(f.fileno())
        save(model, run, tokenizer, step=step, state_dict=state_dict)
        weights_replaced = True
        os.replace(state_tmp, run / STATE)
    except BaseException:
        if not weights_replaced:  # a failed save (ENOSPC, ...) leaves the previous pair as it was
            state_tmp.unlink(missing_ok=True)
        raise
    fsync_dir(run)


def _read_state(file: Path) -> dict[str, Any]:
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # a truncated zip, or an object that weights_only refuses to build
        raise CheckpointError(f"{file}: unreadable training state ({type(e).__name__}: {e})") from None


def load_training(run: str | Path) -> dict[str, Any]:
    """The training state of a run, matched to its weights; finishes a save cut short by a kill."""
    run = Path(run)
    step = weights_step(run)
    pending = run / (STATE + ".tmp")
    if pending.exists():
        try:
            candidate = _read_state(pending)
        except CheckpointError:
            candidate = None
        if candidate is not None and int(candidate.get("step", -2)) == step:
            os.replace(pending, run / STATE)  # the kill came between the two renames: roll forward
        else:
            pending.unlink()
    if not (run / STATE).exists():
        raise CheckpointError(f"{run}: no {STATE}, so there is no training to resume")
    state = _read_state(run / STATE)
    if int(state.get("step", -2)) != step:
        raise CheckpointError(f"{run}: training state is for step {state.get('step')} but the weights for {step}")
    return state
