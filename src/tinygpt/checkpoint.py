"""Run folders: weights in safetensors, config.json, the tokenizer, the training state, adapters.

    RUN/config.json         the GPTConfig, as JSON
    RUN/model.safetensors   the weights (a tied head is stored once, as wte.weight)
    RUN/tokenizer.json      the tokenizer, when there is one
    RUN/train_state.pt      optimizer, schedule, RNG states, data position, step (training runs)

An adapter run holds LoRA adapters (tinygpt.lora) instead of model.safetensors and names the base
model they belong to:

    RUN/adapter_config.json   the LoRA settings, the base's path and a checksum of its weights
    RUN/adapter.safetensors   the adapters (a few MB where the base is hundreds)
    RUN/config.json           the base's GPTConfig, so load_config and `tinygpt params` read the run
    RUN/tokenizer.json        the base's tokenizer, copied, so sample, eval and serve need nothing else

The base's path is kept as given when absolute; a relative one is stored relative to the adapter
run's folder (so the two folders can move together) and resolved against it. The checksum is
tinygpt.lora.weights_checksum, the same whether the base is a tinygpt run or a Hugging Face folder.
`load` reads every kind of folder: a run, an adapter run (its base, checked against the checksum,
with the adapters applied) and a Hugging Face GPT-2 folder (tinygpt.interop.hf_gpt2).

Every file is written atomically: to a temporary file in the same folder, fsync, rename. The
weights and the training state are two files, so a save renames the weights first and the state
last; a kill between the two renames leaves the new state complete as `train_state.pt.tmp`, and
the next resume finishes the rename (both files carry the step, so the pair is checked).
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

from .config import GPTConfig, LoraConfig
from .device import resolve_device
from .errors import CheckpointError, ConfigError, TokenizerError
from .fileio import atomic_write, check_folder_path, check_regular_file, fsync_dir, read_json, write_json
from .interop.hf import is_hf_folder, load_hf
from .interop.hf_tokenizer import load_hf_tokenizer
from .lora import adapter_state_dict, apply_lora, load_adapter_state_dict, lora_config_of, weights_checksum
from .lora import merge as merge_lora
from .model import GPT
from .tokenizer import Tokenizer, load_tokenizer
from .weights import TIED_KEY, check_layers, model_from_tensors, read_header, read_weights, reconfigured

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
TOKENIZER = "tokenizer.json"
STATE = "train_state.pt"
ADAPTER_CONFIG = "adapter_config.json"  # what makes a folder an adapter run
ADAPTER_WEIGHTS = "adapter.safetensors"
ADAPTER_FORMAT = "tinygpt-lora"
ADAPTER_VERSION = 1


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
        raise CheckpointError(f"{path}: {'a file, not a run folder' if path.exists() else 'no such run folder'}")
    if not (path / CONFIG).exists() or not ((path / WEIGHTS).exists() or is_adapter_run(path)):
        raise CheckpointError(f"{path}: not a tinygpt run (it needs {CONFIG} and {WEIGHTS})")
    try:
        return GPTConfig.from_dict(read_json(path / CONFIG, CheckpointError))
    except ConfigError as e:
        raise CheckpointError(f"{path / CONFIG}: {e}") from None


def weights_file(path: str | Path) -> Path:
    """The file holding what a run trains: adapter.safetensors in an adapter run, else model.safetensors."""
    return Path(path) / (ADAPTER_WEIGHTS if is_adapter_run(path) else WEIGHTS)


def has_weights(path: str | Path) -> bool:
    """Whether a folder holds a run's weights or an adapter run's adapters."""
    return weights_file(path).exists()


def weights_step(path: str | Path) -> int:
    """The training step stored with a run's weights, or an adapter run's adapters (-1 when saved
    outside training)."""
    file = weights_file(path)
    step = read_header(file)["__metadata__"].get("step", "-1")
    if not re.fullmatch(r"-1|[0-9]+", step):
        raise CheckpointError(f"{file}: the step in its metadata is {step!r}, not a number")
    return int(step)


def is_adapter_run(path: str | Path) -> bool:
    """True for an adapter run: a folder holding adapter_config.json (written by save_adapter_run)."""
    return (Path(path) / ADAPTER_CONFIG).is_file()


def load(
    path: str | Path,
    *,
    device: str | torch.device = "cpu",
    allow_nonfinite: bool = False,
    merge: bool = False,
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

    Raises:
        CheckpointError: not a run, a corrupt file, a config.json that disagrees with the weights,
            or an adapter run whose base is missing or has changed.
    """
    path = Path(path)
    if is_adapter_run(path):
        return load_adapter_run(path, device=device, allow_nonfinite=allow_nonfinite, merge_adapters=merge)
    if is_hf_folder(path):
        return load_hf(path, device=device, allow_nonfinite=allow_nonfinite)
    config = load_config(path)
    tensors, _ = read_weights(path / WEIGHTS)
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
    if is_hf_folder(path):
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


# ---- Hugging Face folders and adapter runs ---------------------------------------------------


def import_hf(src: str | Path, out: str | Path) -> tuple[GPT, Tokenizer | None]:
    """Turn a Hugging Face GPT-2 folder into a tinygpt run folder (config.json, model.safetensors,
    tokenizer.json when the folder has a tokenizer).

    Args:
        src: the Hugging Face folder (safetensors; pickles are refused).
        out: the run folder to create; it must not exist yet or be empty.

    Returns:
        (the model, its tokenizer or None), as saved in `out`.
    """
    src, out = Path(src), Path(out)
    _check_new_run(out, "import")
    model = load_hf(src)
    tokenizer = load_hf_tokenizer(src)
    if tokenizer is not None and tokenizer.vocab_size > model.config.vocab_size:
        raise TokenizerError(
            f"{src}: the tokenizer has {tokenizer.vocab_size:,} tokens but the model only {model.config.vocab_size:,}"
        )
    save(model, out, tokenizer)
    return model, tokenizer


def _stored_base(base: Path, out: Path) -> str:
    """The base's path as adapter_config.json keeps it: absolute as given, else relative to `out`."""
    if base.is_absolute():
        return str(base)
    return os.path.relpath(os.path.abspath(base), os.path.abspath(out))


def folder_tokenizer(base: Path) -> Tokenizer | None:
    """The tokenizer a model folder carries (a run's tokenizer.json, a Hugging Face folder's own files), or None."""
    base = Path(base)
    if is_hf_folder(base):
        return load_hf_tokenizer(base)
    return load_tokenizer(base) if (base / TOKENIZER).exists() else None


def save_adapter_run(
    model: GPT,
    out: str | Path,
    base: str | Path,
    tokenizer=None,
    *,
    base_checksum: str | None = None,
    step: int | None = None,
) -> Path:
    """Write an adapter run: adapter.safetensors, adapter_config.json, config.json, tokenizer.json.

    Args:
        model: the adapted model (apply_lora), whose frozen weights are the base's.
        out: the run folder; created if needed. Files already there are replaced atomically.
        base: the base model's folder (a tinygpt run or a Hugging Face GPT-2 folder); kept as given
            when absolute, else stored relative to `out`.
        tokenizer: written as tokenizer.json; None copies the base's (when it has one).
        base_checksum: weights_checksum of the base, when the caller has it (a training loop saving
            every few hundred steps computes it once); default: computed from the model's frozen weights.
        step: the training step the adapters belong to (stored in the safetensors metadata).

    Returns:
        The folder.

    Raises:
        ConfigError: the model has no adapters.
        CheckpointError: the base is missing or is itself an adapter run, or `out` holds a full model.
    """
    config = lora_config_of(model)
    tensors = adapter_state_dict(model)  # raises for a model without adapters
    out, base = Path(out), Path(base)
    if not base.is_dir():
        raise CheckpointError(f"{base}: no such base model folder")
    if is_adapter_run(base):
        raise CheckpointError(f"{base} is an adapter run: the base of adapters must be a full model (merge it first)")
    if (out / WEIGHTS).exists():
        raise CheckpointError(f"{out} holds a full model ({WEIGHTS}); write the adapters to another folder")
    out.mkdir(parents=True, exist_ok=True)
    info = {
        "format": ADAPTER_FORMAT,
        "version": ADAPTER_VERSION,
        "lora": config.to_dict(),
        "base": {"path": _stored_base(base, out), "checksum": base_checksum or weights_checksum(model)},
    }
    metadata = {"format": "pt", "step": str(step if step is not None else -1)}
    state = {k: v.contiguous().cpu() for k, v in tensors.items()}
    atomic_write(out / ADAPTER_WEIGHTS, lambda tmp: save_file(state, str(tmp), metadata=metadata))
    tokenizer = tokenizer if tokenizer is not None else folder_tokenizer(base)
    if tokenizer is not None:
        tokenizer.save(out / TOKENIZER)
    write_json(out / CONFIG, model.config.to_dict())
    write_json(out / ADAPTER_CONFIG, info)  # last: it is what makes the folder an adapter run
    return out


@dataclasses.dataclass(frozen=True)
class AdapterRun:
    """What an adapter run's adapter_config.json says.

    Args:
        lora: the LoRA settings the adapters were trained with.
        base: the base model's folder, resolved (a relative path is relative to the adapter run).
        checksum: weights_checksum of the base the adapters were trained on.
    """

    lora: LoraConfig
    base: Path
    checksum: str

    @property
    def shown_base(self) -> str:
        """The base's path for messages, ".." folded away lexically (lora/../base -> base); loading
        follows the path as stored, which differs only where a symlink is in it."""
        return os.path.normpath(self.base)


def read_adapter_config(run: str | Path) -> AdapterRun:
    """The settings and the base of an adapter run (its adapter_config.json, checked).

    Raises:
        CheckpointError: the file is missing, not JSON, or not a tinygpt adapter config.
    """
    run = Path(run)
    file = run / ADAPTER_CONFIG
    info = read_json(file, CheckpointError)
    if not isinstance(info, dict) or info.get("format") != ADAPTER_FORMAT:
        raise CheckpointError(f"{file}: not a tinygpt adapter config (no \"format\": \"{ADAPTER_FORMAT}\")")
    if info.get("version") != ADAPTER_VERSION:
        raise CheckpointError(f"{file}: version {info.get('version')!r}; this tinygpt reads version {ADAPTER_VERSION}")
    base = info.get("base")
    if not (isinstance(base, dict) and isinstance(base.get("path"), str) and base["path"]
            and isinstance(base.get("checksum"), str)):
        raise CheckpointError(f"{file}: \"base\" must hold the base model's \"path\" and \"checksum\"")
    try:
        lora = LoraConfig.from_dict(info.get("lora"))
    except ConfigError as e:
        raise CheckpointError(f"{file}: {e}") from None
    return AdapterRun(lora=lora, base=run / base["path"], checksum=base["checksum"])  # an absolute path wins


def _check_same_architecture(run: Path, base: str, model: GPT) -> GPTConfig:
    """The run's config.json must describe the base it loads, but for what fine-tuning may set on its
    own: dropout, and a block_size shorter than the base's (the position embedding cropped). The
    run's config (the base's when the run has none)."""
    if not (run / CONFIG).exists():
        return model.config
    try:
        saved = GPTConfig.from_dict(read_json(run / CONFIG, CheckpointError))
    except ConfigError as e:
        raise CheckpointError(f"{run / CONFIG}: {e}") from None
    differ = [f.name for f in dataclasses.fields(GPTConfig)
              if f.name != "dropout" and getattr(saved, f.name) != getattr(model.config, f.name)
              and not (f.name == "block_size" and saved.block_size < model.config.block_size)]
    if differ:
        raise CheckpointError(f"{run}: the base model {base} is not the architecture these adapters were trained on "
                              f"({', '.join(differ)} differ from {run / CONFIG})")
    return saved


def load_adapter_run(
    run: str | Path,
    *,
    device: str | torch.device = "cpu",
    allow_nonfinite: bool = False,
    merge_adapters: bool = False,
    base: str | Path | None = None,
) -> GPT:
    """The model of an adapter run, in eval mode: its base, checked, with the adapters applied.

    Args:
        run: the adapter run folder.
        device: where to put the weights.
        allow_nonfinite: accept NaN or infinite weights (base or adapters).
        merge_adapters: fold the adapters into the weights (a plain GPT, as fast as the base).
        base: the base model's folder, where it is not the one the run names (a base moved, or
            exported): its weights are checked against the run's checksum all the same.

    Raises:
        CheckpointError: a damaged adapter file, or a base that is missing, is not a full model, or
            whose weights are not the ones the adapters were trained on (the message names its path).
    """
    run = Path(run)
    info = read_adapter_config(run)
    config = info.lora
    base, shown = (info.base, info.shown_base) if base is None else (Path(base), str(base))
    if not base.is_dir():
        raise CheckpointError(f"{run}: its base model {shown} is missing ({ADAPTER_CONFIG} names it); "
                              "put the base back there or edit base.path")
    if is_adapter_run(base):
        raise CheckpointError(f"{run}: its base model {shown} is itself an adapter run; the base must be a full model")
    model = load(base, device="cpu", allow_nonfinite=allow_nonfinite)
    checksum = weights_checksum(model)
    if checksum != info.checksum:
        raise CheckpointError(f"{run}: the base model {shown} has changed since these adapters were trained "
                              f"(its weights' checksum is {checksum[:19]}..., {ADAPTER_CONFIG} expects "
                              f"{info.checksum[:19]}...)")
    model = reconfigured(model, _check_same_architecture(run, shown, model), shown)  # a cropped context
    tensors, _ = read_weights(run / ADAPTER_WEIGHTS)
    apply_lora(model, config.rank, config.alpha, config.targets, config.dropout)
    load_adapter_state_dict(model, tensors, str(run / ADAPTER_WEIGHTS), allow_nonfinite=allow_nonfinite)
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
    _check_new_run(out, "merge")


def _check_new_run(out: Path, job: str) -> None:
    """Refuse `out` as the folder of a run that `job` ("import", "merge") makes: something already
    there (anything but an empty folder), a path below a file, or where nothing can be written."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointError(f"{out} already exists; {job} into a new folder")
    check_folder_path(out, CheckpointError)


def merge_run(run: str | Path, out: str | Path) -> tuple[GPT, Tokenizer | None]:
    """Write an adapter run's model, adapters folded in, as a plain run (model.safetensors, config.json,
    tokenizer.json): what `tinygpt merge` does.

    Args:
        run: the adapter run.
        out: the plain run folder to create; it must not exist yet or be empty.

    Returns:
        (the merged model, its tokenizer or None).

    Raises:
        CheckpointError: `run` is not an adapter run or cannot be loaded, or `out` is taken.
    """
    run, out = Path(run), Path(out)
    if not is_adapter_run(run):
        raise CheckpointError(f"{run}: not an adapter run (no {ADAPTER_CONFIG}), so there is nothing to merge")
    check_merge_target(out)
    model = load_adapter_run(run, merge_adapters=True)
    tokenizer = load_tokenizer(run) if (run / TOKENIZER).exists() else None
    save(model, out, tokenizer)
    return model, tokenizer


# ---- training state ---------------------------------------------------------------------------


def save_training(
    run: Path, model: GPT, state: dict[str, Any], tokenizer=None, *, state_dict: dict[str, torch.Tensor] | None = None,
    adapter_base: Path | None = None, base_checksum: str | None = None,
) -> None:
    """Save weights and training state as one consistent pair (see the module docstring); state_dict as in save().
    With adapter_base, the pair is an adapter run's adapters (save_adapter_run, its base and base_checksum)
    and the state."""
    run = Path(run)
    step = int(state["step"])
    state_tmp = run / (STATE + ".tmp")
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
        os.replace(state_tmp, run / STATE)
        fsync_dir(run)
    except BaseException as e:
        if not weights_replaced:  # a failed save (ENOSPC, ...) leaves the previous pair as it was
            state_tmp.unlink(missing_ok=True)
        cause = _os_error(e)
        if cause is None:
            raise
        kept = "a --resume completes it" if weights_replaced else "the previous checkpoint is unchanged"
        if not weights_replaced and has_weights(run):
            kept = f"the checkpoint of step {weights_step(run)} is unchanged"
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


def _read_state(file: Path) -> dict[str, Any]:
    check_regular_file(file, CheckpointError)
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # a truncated zip, or an object that weights_only refuses to build
        # torch's message spans lines and suggests weights_only=False, which would run the file's code:
        # keep the reason only
        text = str(e)
        found = re.search(r"WeightsUnpickler error: \s*(.*?)(?: Please use|\n\n|$)", text, re.DOTALL)
        reason = found.group(1).strip() if found else (text.strip().splitlines() or [type(e).__name__])[0]
        if "GLOBAL" in reason:
            reason += ": the file asks to build objects other than tensors and plain data, which tinygpt never does"
        raise CheckpointError(f"{file}: unreadable training state ({reason})") from None


def load_training(run: str | Path) -> dict[str, Any]:
    """The training state of a run, matched to its weights; finishes a save cut short by a kill and
    removes the temporary files such a save leaves (the caller is about to write this run)."""
    run = Path(run)
    step = weights_step(run)
    # temp files of saves a kill cut short: atomic_write's (.NAME.tmp-PID), and safetensors' own (it
    # writes through a .tmpXXXXXX beside its target, the default name of Rust's tempfile crate)
    for stale in [*run.glob(".*.tmp-*"), *run.glob(".tmp??????")]:
        if stale.is_file():
            stale.unlink(missing_ok=True)
    pending = run / (STATE + ".tmp")
    if pending.exists():
        try:
            candidate = _read_state(pending)
        except CheckpointError:
            candidate = None
        if isinstance(candidate, dict) and candidate.get("step") == step:
            os.replace(pending, run / STATE)  # the kill came between the two renames: roll forward
        else:
            pending.unlink()
    if not (run / STATE).exists():
        raise CheckpointError(f"{run}: no {STATE}, so there is no training to resume")
    state = _read_state(run / STATE)
    if not isinstance(state, dict) or type(state.get("step")) is not int:
        raise CheckpointError(f"{run / STATE}: not a training state (no step)")
    if state["step"] != step:
        raise CheckpointError(f"{run}: training state is for step {state.get('step')} but the weights for {step}")
    return state
