"""Reading and checking safetensors weights: below run folders (tinygpt.checkpoint), Hugging Face
folders (tinygpt.interop.hf_gpt2) and adapters (tinygpt.lora), which all read their tensors here.

    read_header(file)                      the tensor entries, checked strictly before any data is read
    read_weights(file)                     the tensors and the metadata of one file
    check_layers(config, names, where)     block indices 0..n_layer-1, before a model is built
    model_from_tensors(config, tensors)    a GPT filled from tinygpt-named tensors, every one checked

Nothing here unpickles: a safetensors file is a JSON header and raw tensor bytes.
"""

from __future__ import annotations

import json
import math
import re
import struct
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from .config.model import GPTConfig
from .errors import CheckpointError
from .fileio import check_regular_file
from .model import GPT

TIED_KEY = "lm_head.weight"  # a tied head is this tensor, stored once as wte.weight
SCORE_KEY = "score.weight"  # a reward model's head (GPTConfig.head "reward"), as Hugging Face names it
# A safetensors header is JSON naming every tensor: about 1 KB per layer (GPT-2 XL's is 64 KB).
# safetensors itself allows 100 MB, but parsed JSON can take 25x its size in memory, so tinygpt
# refuses a header over 8 MB before reading it, and one with more JSON objects and arrays than
# MAX_TENSORS entries need (one object and two arrays each) before parsing it.
MAX_HEADER_BYTES = 8 * 1024 * 1024
MAX_TENSORS = 65536
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
               "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
_LAYER = re.compile(r"(?:transformer\.)?h\.(\d+)\.")  # the block index in a parameter name


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


def read_weights(file: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Every tensor of a safetensors file, by name, and its metadata; the header is checked first
    (read_header), so a hostile file is refused before its data is touched.

    Args:
        file: the .safetensors file.

    Raises:
        CheckpointError: a file that is not a regular file, has a bad header, or is truncated.
    """
    read_header(file)
    try:
        with safe_open(str(file), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}, (f.metadata() or {})
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"{file}: corrupt or truncated safetensors file ({e})") from None


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


def reconfigured(model: GPT, config: GPTConfig, where: str) -> GPT:
    """The same weights under a config that may differ from the model's in two ways only: a shorter
    context (block_size; the position embedding keeps its first rows, as nanoGPT's crop_block_size)
    and dropout. What fine-tuning trains with (its dropout), and what a run fine-tuned with a cropped
    context (before --block-size only bounded the training window) loads and resumes as. (With
    rotary positions a shorter context changes no weight.)

    Args:
        model: a plain GPT (no adapters).
        config: the new settings.
        where: the model's folder, for error messages.

    Raises:
        CheckpointError: any other field differs, or the block_size is longer than the model's.
    """
    old = model.config
    differ = [name for name in GPTConfig.__dataclass_fields__
              if name not in ("block_size", "dropout") and getattr(config, name) != getattr(old, name)]
    if differ:
        raise CheckpointError(f"{where}: {', '.join(differ)} cannot change on a trained model")
    if config.block_size > old.block_size:
        raise CheckpointError(f"{where}: block_size {config.block_size} is longer than the model's "
                              f"{old.block_size}: its position embedding has no rows past that")
    if config == old:
        return model
    device = model.wte.weight.device
    tensors = {k: v.detach() for k, v in model.state_dict().items()}
    if old.tie_weights:
        tensors.pop(TIED_KEY, None)
    if "wpe.weight" in tensors:  # rotary positions have no table to crop
        tensors["wpe.weight"] = tensors["wpe.weight"][: config.block_size].clone()
    rebuilt = model_from_tensors(config, tensors, where, device=device, allow_nonfinite=True)
    return rebuilt.train(model.training)
