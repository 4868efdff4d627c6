"""Run folders: weights in safetensors, config.json, the tokenizer, and the training state.

    RUN/config.json         the GPTConfig, as JSON
    RUN/model.safetensors   the weights (a tied head is stored once, as wte.weight)
    RUN/tokenizer.json      the tokenizer, when there is one
    RUN/train_state.pt      optimizer, schedule, RNG states, data position, step (training runs)

An adapter run holds LoRA adapters instead of model.safetensors (adapter_config.json names the
base model and a checksum of its weights; see tinygpt.lora): `load` reads it like any run.

Every file is written atomically: to a temporary file in the same folder, fsync, rename. The
weights and the training state are two files, so a save renames the weights first and the state
last; a kill between the two renames leaves the new state complete as `train_state.pt.tmp`, and
the next resume finishes the rename (both files carry the step, so the pair is checked).
Nothing here unpickles: safetensors for tensors, torch.load(weights_only=True) for the state.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from .config import GPTConfig
from .errors import CheckpointError, ConfigError
from .fileio import atomic_write, check_regular_file, fsync_dir, read_json, write_json
from .model import GPT

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
TOKENIZER = "tokenizer.json"
STATE = "train_state.pt"
ADAPTER_CONFIG = "adapter_config.json"  # what makes a folder an adapter run (tinygpt.lora)
ADAPTER_WEIGHTS = "adapter.safetensors"
TIED_KEY = "lm_head.weight"
# A safetensors header is JSON naming every tensor: about 1 KB per layer (GPT-2 XL's is 64 KB).
# safetensors itself allows 100 MB, but parsed JSON can take 25x its size in memory, so tinygpt
# refuses a header over 8 MB before reading it, and one with more JSON objects and arrays than
# MAX_TENSORS entries need (one object and two arrays each) before parsing it.
MAX_HEADER_BYTES = 8 * 1024 * 1024
MAX_TENSORS = 65536
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
               "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
_LAYER = re.compile(r"(?:transformer\.)?h\.(\d+)\.")  # the block index in a parameter name


def _weights(model: GPT, state: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    if getattr(model, "inference_only", False):  # set by tinygpt.quantize: int8 or packed weights
        raise CheckpointError("a model converted by tinygpt.quantize is for inference only: save it before quantizing")
    state = dict(model.state_dict() if state is None else state)
    if any(k.endswith((".lora_A", ".lora_B")) for k in state):
        raise CheckpointError("the model has LoRA adapters: save them with tinygpt.lora.save_adapter_run, "
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
        raise CheckpointError(f"{path}: no such run folder")
    if not (path / CONFIG).exists() or not ((path / WEIGHTS).exists() or is_adapter_run(path)):
        raise CheckpointError(f"{path}: not a tinygpt run (it needs {CONFIG} and {WEIGHTS})")
    try:
        return GPTConfig.from_dict(read_json(path / CONFIG, CheckpointError))
    except ConfigError as e:
        raise CheckpointError(f"{path / CONFIG}: {e}") from None


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError(f"the key {next(k for k in keys if keys.count(k) > 1)!r} appears twice")
    return dict(pairs)


def _no_float(text: str) -> float:
    raise ValueError(f"a number {text[:20]!r} that is not an integer")  # no field of a header holds one


def read_header(file: str | Path) -> dict[str, dict[str, Any]]:
    """A safetensors file's tensor entries (name -> dtype, shape, data_offsets), checked strictly
    before any tensor data is read.

    The file must be a regular file whose 8-byte header length fits both the file and
    MAX_HEADER_BYTES (checked before the header is read); the header must be a UTF-8 JSON object
    without duplicate keys or fractions, and with no more objects and arrays than MAX_TENSORS
    entries need (checked before it is parsed); each tensor's shape and dtype must give exactly its
    byte span; and the spans must tile the data section from its start to the end of the file, with
    no gap, overlap or trailing byte. The safetensors library checks most of this too, but keeps
    the last of two duplicate keys and allows a 100 MB header.

    Raises:
        CheckpointError: naming the first problem found.
    """
    file = Path(file)
    size = check_regular_file(file, CheckpointError)

    def bad(why: str) -> CheckpointError:
        return CheckpointError(f"{file}: corrupt or truncated safetensors file: {why}")

    if size < 8:
        raise bad(f"{size} bytes, too short to hold the header length")
    with open(file, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > MAX_HEADER_BYTES:
            raise bad(f"the header claims {n:,} bytes, more than tinygpt reads ({MAX_HEADER_BYTES:,})")
        if n > size - 8:
            raise bad(f"the header claims {n:,} bytes but only {size - 8:,} follow the length")
        raw = f.read(n)
    if raw.count(b"{") + raw.count(b"[") > 3 * MAX_TENSORS + 2:
        raise bad(f"the header holds more JSON objects and arrays than {MAX_TENSORS:,} tensors need")
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates, parse_float=_no_float)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:  # JSONDecodeError is a ValueError
        why = "nested too deeply" if isinstance(e, RecursionError) else str(e)
        raise bad(f"the header is not valid JSON ({why})") from None
    del raw
    if not isinstance(header, dict):
        raise bad(f"the header is a JSON {type(header).__name__}, not an object")
    meta = header.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise bad("__metadata__ must map strings to strings")
    spans = []
    for name, info in header.items():
        if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= set(info):
            raise bad(f"tensor {name!r} lacks dtype, shape or data_offsets")
        dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if dtype not in DTYPE_BYTES:
            raise bad(f"tensor {name!r} has an unknown dtype {dtype!r}")
        if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
            raise bad(f"tensor {name!r} has shape {shape!r}, not a list of non-negative integers")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
                and 0 <= offsets[0] <= offsets[1]):
            raise bad(f"tensor {name!r} has data_offsets {offsets!r}, not [begin, end] with 0 <= begin <= end")
        need = math.prod(shape) * DTYPE_BYTES[dtype]  # Python integers: a huge shape cannot overflow
        if need != offsets[1] - offsets[0]:
            raise bad(f"tensor {name!r}: shape {shape} of {dtype} needs {need:,} bytes but its offsets span "
                      f"{offsets[1] - offsets[0]:,}")
        spans.append((offsets[0], offsets[1], name))
    end = 0
    for begin, stop, name in sorted(spans):
        if begin != end:
            raise bad(f"tensor {name!r} starts at byte {begin:,} of the data, "
                      f"{'overlapping the tensor before it' if begin < end else f'leaving a gap after byte {end:,}'}")
        end = stop
    data = size - 8 - n
    if end != data:
        raise bad(f"the tensors need {end:,} bytes of data but the file holds {data:,}"
                  + (" (trailing bytes)" if end < data else " (truncated)"))
    header["__metadata__"] = meta
    return header


def check_layers(config: GPTConfig, names: Any, where: str) -> None:
    """Refuse weights whose block indices (h.N.) are not exactly 0..n_layer-1, before a model of
    config's size is built: a config.json claiming a million layers must not cost a million blocks."""
    layers = {int(m.group(1)) for name in names if (m := _LAYER.match(name))}
    if len(layers) != config.n_layer or (layers and (min(layers) != 0 or max(layers) != config.n_layer - 1)):
        raise CheckpointError(
            f"{where}: config.json disagrees with the weights: n_layer={config.n_layer} but the weights hold "
            f"{len(layers)} layers"
        )


def _read_weights(file: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    read_header(file)
    try:
        with safe_open(str(file), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}, (f.metadata() or {})
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"{file}: corrupt or truncated safetensors file ({e})") from None


def weights_step(path: str | Path) -> int:
    """The training step stored with a run's weights (-1 when saved outside training)."""
    file = Path(path) / WEIGHTS
    step = read_header(file)["__metadata__"].get("step", "-1")
    if not re.fullmatch(r"-1|[0-9]+", step):
        raise CheckpointError(f"{file}: the step in its metadata is {step!r}, not a number")
    return int(step)


def is_hf_config(data: Any) -> bool:
    """True for the content of a Hugging Face config.json: it names a `model_type` (a run's never does)."""
    return isinstance(data, dict) and "model_type" in data


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


def is_adapter_run(path: str | Path) -> bool:
    """True for an adapter run: a folder holding adapter_config.json (written by tinygpt.lora)."""
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
        from .lora import load_adapter_run  # a peer module, as hf_gpt2 is

        return load_adapter_run(path, device=device, allow_nonfinite=allow_nonfinite, merge_adapters=merge)
    if is_hf_folder(path):
        from .interop.hf_gpt2 import load_hf  # a peer module; imported here so run folders never need it

        return load_hf(path, device=device, allow_nonfinite=allow_nonfinite)
    config = load_config(path)
    tensors, _ = _read_weights(path / WEIGHTS)
    check_layers(config, tensors, str(path))  # before a model of config's size is built
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
            raise CheckpointError(f"{where}: {name} holds NaN or infinite values (--allow-nonfinite loads them)")
    tensors = dict(tensors)
    if config.tie_weights:
        tensors[TIED_KEY] = tensors["wte.weight"]
    model.load_state_dict(tensors, strict=True, assign=True)
    if config.tie_weights:
        model.lm_head.weight = model.wte.weight  # assign=True replaced the Parameter; tie again
    return model.to(device).eval()


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
    from .device import resolve_device
    from .errors import TokenizerError
    from .tokenizer import load_tokenizer

    if not isinstance(device, torch.device):
        device = resolve_device(device)
    model = load(path, device=device, allow_nonfinite=allow_nonfinite, merge=True)
    if is_hf_folder(path):
        from .interop.hf_gpt2 import load_hf_tokenizer

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
        # complete and synced before the weights are replaced; through a Python file, so that a failed
        # write (a full disk) surfaces as the OSError behind torch's RuntimeError
        with open(state_tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
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
        if not weights_replaced and (run / WEIGHTS).exists():
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
