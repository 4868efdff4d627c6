"""The GRPO config: where the prompts come from, how each is rewarded, how its completions are sampled and
how the policy-gradient loss is formed, under TRL's GRPOConfig names. What trains (full or LoRA) and the
report's settings are a FinetuneConfig's; the optimization a TrainConfig's, whose batch_size counts
completions (TRL's per_device_train_batch_size): batch_size / num_generations prompts a micro-step.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError
from .fields import check, check_bools, check_int, finite, from_mapping, is_int, is_number

SCALE_REWARDS = ("group", "batch", "none")
LOSS_TYPES = ("grpo", "dr_grpo", "dapo")
# What the library's grpo() trains with when no TrainConfig is given: a group of 8 for each of 8 prompts
# a step, at a constant rate, evaluated every 25 steps (the held-out accuracy is the curve to watch)
DEFAULT_TRAIN = dict(batch_size=64, lr_schedule="constant", warmup=0, max_iters=200, eval_interval=25,
                     eval_iters=4, weight_decay=0.0)


@dataclass
class GRPOConfig:
    """How GRPO samples, scores and learns (tinygpt.align.grpo_run); the optimization is a TrainConfig.

    Args:
        task: a built-in task whose answers a program checks (tinygpt.align.tasks: "addition"): its reward,
            its prompts when no file is given, and its held-out prompts for the evaluations.
        prompts: a JSONL file of TRL's prompt-only rows ("prompt" and any columns the rewards take).
        eval_prompts: a JSONL file of held-out prompts (default: the task's held-out set, else every tenth
            row of `prompts`, which then does not train).
        rewards: reward functions by name, "module:function", each imported only because it is named here.
        reward_weights: each reward's weight, the task's first (default: 1 each), as TRL's reward_weights.
        num_generations: completions sampled for each prompt (the group), at least 2.
        max_completion_length: a completion's most tokens (default: the task's longest answer and its end;
            without a task, 64).
        temperature, top_k, top_p: the rollouts' sampling (TRL's defaults: 1, none, 1).
        beta: the weight of the KL term to the reference (FROM; LoRA's base with the adapters off). 0, TRL's
            default, keeps no reference.
        epsilon, epsilon_high: the clipping range of the probability ratio (epsilon_high None: epsilon).
        num_iterations: optimizer steps on each batch of rollouts (TRL's num_iterations, the GRPO paper's mu):
            from the second on, the ratio to the policy that sampled them is clipped.
        loss_type: "grpo", "dr_grpo" or "dapo" (TRL's default), how the tokens' losses are reduced.
        scale_rewards: "group" (TRL's default), "batch" or "none": what the advantages are divided by.
        mask_truncated_completions: completions cut at max_completion_length do not count in the loss.
        eval_size: held-out prompts each evaluation answers greedily (accuracy, reward) and samples pass@k on.
        pass_k: samples a held-out prompt gets for pass@k (0: none).
    """

    task: str | None = None
    prompts: str | None = None
    eval_prompts: str | None = None
    rewards: tuple[str, ...] = ()
    reward_weights: tuple[float, ...] | None = None
    num_generations: int = 8
    max_completion_length: int | None = None
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    beta: float = 0.0
    epsilon: float = 0.2
    epsilon_high: float | None = None
    num_iterations: int = 1
    loss_type: str = "dapo"
    scale_rewards: str = "group"
    mask_truncated_completions: bool = False
    eval_size: int = 200
    pass_k: int = 8

    def __post_init__(self) -> None:
        finite(self, ("temperature", "top_p", "beta", "epsilon", "epsilon_high"))
        if self.task is None and self.prompts is None:
            raise ConfigError("GRPO needs prompts: --task NAME (a built-in task writes its own) or --prompts FILE")
        if self.task is None and not self.rewards:
            raise ConfigError("GRPO needs a reward: --task NAME, or --reward module:function or a reward-model RUN")
        check(is_int(self.num_generations) and self.num_generations >= 2, "num_generations",
              f"must be an integer >= 2: the group is the baseline a completion is compared with, got "
              f"{self.num_generations!r}")
        if self.max_completion_length is not None:
            check_int(self.max_completion_length, "max_completion_length", 1)
        check(self.temperature > 0, "temperature", f"rollouts sample: must be above 0, got {self.temperature!r}")
        if self.top_k is not None:
            check_int(self.top_k, "top_k", 1)
        if self.top_p is not None:
            check(0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p!r}")
        check(self.beta >= 0, "beta", f"must be >= 0, got {self.beta!r}")
        check(0 <= self.epsilon < 1, "epsilon", f"must be in [0, 1), got {self.epsilon!r}")
        check(self.epsilon_high is None or self.epsilon_high >= 0, "epsilon_high",
              f"must be >= 0, got {self.epsilon_high!r}")
        check_int(self.num_iterations, "num_iterations", 1)
        check(self.loss_type in LOSS_TYPES, "loss_type", f"must be one of {', '.join(LOSS_TYPES)}, "
              f"got {self.loss_type!r}")
        check(self.scale_rewards in SCALE_REWARDS, "scale_rewards", f"must be one of {', '.join(SCALE_REWARDS)}, "
              f"got {self.scale_rewards!r}")
        check_bools(self, ("mask_truncated_completions",))
        check_int(self.eval_size, "eval_size", 1)
        check_int(self.pass_k, "pass_k", 0)
        check(all(isinstance(r, str) and r for r in self.rewards), "rewards", f"must be names, got {self.rewards!r}")
        if self.reward_weights is not None:
            n = len(self.rewards) + (self.task is not None)
            check(len(self.reward_weights) == n and all(is_number(w) and w >= 0 for w in self.reward_weights),
                  "reward_weights", f"one number >= 0 for each reward ({n}: the task's first), got "
                  f"{list(self.reward_weights)}")

    def weights(self) -> list[float]:
        """Each reward's weight, the task's first."""
        n = len(self.rewards) + (self.task is not None)
        return list(self.reward_weights) if self.reward_weights is not None else [1.0] * n

    def to_dict(self) -> dict[str, Any]:
        weights = None if self.reward_weights is None else list(self.reward_weights)
        return {**dataclasses.asdict(self), "rewards": list(self.rewards), "reward_weights": weights}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GRPOConfig:
        return from_mapping(cls, data)

