"""The configs of learning from preference pairs: DPO (DPOConfig) and a reward model (RewardConfig), under
TRL's names. What trains (full or LoRA), the window and the report's settings are a FinetuneConfig's
(its block_size is the pairs' max_length); the optimization a TrainConfig's, whose batch_size counts pairs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError
from .fields import check, check_bools, finite, from_mapping

DPO_LOSSES = ("sigmoid", "ipo", "hinge", "robust")  # TRL's loss_type values tinygpt computes
# the SFT term's weight when none is given: what kept the task model's accuracy in the measurement of
# docs/tutorials/align-preferences.md, where pure DPO (weight 0) collapsed it
DEFAULT_SFT_WEIGHT = 1.0


@dataclass
class DPOConfig:
    """Direct preference optimisation of a pretrained model on preference pairs (tinygpt.align.dpo).

    Args:
        loss: TRL's loss_type: "sigmoid" (DPO's), "ipo", "hinge" or "robust".
        beta: how strongly the policy is held to the reference (TRL's beta, 0.1).
        label_smoothing: robust's share of pairs taken to be flipped, in [0, 0.5) (TRL's label_smoothing).
        sft_weight: the weight of the SFT term, the negative log-likelihood of the chosen completions a token
            added to the DPO loss (TRL's loss_type ["sigmoid", "sft"] with loss_weights [1, w]); 0 is pure
            DPO, whose chosen log-probs may fall with the rejected ones.
        ref_model: the reference, a run or Hugging Face folder; None: the model DPO starts from, frozen (for
            LoRA, the base with the adapters off: no second copy in memory).
        precompute_ref: compute the reference's log-probs of every pair once before training and keep no
            reference model through the run (TRL's precompute_ref_log_probs).
    """

    loss: str = "sigmoid"
    beta: float = 0.1
    label_smoothing: float = 0.0
    sft_weight: float = DEFAULT_SFT_WEIGHT
    ref_model: str | None = None
    precompute_ref: bool = False

    def __post_init__(self) -> None:
        finite(self, ("beta", "label_smoothing", "sft_weight"))
        check(self.loss in DPO_LOSSES, "loss", f"must be one of {', '.join(DPO_LOSSES)}, got {self.loss!r}")
        check(self.beta > 0, "beta", f"must be above 0, got {self.beta!r}")
        check(0.0 <= self.label_smoothing < 0.5, "label_smoothing",
              f"must be in [0, 0.5), got {self.label_smoothing!r}")
        if self.label_smoothing and self.loss != "robust":
            raise ConfigError("label_smoothing applies to loss robust")
        check(self.sft_weight >= 0, "sft_weight", f"must be 0 or above, got {self.sft_weight!r}")
        check(self.ref_model is None or isinstance(self.ref_model, str) and bool(self.ref_model), "ref_model",
              f"must be a folder, got {self.ref_model!r}")
        check_bools(self, ("precompute_ref",))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DPOConfig:
        return from_mapping(cls, data)


@dataclass
class RewardConfig:
    """A reward model trained on preference pairs (tinygpt.align.reward): the model a fine-tuning starts from,
    its language-model head replaced by a score, trained in full on the Bradley-Terry loss; a pair's margin
    (TRL's) comes from the data's "margin" field.

    Args:
        center: TRL's center_rewards_coefficient, the weight of the mean squared sum of a pair's scores that
            holds them near zero; None for none.
    """

    center: float | None = None

    def __post_init__(self) -> None:
        finite(self, ("center",))
        check(self.center is None or self.center >= 0, "center", f"must be 0 or above, got {self.center!r}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RewardConfig:
        return from_mapping(cls, data)
