"""A run folder's model: its weights in safetensors, beside config.json and the tokenizer, saved and
loaded; adapter runs; a training checkpoint's pair of weights and state. The folder's files and their
names are tinygpt.run_folder's (RunFolder): this module writes and reads the weights at its paths.

    RUN/config.json         the GPTConfig, as JSON
    RUN/model.safetensors   the weights (a tied head is stored once, as wte.weight)
    RUN/tokenizer.json      the tokenizer, when there is one
    RUN/train_state.pt      optimizer, schedule, RNG states, data position, step (training runs)

An adapter run holds LoRA adapters (tinygpt.lora) instead of model.safetensors, in Hugging Face
PEFT's format (tinygpt.interop.peft: PeftModel.from_pretrained loads the folder onto the base's
Hugging Face export), and names the base model they belong to:

    RUN/adapter_config.json        PEFT's: the LoRA settings, target_modules in Hugging Face's names
    RUN/adapter_model.safetensors  PEFT's: the adapters under PEFT's keys (a few MB where the base is hundreds)
    RUN/tinygpt_adapter.json       tinygpt's: the base's path and a checksum of its weights
    RUN/config.json                the base's GPTConfig, so load_config and `tinygpt params` read the run
    RUN/tokenizer.json             the base's tokenizer, copied, so sample, eval and serve need nothing else

The base's path is kept as given when absolute; a relative one is stored relative to the adapter
run's folder (so the two folders can move together) and resolved against it. The checksum is
tinygpt.lora.weights_checksum, the same whether the base is a tinygpt run or a Hugging Face folder.
A PEFT adapter trained elsewhere (adapter_config.json and adapter_model.safetensors alone) is an
adapter run too, given its base (or found at its base_model_name_or_path, when that is a folder);
nothing checks its base's checksum then, which it does not carry. An adapter run of tinygpt's
first format (adapter_config.json of "format" "tinygpt-lora" version 1, adapter.safetensors under
tinygpt's names) reads as before, and its next save (a resumed fine-tune, save_adapter_run) rewrites
it in PEFT's format. `load` reads every kind of folder: a run, an adapter run (its base, checked
against the checksum, with the adapters applied) and a Hugging Face folder of GPT-2 or the Llama family
(tinygpt.interop.hf).

Every file is written atomically: to a temporary file in the same folder, fsync, rename. The
weights and the training state are two files, so a save renames the weights first and the state
last; a kill between the two renames leaves the new state complete as `train_state.pt.tmp`, and
the next resume finishes the rename (RunFolder.load_state: both files carry the step, so the pair is
checked).
Nothing here unpickles: safetensors for tensors (read through tinygpt.weights),
torch.load(weights_only=True) for the state.
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from .config.model import GPTConfig
from .device import resolve_device
from .errors import CheckpointError, TokenizerError
from .fileio import atomic_write, fsync_dir, new_folder, write_json
from .interop.hf import is_hf_folder, load_hf
from .interop.hf_tokenizer import load_hf_tokenizer
from .interop.peft import peft_config, to_peft_state_dict
from .lora import adapter_state_dict, apply_lora, load_adapter_state_dict, lora_config_of, weights_checksum
from .lora import merge as merge_lora
from .model import GPT
from .run_folder import RunFolder
# what users and tests import from here about a folder; the run folder answers them
from .run_folder import is_adapter_run, load_config, load_training, read_adapter_config, weights_step
from .tokenizer.base import Tokenizer
from .tokenizer.base import load_tokenizer as read_tokenizer
from .weights import TIED_KEY, check_layers, model_from_tensors, read_weights, reconfigured


def _weights(model: GPT, state: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    if getattr(model, "inference_only", False):  # set by tinygpt.quantize: int8 or packed weights
        raise CheckpointError("a model converted by tinygpt.quantize is for inference only: save it before quantizing")
    state = dict(model.state_dict() if state is None else state)
    if any(k.endswith((".lora_A", ".lora_B")) for k in state):
        raise CheckpointError("the model has LoRA adapters: save them with tinygpt.checkpoint.save_adapter_run, "
                              "or fold them in first with tinygpt.lora.merge")
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
    path, folder = Path(path), RunFolder(path)
    path.mkdir(parents=True, exist_ok=True)
    write_json(folder.config_file, model.config.to_dict())
    if tokenizer is not None:
        tokenizer.save(folder.tokenizer_file)
    metadata = {"format": "pt", "step": str(step if step is not None else -1)}
    atomic_write(folder.weights_file, lambda tmp: save_file(_weights(model, state_dict), str(tmp), metadata=metadata))
    return path


def load(
    path: str | Path,
    *,
    device: str | torch.device = "cpu",
    allow_nonfinite: bool = False,
    merge: bool = False,
    base: str | Path | None = None,
) -> GPT:
    """Load a run folder's model, in eval mode.

    Args:
        path: a folder written by `tinygpt.save` or `tinygpt train`, a Hugging Face GPT-2
            folder (config.json with model_type "gpt2" + model.safetensors), or an adapter run
            (its base model, checked against the checksum it was trained on, with the LoRA adapters).
        device: where to put the weights.
        allow_nonfinite: accept NaN or infinite weights (refused by default).
        merge: for an adapter run, fold the adapters into the weights (a plain GPT, faster for
            inference); by default they stay separate layers, ready to train on.
        base: for an adapter run, its base model's folder where it is not the one the run names (a
            PEFT adapter trained elsewhere names none tinygpt reads).

    Raises:
        CheckpointError: not a run, a corrupt file, a config.json that disagrees with the weights,
            or an adapter run whose base is missing or has changed.
    """
    path, folder = Path(path), RunFolder(path)
    if folder.is_adapter_run():
        return load_adapter_run(path, device=device, allow_nonfinite=allow_nonfinite, merge_adapters=merge, base=base)
    if is_hf_folder(path):
        return load_hf(path, device=device, allow_nonfinite=allow_nonfinite)
    config = folder.model_config()
    tensors, _ = read_weights(folder.weights_file)
    check_layers(config, tensors, str(path))  # before a model of config's size is built
    return model_from_tensors(config, tensors, str(path), device=device, allow_nonfinite=allow_nonfinite)


def load_run(
    path: str | Path, device: str | torch.device = "auto", *, tokenizer_required: bool = True,
    allow_nonfinite: bool = False,
) -> tuple[GPT, Any]:
    """A model and its tokenizer, from a run folder, an adapter run (adapters merged) or a Hugging
    Face GPT-2 folder: what `sample`, `eval`, `serve` and `export` start from.

    Args:
        path: the folder.
        device: "auto", "cpu", "cuda", "mps" or a torch.device.
        tokenizer_required: raise if the folder has no tokenizer (else the tokenizer is None).
        allow_nonfinite: accept NaN or infinite weights (refused by default).

    Raises:
        CheckpointError, TokenizerError: the folder cannot be used (a folder without a tokenizer
            included).
    """
    if not isinstance(device, torch.device):
        device = resolve_device(device)
    model = load(path, device=device, allow_nonfinite=allow_nonfinite, merge=True)
    tokenizer = folder_tokenizer(path)
    if tokenizer is None:
        if tokenizer_required:
            wanted = ("tokenizer.json, or GPT-2's vocab.json + merges.txt" if is_hf_folder(path)
                      else RunFolder(path).tokenizer_file.name)
            raise TokenizerError(f"{path}: no tokenizer ({wanted})")
        return model, None
    if tokenizer.vocab_size > model.config.vocab_size:
        raise TokenizerError(
            f"{path}: the tokenizer has {tokenizer.vocab_size:,} tokens but the model only {model.config.vocab_size:,}"
        )
    return model, tokenizer


# ---- Hugging Face folders and adapter runs ---------------------------------------------------


def import_hf(src: str | Path, out: str | Path) -> tuple[GPT, Tokenizer | None]:
    """Turn a Hugging Face GPT-2 folder into a tinygpt run folder (config.json, model.safetensors,
    tokenizer.json when the folder has a tokenizer), written whole or not at all (fileio.new_folder).

    Args:
        src: the Hugging Face folder (safetensors; pickles are refused).
        out: the run folder to create; it must not exist yet or be empty.

    Returns:
        (the model, its tokenizer or None), as saved in `out`.
    """
    src, out = Path(src), Path(out)
    RunFolder(out).check_empty("import")
    model = load_hf(src)
    tokenizer = load_hf_tokenizer(src)
    if tokenizer is not None and tokenizer.vocab_size > model.config.vocab_size:
        raise TokenizerError(
            f"{src}: the tokenizer has {tokenizer.vocab_size:,} tokens but the model only {model.config.vocab_size:,}"
        )
    with new_folder(out) as tmp:  # a kill leaves no half-written run to block the rerun
        save(model, tmp, tokenizer)
    return model, tokenizer


def folder_tokenizer(path: str | Path, base: str | Path | None = None) -> Tokenizer | None:
    """The tokenizer a model folder carries (a run's tokenizer.json, a Hugging Face folder's own files; a
    PEFT adapter's, which has none of its own, is its base's), or None.

    Args:
        path: the folder.
        base: an adapter run's base, where it is not the one the run names.
    """
    path, folder = Path(path), RunFolder(path)
    if is_hf_folder(path):
        return load_hf_tokenizer(path)
    if folder.tokenizer_file.exists():
        return read_tokenizer(path)
    if folder.is_adapter_run():
        base = folder.adapter_run(base).base
        return None if RunFolder(base).is_adapter_run() else folder_tokenizer(base)
    return None


def load_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer of what `load` opens (a run, a Hugging Face folder, an adapter run: its base's), of a
    data folder, or a tokenizer JSON file.

    Args:
        path: the folder or file.

    Raises:
        TokenizerError: no tokenizer there, or one that does not load.
    """
    path = Path(path).expanduser()
    found = folder_tokenizer(path) if path.is_dir() else None
    return found if found is not None else read_tokenizer(path)


def save_adapter_run(
    model: GPT,
    out: str | Path,
    base: str | Path,
    tokenizer=None,
    *,
    base_checksum: str | None = None,
    step: int | None = None,
) -> Path:
    """Write an adapter run: PEFT's adapter_config.json and adapter_model.safetensors, tinygpt_adapter.json
    (the base's path and checksum), config.json and tokenizer.json.

    Args:
        model: the adapted model (apply_lora), whose frozen weights are the base's.
        out: the run folder; created if needed. Files already there are replaced atomically (an
            adapter run of the first format is rewritten in PEFT's).
        base: the base model's folder (a tinygpt run or a Hugging Face GPT-2 folder); kept as given
            when absolute, else stored relative to `out` (adapter_config.json's
            base_model_name_or_path, which PEFT resolves itself, is the path as given).
        tokenizer: written as tokenizer.json; None copies the base's (when it has one).
        base_checksum: weights_checksum of the base, when the caller has it (a training loop saving
            every few hundred steps computes it once); default: computed from the model's frozen weights.
        step: the training step the adapters belong to (stored in the safetensors metadata).

    Returns:
        The folder.

    Raises:
        ConfigError: the model has no adapters, or its architecture has no PEFT naming.
        CheckpointError: the base is missing or is itself an adapter run, or `out` holds a full model.
    """
    config = lora_config_of(model)
    tensors = adapter_state_dict(model)  # raises for a model without adapters
    out, base, folder = Path(out), Path(base), RunFolder(out)
    if not base.is_dir():
        raise CheckpointError(f"{base}: no such base model folder")
    if RunFolder(base).is_adapter_run():
        raise CheckpointError(f"{base} is an adapter run: the base of adapters must be a full model (merge it first)")
    if folder.weights_file.exists():
        raise CheckpointError(f"{out} holds a full model ({folder.weights_file.name}); write the adapters to another "
                              "folder")
    settings = peft_config(config, model.config, str(base))
    out.mkdir(parents=True, exist_ok=True)
    checksum = base_checksum or weights_checksum(model)
    metadata = {"format": "pt", "step": str(step if step is not None else -1)}
    state = {k: v.contiguous().cpu() for k, v in to_peft_state_dict(tensors, model.config).items()}
    atomic_write(folder.adapter_weights_file, lambda tmp: save_file(state, str(tmp), metadata=metadata))
    tokenizer = tokenizer if tokenizer is not None else folder_tokenizer(base)
    if tokenizer is not None:
        tokenizer.save(folder.tokenizer_file)
    write_json(folder.config_file, model.config.to_dict())
    folder.write_adapter_base(base, checksum)
    write_json(folder.adapter_config_file, settings)  # last: it is what makes the folder an adapter run
    folder.v1_weights_file.unlink(missing_ok=True)  # a first-format run's adapters, rewritten above
    return out


def _check_same_architecture(run: Path, base: str, model: GPT) -> GPTConfig:
    """The run's config.json must describe the base it loads, but for what fine-tuning may set on its
    own: dropout, and a block_size shorter than the base's (the position embedding cropped). The
    run's config (the base's when the run has none)."""
    folder = RunFolder(run)
    if not folder.config_file.exists():
        return model.config
    saved = folder.read_config()
    differ = [f.name for f in dataclasses.fields(GPTConfig)
              if f.name != "dropout" and getattr(saved, f.name) != getattr(model.config, f.name)
              and not (f.name == "block_size" and saved.block_size < model.config.block_size)]
    if differ:
        raise CheckpointError(f"{run}: the base model {base} is not the architecture these adapters were trained on "
                              f"({', '.join(differ)} differ from {folder.config_file})")
    return saved


def load_adapter_run(
    run: str | Path,
    *,
    device: str | torch.device = "cpu",
    allow_nonfinite: bool = False,
    merge_adapters: bool = False,
    base: str | Path | None = None, dtype: torch.dtype | None = None,
) -> GPT:
    """The model of an adapter run, in eval mode: its base, checked, with the adapters applied.

    Args:
        run: the adapter run folder (or a PEFT adapter trained elsewhere: see read_adapter_config).
        device: where to put the weights.
        allow_nonfinite: accept NaN or infinite weights (base or adapters).
        merge_adapters: fold the adapters into the weights (a plain GPT, as fast as the base).
        base: the base model's folder, where it is not the one the run names (a base moved, or
            exported): its weights are checked against the run's checksum all the same.
        dtype: the model's, adapters included (default: the base's); float32 keeps float32 adapters unrounded.

    Raises:
        CheckpointError: a damaged adapter file, or a base that is missing, is not a full model, or
            whose weights are not the ones the adapters were trained on (the message names its path).
    """
    run, folder = Path(run), RunFolder(run)
    shown = None if base is None else str(base)
    if base is not None and not Path(base).is_dir():
        raise CheckpointError(f"{run}: its base model {shown} is missing")
    info = folder.adapter_run(base)
    config, shown = info.lora, shown or info.shown_base
    bookkeeping = folder.adapter_base_file.name
    if not info.base.is_dir():
        raise CheckpointError(f"{run}: its base model {shown} is missing ({bookkeeping} names it); "
                              "put the base back there or edit base.path")
    if RunFolder(info.base).is_adapter_run():
        raise CheckpointError(f"{run}: its base model {shown} is itself an adapter run; the base must be a full model")
    model = load(info.base, device="cpu", allow_nonfinite=allow_nonfinite)
    checksum = weights_checksum(model)
    if info.checksum is not None and checksum != info.checksum:
        raise CheckpointError(f"{run}: the base model {shown} has changed since these adapters were trained "
                              f"(its weights' checksum is {checksum[:19]}..., {bookkeeping} expects "
                              f"{info.checksum[:19]}...)")
    model = model if dtype is None else model.to(dtype)  # after the checksum, which is of the weights as stored
    model = reconfigured(model, _check_same_architecture(run, shown, model), shown)  # a cropped context
    tensors, _ = read_weights(info.weights)
    tensors = {info.names.get(k, k): t for k, t in tensors.items()}
    apply_lora(model, config.rank, config.alpha, config.targets, config.dropout)
    load_adapter_state_dict(model, tensors, str(info.weights), allow_nonfinite=allow_nonfinite)
    if merge_adapters:
        merge_lora(model)
    return model.to(device).eval()


def check_merge_target(out: str | Path, *taken: str | Path) -> None:
    """Refuse `out` as a merged run's folder: it exists (and is not an empty folder), or it is one
    of `taken` (folders in use, such as the run being trained and its base).

    Raises:
        CheckpointError: naming the folder.
    """
    out = Path(out)
    if any(out.resolve() == Path(t).resolve() for t in taken):
        raise CheckpointError(f"{out} is a folder this job reads or writes (the run or its base); "
                              "merge into a new folder")
    RunFolder(out).check_empty("merge")


def merge_run(run: str | Path, out: str | Path, base: str | Path | None = None) -> tuple[GPT, Tokenizer | None]:
    """Write an adapter run's model, adapters folded in, as a plain run (model.safetensors, config.json,
    tokenizer.json): what `tinygpt merge` does. The run is written in a temporary folder beside
    `out` and renamed into place, so a kill leaves no partial `out` (fileio.new_folder).

    Args:
        run: the adapter run (or a PEFT adapter trained elsewhere).
        out: the plain run folder to create; it must not exist yet or be empty.
        base: the base model's folder, where it is not the one the run names.

    Returns:
        (the merged model, its tokenizer or None).

    Raises:
        CheckpointError: `run` is not an adapter run or cannot be loaded, or `out` is taken.
    """
    run, out, folder = Path(run), Path(out), RunFolder(run)
    if not folder.is_adapter_run():
        raise CheckpointError(f"{run}: not an adapter run (no {folder.adapter_config_file.name}), so there is "
                              "nothing to merge")
    check_merge_target(out)
    model = load_adapter_run(run, merge_adapters=True, base=base)
    tokenizer = folder_tokenizer(run, base)
    with new_folder(out) as tmp:  # a kill leaves no half-written run to block the rerun
        save(model, tmp, tokenizer)
    return model, tokenizer


def import_peft(src: str | Path, out: str | Path, base: str | Path | None = None) -> tuple[GPT, Tokenizer | None]:
    """Turn a PEFT LoRA adapter trained elsewhere (adapter_config.json + adapter_model.safetensors) into a
    tinygpt adapter run on `base`: the same adapters, and tinygpt_adapter.json naming the base and its
    checksum, config.json and the tokenizer, so every command takes it as it takes a run.

    Args:
        src: the PEFT adapter's folder.
        out: the adapter run to create; it must not exist yet or be empty.
        base: the base model's folder (a tinygpt run or a Hugging Face folder); default: the
            adapter's base_model_name_or_path, when that is a folder.

    Returns:
        (the adapted model, its tokenizer or None), as saved in `out`.

    Raises:
        CheckpointError: `src` is not a LoRA adapter tinygpt computes, the base does not fit it, or
            `out` is taken.
    """
    src, out, folder = Path(src), Path(out), RunFolder(src)
    if not folder.is_adapter_run():
        raise CheckpointError(f"{src}: not a PEFT adapter (no {folder.adapter_config_file.name})")
    RunFolder(out).check_empty("import")
    info = folder.adapter_run(base)
    model = load_adapter_run(src, base=info.base)
    tokenizer = folder_tokenizer(src, info.base)
    save_adapter_run(model, out, base if base is not None else info.base, tokenizer, base_checksum=info.checksum)
    return model, tokenizer


# ---- training state ---------------------------------------------------------------------------


def save_training(
    run: Path, model: GPT, state: dict[str, Any], tokenizer=None, *, state_dict: dict[str, torch.Tensor] | None = None,
    adapter_base: Path | None = None, base_checksum: str | None = None,
) -> None:
    """Save weights and training state as one consistent pair (see the module docstring); state_dict as in save().
    With adapter_base, the pair is an adapter run's adapters (save_adapter_run, its base and base_checksum)
    and the state."""
    run, folder = Path(run), RunFolder(run)
    step = int(state["step"])
    state_tmp = folder.pending_state_file
    weights_replaced = False
    try:
        # complete and synced before the weights are replaced; through a Python file, so that a failed
        # write (a full disk) surfaces as the OSError behind torch's RuntimeError
        with open(state_tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        if adapter_base is not None:
            save_adapter_run(model, run, adapter_base, tokenizer, base_checksum=base_checksum, step=step)
        else:
            save(model, run, tokenizer, step=step, state_dict=state_dict)
        weights_replaced = True
        os.replace(state_tmp, folder.state_file)
        fsync_dir(run)
    except BaseException as e:
        if not weights_replaced:  # a failed save (ENOSPC, ...) leaves the previous pair as it was
            state_tmp.unlink(missing_ok=True)
        cause = _os_error(e)
        if cause is None:
            raise
        kept = "a --resume completes it" if weights_replaced else "the previous checkpoint is unchanged"
        if not weights_replaced and folder.has_weights():
            kept = f"the checkpoint of step {folder.weights_step()} is unchanged"
        raise CheckpointError(f"{run}: could not save the checkpoint of step {step}: {cause.strerror or cause}; "
                              f"{kept}") from e


def _os_error(e: BaseException | None) -> OSError | None:
    """The operating system's error behind a failed write, if that is what `e` is: torch.save raises
    a RuntimeError whose context is the OSError, safetensors a SafetensorError ending '(os error N)'."""
    while e is not None and not isinstance(e, (KeyboardInterrupt, SystemExit)):
        if isinstance(e, OSError):
            return e
        code = re.search(r"\(os error (\d+)\)", str(e)) if isinstance(e, SafetensorError) else None
        if code:
            return OSError(int(code.group(1)), os.strerror(int(code.group(1))))
        e = e.__cause__ or e.__context__
    return None
