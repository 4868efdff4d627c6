"""LoRA: low-rank adapters around a built GPT's projections, applied from outside (as quantize is).

    apply_lora(model, rank, alpha, targets)   wraps the chosen nn.Linear layers of every block in place;
                                              everything else stops training
    adapter_state_dict(model)                 the adapters alone: h.N.attn.c_attn.lora_A, ...lora_B, ...
    load_adapter_state_dict(model, tensors)   puts them back, every name and shape checked
    merge(model)                              folds (alpha / rank) B A into the base weights: a plain GPT

An adapted projection computes W x + b + (alpha / rank) B A dropout(x) with W and b frozen (the
base layer's own tensors, untouched), A (rank, in) Kaiming-uniform and B (out, rank) zero, as PEFT
and the LoRA paper initialize them: the adapted model starts out computing exactly the base.

An adapter run stores the adapters and names the base model they belong to:

    RUN/adapter_config.json   the LoRA settings, the base's path and a checksum of its weights
    RUN/adapter.safetensors   the adapters (a few MB where the base is hundreds)
    RUN/config.json           the base's GPTConfig, so load_config and `tinygpt params` read the run
    RUN/tokenizer.json        the base's tokenizer, copied, so sample, eval and serve need nothing else

The base's path is kept as given when absolute; a relative one is stored relative to the adapter
run's folder (so the two folders can move together) and resolved against it. The checksum is
SHA-256 over the base model's tensors themselves, in name order (name, dtype, shape, bytes), so it
is the same whether the base is a tinygpt run or a Hugging Face folder, sharded or not, and any
edit to any weight changes it. `tinygpt.load` reads an adapter run like any run: it loads the
base, checks the checksum, applies and fills the adapters.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import save_file

from .checkpoint import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    CONFIG,
    TIED_KEY,
    TOKENIZER,
    WEIGHTS,
    _read_weights,
    is_adapter_run,
    is_hf_folder,
)
from .config import GPTConfig, LoraConfig
from .errors import CheckpointError, ConfigError
from .fileio import atomic_write, read_json, write_json
from .model import GPT

ADAPTER_FORMAT = "tinygpt-lora"
ADAPTER_VERSION = 1
ADAPTER_KEYS = (".lora_A", ".lora_B")


class LoRALinear(nn.Module):
    """A frozen nn.Linear plus a trainable low-rank update: W x + b + scaling * B A dropout(x).

    The layer keeps the base layer's own weight and bias Parameters under the same names, so a
    model's state dict still holds h.N.attn.c_attn.weight where it did, beside ...lora_A and ...lora_B.

    Args:
        linear: the layer to adapt; its weight and bias are frozen, never copied or changed.
        rank: the adapters' inner size r.
        alpha: the update is scaled by alpha / rank.
        dropout: dropout on the input of the adapter path, in training only.
        generator: draws A's initial values (default: torch's global generator).
    """

    def __init__(self, linear: nn.Linear, rank: int, alpha: float, dropout: float = 0.0,
                 generator: torch.Generator | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.rank, self.alpha, self.scaling = rank, alpha, alpha / rank
        self.weight = linear.weight.requires_grad_(False)
        self.register_parameter("bias", linear.bias.requires_grad_(False) if linear.bias is not None else None)
        # drawn on the CPU in float32, so the same seed gives the same adapters on every device
        a = torch.empty(rank, self.in_features)
        nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)  # nn.Linear's own init, as PEFT's
        device, dtype = linear.weight.device, linear.weight.dtype
        self.lora_A = nn.Parameter(a.to(device=device, dtype=dtype))  # (r, in)
        # (out, r): zero, so the adapted model starts out as the base
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, rank, device=device, dtype=dtype))
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        update = F.linear(F.linear(self.lora_dropout(x), self.lora_A), self.lora_B)  # (..., out) through r
        return F.linear(x, self.weight, self.bias) + update * self.scaling

    @torch.no_grad()
    def merged_weight(self) -> torch.Tensor:
        """W + scaling * B A in W's dtype, summed in float64 so the only rounding is the last one."""
        delta = (self.lora_B.double() @ self.lora_A.double()) * self.scaling
        return (self.weight.double() + delta).to(self.weight.dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"rank={self.rank}, alpha={self.alpha:g}")


def _projections(model: GPT, targets: tuple[str, ...]):
    """(block module, attribute, full name) of each target projection, block by block."""
    for i, block in enumerate(model.h):
        for target in targets:
            part, attr = target.split(".")  # "attn.c_attn" -> block.attn, "c_attn"
            yield getattr(block, part), attr, f"h.{i}.{target}"


def lora_config_of(model: nn.Module) -> LoraConfig | None:
    """The LoRA settings apply_lora gave this model, or None for a model without adapters."""
    return getattr(model, "lora_config", None)


def apply_lora(
    model: GPT,
    rank: int = 8,
    alpha: float = 8.0,
    targets: str | tuple[str, ...] | list[str] = ("attn.c_attn",),
    dropout: float = 0.0,
    *,
    generator: torch.Generator | None = None,
) -> GPT:
    """Wrap the chosen projections of every block in LoRALinear, in place, and freeze the rest.

    Afterwards only the adapters' A and B require gradients; every other parameter (embeddings,
    LayerNorms, the head, the wrapped layers' own weights and biases) has requires_grad False.

    Args:
        model: a built GPT, not yet adapted or quantized.
        rank: the adapters' inner size r (PEFT's default 8).
        alpha: the update is scaled by alpha / rank (PEFT's default 8: a scale of 1 at rank 8).
        targets: c_attn, attn.c_proj, c_fc, mlp.c_proj, or the groups attn and mlp (see LoraConfig).
            The default, c_attn alone, is PEFT's for GPT-2: the query, key and value projections in
            one matrix, the ones the LoRA paper found worth adapting first, for the fewest parameters.
        dropout: dropout on the adapters' input, in training only.
        generator: draws the A matrices (default: torch's global generator).

    Returns:
        The same model; `model.lora_config` holds the settings.

    Raises:
        ConfigError: a bad rank, alpha, dropout or target, or a model already adapted or quantized.
    """
    config = LoraConfig(rank=rank, alpha=alpha, targets=targets, dropout=dropout)
    if lora_config_of(model) is not None or any(isinstance(m, LoRALinear) for m in model.modules()):
        raise ConfigError("the model already has LoRA adapters: merge them first (tinygpt.lora.merge)")
    if getattr(model, "inference_only", False):
        raise ConfigError("a model converted by tinygpt.quantize is for inference only: apply LoRA before quantizing")
    model.requires_grad_(False)
    for parent, attr, name in _projections(model, config.targets):
        layer = getattr(parent, attr)
        if not isinstance(layer, nn.Linear):
            raise ConfigError(f"{name} is a {type(layer).__name__}, not an nn.Linear: LoRA cannot wrap it")
        setattr(parent, attr, LoRALinear(layer, config.rank, config.alpha, config.dropout, generator))
    model.lora_config = config
    return model


def _adapters(model: nn.Module) -> dict[str, LoRALinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters' tensors by parameter name (h.0.attn.c_attn.lora_A, h.0.attn.c_attn.lora_B, ...).

    Raises:
        ConfigError: the model has no adapters.
    """
    layers = _adapters(model)
    if not layers:
        raise ConfigError("the model has no LoRA adapters (tinygpt.lora.apply_lora adds them)")
    out = {}
    for name, layer in layers.items():
        out[f"{name}.lora_A"] = layer.lora_A.detach()
        out[f"{name}.lora_B"] = layer.lora_B.detach()
    return out


@torch.no_grad()
def load_adapter_state_dict(
    model: nn.Module, tensors: dict[str, torch.Tensor], where: str = "the adapters", *, allow_nonfinite: bool = False
) -> None:
    """Copy adapter tensors into an adapted model's A and B matrices.

    Args:
        model: a model adapted with the same settings (apply_lora).
        tensors: name -> tensor, as adapter_state_dict gives them.
        where: what the tensors came from, for error messages (a file).
        allow_nonfinite: accept NaN or infinite values (refused by default).

    Raises:
        CheckpointError: a name missing or extra, a shape that differs, a tensor that is not
            floating point or not finite; nothing is copied then.
    """
    expected = adapter_state_dict(model)
    missing, extra = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    if missing or extra:
        detail = f"missing {', '.join(missing[:3])}" if missing else f"unexpected {', '.join(extra[:3])}"
        raise CheckpointError(f"{where}: the adapters do not fit the model's LoRA settings ({detail})")
    for name, t in tensors.items():
        if tuple(t.shape) != tuple(expected[name].shape):
            raise CheckpointError(f"{where}: {name} has shape {tuple(t.shape)}, the model's LoRA settings need "
                                  f"{tuple(expected[name].shape)}")
        if not t.is_floating_point():
            raise CheckpointError(f"{where}: {name} has dtype {t.dtype}, expected a floating-point tensor")
        if not allow_nonfinite and not bool(torch.isfinite(t).all()):
            raise CheckpointError(f"{where}: {name} holds NaN or infinite values")
    for name, t in tensors.items():
        expected[name].copy_(t)  # detached views of the Parameters: this writes the model's A and B


@torch.no_grad()
def merge(model: GPT) -> GPT:
    """Fold every adapter into its base weight (W + (alpha / rank) B A) and put plain nn.Linear back.

    The result is an ordinary GPT: it saves as a plain run and exports like any model. Like a
    freshly built GPT, all its parameters require gradients again.

    Args:
        model: an adapted model (apply_lora).

    Returns:
        The same model, changed in place.

    Raises:
        ConfigError: the model has no adapters.
    """
    layers = _adapters(model)
    if not layers:
        raise ConfigError("the model has no LoRA adapters to merge")
    for name, layer in layers.items():
        parent = model.get_submodule(name.rsplit(".", 1)[0])
        with torch.device("meta"):  # no memory and no init for weights that are replaced at once
            plain = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None)
        plain.weight = nn.Parameter(layer.merged_weight())
        if layer.bias is not None:
            plain.bias = layer.bias
        setattr(parent, name.rsplit(".", 1)[1], plain)
    del model.lora_config
    model.requires_grad_(True)
    return model


# ---- the checksum of a base model's weights ---------------------------------------------------


def weights_checksum(model: nn.Module) -> str:
    """SHA-256 over a GPT's base weights as tensors: "sha256:<hex>".

    Each tensor, in name order, contributes its name, dtype and shape (one JSON line) and then its
    bytes; a tied head is wte and counted once; adapters are left out, so an adapted model has the
    checksum of its base. Two folders holding the same tensors (a run and its Hugging Face export
    read back, one file or shards) give the same checksum.
    """
    state = {k: v for k, v in model.state_dict().items() if not k.endswith(ADAPTER_KEYS)}
    if model.config.tie_weights:
        state.pop(TIED_KEY, None)
    digest = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().cpu().contiguous()
        digest.update((json.dumps([name, str(t.dtype).removeprefix("torch."), list(t.shape)]) + "\n").encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy())
    return "sha256:" + digest.hexdigest()


# ---- adapter runs -----------------------------------------------------------------------------


def _stored_base(base: Path, out: Path) -> str:
    """The base's path as adapter_config.json keeps it: absolute as given, else relative to `out`."""
    if base.is_absolute():
        return str(base)
    return os.path.relpath(os.path.abspath(base), os.path.abspath(out))


def _base_tokenizer(base: Path):
    from .tokenizer import load_tokenizer

    if is_hf_folder(base):
        from .interop.hf_gpt2 import load_hf_tokenizer

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
    tokenizer = tokenizer if tokenizer is not None else _base_tokenizer(base)
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


def _check_same_architecture(run: Path, base: str, model: GPT) -> None:
    """The run's config.json must describe the base it loads (dropout aside: training may set its own)."""
    if not (run / CONFIG).exists():
        return
    try:
        saved = GPTConfig.from_dict(read_json(run / CONFIG, CheckpointError))
    except ConfigError as e:
        raise CheckpointError(f"{run / CONFIG}: {e}") from None
    differ = [f.name for f in dataclasses.fields(GPTConfig)
              if f.name != "dropout" and getattr(saved, f.name) != getattr(model.config, f.name)]
    if differ:
        raise CheckpointError(f"{run}: the base model {base} is not the architecture these adapters were trained on "
                              f"({', '.join(differ)} differ from {run / CONFIG})")


def load_adapter_run(
    run: str | Path,
    *,
    device: str | torch.device = "cpu",
    allow_nonfinite: bool = False,
    merge_adapters: bool = False,
) -> GPT:
    """The model of an adapter run, in eval mode: its base, checked, with the adapters applied.

    Args:
        run: the adapter run folder.
        device: where to put the weights.
        allow_nonfinite: accept NaN or infinite weights (base or adapters).
        merge_adapters: fold the adapters into the weights (a plain GPT, as fast as the base).

    Raises:
        CheckpointError: a damaged adapter file, or a base that is missing, is not a full model, or
            whose weights are not the ones the adapters were trained on (the message names its path).
    """
    from .checkpoint import load

    run = Path(run)
    info = read_adapter_config(run)
    config, base = info.lora, info.base
    shown = info.shown_base
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
    _check_same_architecture(run, shown, model)
    tensors, _ = _read_weights(run / ADAPTER_WEIGHTS)
    apply_lora(model, config.rank, config.alpha, config.targets, config.dropout)
    load_adapter_state_dict(model, tensors, str(run / ADAPTER_WEIGHTS), allow_nonfinite=allow_nonfinite)
    if merge_adapters:
        merge(model)
    return model.to(device).eval()


def merge_run(run: str | Path, out: str | Path):
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
    from .checkpoint import save
    from .tokenizer import load_tokenizer

    run, out = Path(run), Path(out)
    if not is_adapter_run(run):
        raise CheckpointError(f"{run}: not an adapter run (no {ADAPTER_CONFIG}), so there is nothing to merge")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointError(f"{out} already exists; merge into a new folder")
    model = load_adapter_run(run, merge_adapters=True)
    tokenizer = load_tokenizer(run) if (run / TOKENIZER).exists() else None
    save(model, out, tokenizer)
    return model, tokenizer
