"""The LoRA config: low-rank adapters, their rank and scale, and the projections of a block they adapt.

Its own module, not fine-tuning's: every method that trains adapters (fine-tuning today, and next the
preference and reinforcement methods) takes a LoraConfig.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError
from .fields import FLOAT32_MAX, check, check_int, from_mapping, is_number
from .model import GPTConfig

# The projections of a block that LoRA can adapt, by their names inside the block, in block order:
# GPT-2's, and the llama layout's (Hugging Face's names, as PEFT's target_modules give them), with
# the short names that stand for them, and the groups attn and mlp (a block's attention projections,
# its MLP's: which ones is the model's layout's to say). A bare "c_proj" is both attention's and the
# MLP's in GPT-2, so it is refused rather than guessed.
LORA_TARGETS = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
LLAMA_LORA_TARGETS = ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
                      "mlp.down_proj")
LORA_GROUPS = ("attn", "mlp")
LORA_TARGET_NAMES: dict[str, str] = {
    **{name: name for name in (*LORA_TARGETS, *LLAMA_LORA_TARGETS, *LORA_GROUPS)},
    **{name.split(".")[1]: name for name in ("attn.c_attn", "mlp.c_fc", *LLAMA_LORA_TARGETS)},
}
# the targets when none are given, PEFT's defaults: GPT-2's c_attn (its queries, keys and values in one
# matrix), and the llama layout's q_proj and v_proj (the LoRA paper found adapting queries and values as
# good as adapting more, at a fixed budget)
LORA_DEFAULT_TARGETS = {"gpt2": ("attn.c_attn",), "llama": ("attn.q_proj", "attn.v_proj")}


@dataclass
class LoraConfig:
    """Low-rank adapters (LoRA): each adapted projection computes W x + b + (alpha / rank) B A dropout(x),
    with W and b frozen, A (rank, in) and B (out, rank) trained.

    Args:
        rank: r, the adapters' inner size. Each adapter adds rank x (in + out) parameters.
        alpha: the adapters' output is scaled by alpha / rank, so that a new rank needs no new
            learning rate (the LoRA paper's reason). The defaults (8, 8) are PEFT's.
        targets: the projections to adapt in every block: GPT-2's c_attn, attn.c_proj, c_fc, mlp.c_proj;
            the llama layout's q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj; or the
            groups attn and mlp (every projection of the attention or the MLP); a comma-separated
            string is accepted. Kept as full names (attn.c_attn, attn.q_proj, ...) and groups;
            resolved_for(config) gives the model's own, in block order. None (the default): PEFT's
            for the model's layout (LORA_DEFAULT_TARGETS: c_attn for GPT-2, the fewest parameters,
            rank x 4 n_embd a block; q_proj and v_proj for the llama layout).
        dropout: dropout on the adapters' input during training (the frozen path sees x unchanged).
    """

    rank: int = 8
    alpha: float = 8.0
    targets: tuple[str, ...] | None = None
    dropout: float = 0.0

    def __post_init__(self) -> None:
        check_int(self.rank, "lora rank", 1)
        check(is_number(self.alpha) and 0 < self.alpha < math.inf, "lora alpha",
              f"must be a finite number > 0, got {self.alpha!r}")
        self.alpha = float(self.alpha)
        check(self.scaling <= FLOAT32_MAX, "lora alpha", f"alpha / rank scales the adapters' output in float32, "
              f"where {self.scaling:g} is infinite; got alpha {self.alpha:g} at rank {self.rank}")
        check(is_number(self.dropout) and 0.0 <= self.dropout < 1.0, "lora dropout",
              f"must be in [0, 1), got {self.dropout!r}")
        self.targets = None if self.targets is None else lora_targets(self.targets)

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def resolved_for(self, config: GPTConfig) -> LoraConfig:
        """These settings with the targets a model of `config` has, as full names in block order: the
        groups expanded, the default chosen for its layout.

        Raises:
            ConfigError: a target the model's layout does not have (c_attn on the llama layout, q_proj on GPT-2).
        """
        layout = LORA_TARGETS if config.arch == "gpt2" else tuple(
            t for t in LLAMA_LORA_TARGETS if t != "mlp.gate_proj" or config.mlp == "swiglu")
        chosen = set(self.targets if self.targets is not None else LORA_DEFAULT_TARGETS[config.arch])
        for name in chosen:
            check(name in layout or name in LORA_GROUPS, "lora targets",
                  f"{name} is not a projection of this model's blocks ({config.arch} layout: {', '.join(layout)}, "
                  "or the groups attn and mlp)")
        targets = tuple(t for t in layout if t in chosen or t.split(".")[0] in chosen)
        return dataclasses.replace(self, targets=targets)

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "targets": None if self.targets is None else list(self.targets)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LoraConfig:
        return from_mapping(cls, data)


def lora_targets(targets: str | tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """Full projection names (attn.c_attn, attn.q_proj, ...) and groups (attn, mlp), in a fixed order,
    for LoRA targets as a user gives them (LoraConfig.resolved_for picks a model's own).

    Args:
        targets: names and groups (see LoraConfig), as a sequence or one comma-separated string.

    Raises:
        ConfigError: no target, an unknown name, or the ambiguous "c_proj".
    """
    names = targets.split(",") if isinstance(targets, str) else targets
    check(isinstance(names, (tuple, list)) and all(isinstance(n, str) for n in names), "lora targets",
          f"expected names such as c_attn,mlp, got {targets!r}")
    chosen: set[str] = set()
    for name in (n.strip() for n in names if n.strip()):
        if name == "c_proj":
            raise ConfigError("lora targets: c_proj is ambiguous: say attn.c_proj or mlp.c_proj")
        check(name in LORA_TARGET_NAMES, "lora targets",
              f"unknown target {name!r}; choose from {', '.join(LORA_TARGET_NAMES)}")
        chosen.add(LORA_TARGET_NAMES[name])
    check(bool(chosen), "lora targets", "name at least one projection (c_attn, attn.c_proj, c_fc, mlp.c_proj; "
          "q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj; or attn, mlp)")
    return tuple(t for t in (*LORA_TARGETS, *LLAMA_LORA_TARGETS, *LORA_GROUPS) if t in chosen)
