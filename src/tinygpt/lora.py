"""LoRA: low-rank adapters around a built GPT's projections, applied from outside (as quantize is).

    apply_lora(model, rank, alpha, targets)   wraps the chosen nn.Linear layers of every block in place;
                                              everything else stops training
    adapter_state_dict(model)                 the adapters alone: h.N.attn.c_attn.lora_A, ...lora_B, ...
    load_adapter_state_dict(model, tensors)   puts them back, every name and shape checked
    merge(model)                              folds (alpha / rank) B A into the base weights: a plain GPT
    with adapters_off(model): ...             the model computes its base, the adapters left out (PEFT's
                                              disable_adapter): a LoRA run's reference, with no second copy

An adapted projection computes W x + b + (alpha / rank) B A dropout(x) with W and b frozen (the
base layer's own tensors, untouched), A (rank, in) Kaiming-uniform and B (out, rank) zero, as PEFT
and the LoRA paper initialize them: the adapted model starts out computing exactly the base.

weights_checksum(model) is SHA-256 over the base model's tensors themselves, in name order (name,
dtype, shape, bytes), so it is the same whether the base is a tinygpt run or a Hugging Face folder,
sharded or not, and any edit to any weight changes it: an adapter run keeps it to know its base.
Adapter runs (the adapters in a folder that names their base) are run folders, written and read by
tinygpt.checkpoint: save_adapter_run, read_adapter_config, merge_run, and `tinygpt.load`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
from collections.abc import Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F

from .calc.params import projections
from .config.lora import LoraConfig
from .config.model import GPTConfig
from .errors import CheckpointError, ConfigError
from .model import GPT
from .weights import TIED_KEY

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
        self.enabled = True  # adapters_off sets it False: the base layer alone

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.enabled:
            return F.linear(x, self.weight, self.bias)
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


def check_rank(config: GPTConfig, lora: LoraConfig, name: str = "lora rank") -> None:
    """Refuse a rank above min(in, out) of a projection the adapters target: their product B A has no
    higher rank than that, so a larger one adds parameters and nothing they can learn.

    Args:
        config: the model's architecture.
        lora: the adapters' settings (targets as given: resolved for `config` here).
        name: what the rank is called in the message (a flag, where the CLI gave it).

    Raises:
        ConfigError: naming `name`, the limit and the projection that sets it.
    """
    shapes = projections(config)
    narrowest = min(lora.resolved_for(config).targets, key=lambda t: min(shapes[t]))
    fan_in, fan_out = shapes[narrowest]
    if lora.rank > min(fan_in, fan_out):
        raise ConfigError(f"{name}: {lora.rank} is more than {min(fan_in, fan_out)}, min(in, out) of the adapted "
                          f"{narrowest} ({fan_in} in, {fan_out} out): a higher rank adds parameters, not capacity")


def apply_lora(
    model: GPT,
    rank: int = 8,
    alpha: float = 8.0,
    targets: str | tuple[str, ...] | list[str] | None = None,
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
        targets: the projections to adapt (see LoraConfig): GPT-2's c_attn, attn.c_proj, c_fc,
            mlp.c_proj; the llama layout's q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj,
            down_proj; the groups attn and mlp. None: PEFT's default for the model's layout (c_attn;
            q_proj and v_proj), the projections the LoRA paper found worth adapting first.
        dropout: dropout on the adapters' input, in training only.
        generator: draws the A matrices (default: torch's global generator).

    Returns:
        The same model; `model.lora_config` holds the settings, its targets the model's own in full.

    Raises:
        ConfigError: a bad rank (above min(in, out) of a target: check_rank), alpha, dropout or target, or a
            model already adapted or quantized.
    """
    config = LoraConfig(rank=rank, alpha=alpha, targets=targets, dropout=dropout).resolved_for(model.config)
    check_rank(model.config, config)
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


@contextlib.contextmanager
def adapters_off(model: nn.Module) -> Iterator[nn.Module]:
    """Within the block the model computes exactly its base: every adapter's update left out, as PEFT's
    disable_adapter does. A LoRA run's frozen reference (a KL term's, DPO's) is then the same model, with no
    second copy of it in memory.

    Args:
        model: a model with adapters (apply_lora); one without is the base already.
    """
    layers = list(_adapters(model).values())
    for layer in layers:
        layer.enabled = False
    try:
        yield model
    finally:
        for layer in layers:
            layer.enabled = True


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
