"""The fine-tuning config: how a pretrained model is fine-tuned, full or with LoRA, and what its report measures.

The methods that train a pretrained model on other objectives (preference pairs, a reward model, rollouts
scored by a reward) get a config module each beside this one; the optimization stays a TrainConfig.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError
from .fields import check, check_bools, check_int, finite, from_mapping
from .lora import LoraConfig

FINETUNE_METHODS = ("full", "lora")
KEEP = ("last", "best")
# Fine-tuning moves a trained model a little: far below pretraining's DEFAULT_LR. nanoGPT's GPT-2
# recipe trains every weight at 3e-5; LoRA's adapters start at zero and take a larger step
# (litgpt's LoRA recipes use 2e-4 to 3e-4, PEFT's examples 1e-4 to 3e-4).
FINETUNE_LR = {"full": 3e-5, "lora": 2e-4}


@dataclass
class FinetuneConfig:
    """How a pretrained model is fine-tuned (tinygpt.finetune); the optimization itself is a TrainConfig.

    Args:
        method: "full" (every weight not frozen trains) or "lora" (low-rank adapters on the chosen
            projections; every base weight frozen and untouched, the run stores only the adapters).
        lora_rank, lora_alpha, lora_targets, lora_dropout: the adapters (see LoraConfig), with lora.
        freeze_embeddings: with full, the token and position embeddings do not train.
        freeze_layers: with full, the first N blocks do not train.
        keep: "last" keeps the last checkpoint; "best" only the one with the lowest validation loss
            (saved at an evaluation only when it improves, as nanoGPT's always_save_checkpoint=False),
            the base's own at step 0 included: a run that only gets worse keeps the base (LoRA: the
            adapters at zero), never a model worse than it.
        block_size: the training window, at most the base's context (default: all of it), which the model keeps.
        dropout: the model's dropout while fine-tuning (default: the base's), kept in config.json.
        grad_checkpoint: recompute each block's activations in backward instead of keeping them
            (torch.utils.checkpoint): less memory for about a third more compute.
        reference: a text file whose loss before and after is the report's forgetting measure;
            default the base's own validation split when the base is a tinygpt run that records it.
        prompts: texts sampled before and after, with the same seed, for the report (default: the
            start of the validation split).
        sample_tokens: tokens each report sample generates.
        report_tokens: the report's losses are over at most this many tokens of each text.
    """

    method: str = "full"
    lora_rank: int = 8
    lora_alpha: float = 8.0
    lora_targets: tuple[str, ...] | None = None
    lora_dropout: float = 0.0
    freeze_embeddings: bool = False
    freeze_layers: int = 0
    keep: str = "last"
    block_size: int | None = None
    dropout: float | None = None
    grad_checkpoint: bool = False
    reference: str | None = None
    prompts: tuple[str, ...] = ()
    sample_tokens: int = 48
    report_tokens: int = 20_000

    def __post_init__(self) -> None:
        finite(self, ("lora_alpha", "lora_dropout", "dropout"))
        check(self.method in FINETUNE_METHODS, "method", f"must be one of {', '.join(FINETUNE_METHODS)}, "
              f"got {self.method!r}")
        check(self.keep in KEEP, "keep", f"must be one of {', '.join(KEEP)}, got {self.keep!r}")
        self.lora_targets = self.lora.targets  # checks rank, alpha, dropout and targets, and names them in full
        check_bools(self, ("freeze_embeddings", "grad_checkpoint"))
        check_int(self.freeze_layers, "freeze_layers", 0)
        if self.method == "lora" and (self.freeze_embeddings or self.freeze_layers):
            raise ConfigError("freeze_embeddings and freeze_layers go with method full: LoRA already trains its "
                              "adapters alone")
        for name in ("block_size", "sample_tokens", "report_tokens"):
            if name != "block_size" or self.block_size is not None:  # None: the base's whole context
                check_int(getattr(self, name), name, 1)
        if self.dropout is not None:
            check(0.0 <= self.dropout < 1.0, "dropout", f"must be in [0, 1), got {self.dropout!r}")
        check(self.reference is None or isinstance(self.reference, str) and bool(self.reference), "reference",
              f"must be a file name, got {self.reference!r}")
        check(all(isinstance(p, str) and p for p in self.prompts), "prompts",
              f"must be non-empty texts, got {self.prompts!r}")

    @property
    def lora(self) -> LoraConfig:
        return LoraConfig(rank=self.lora_rank, alpha=self.lora_alpha, targets=self.lora_targets,
                          dropout=self.lora_dropout)

    @property
    def default_lr(self) -> float:
        """The learning rate when the TrainConfig leaves it to choose: FINETUNE_LR for the method."""
        return FINETUNE_LR[self.method]

    def to_dict(self) -> dict[str, Any]:
        targets = None if self.lora_targets is None else list(self.lora_targets)
        return {**dataclasses.asdict(self), "lora_targets": targets, "prompts": list(self.prompts)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> FinetuneConfig:
        return from_mapping(cls, data)
