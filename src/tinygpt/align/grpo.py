"""Group relative policy optimisation (GRPO): the arithmetic of a step, as TRL's GRPOTrainer defines it.

A step samples a group of completions for each prompt, scores them, and pushes up the log-probability of
the completions that scored above their group's mean and down those below it: no value model, the group
is the baseline. The pieces, each a pure function of tensors (tests hold them to TRL's formulas):

    advantages(rewards, weights, group, scale)    each completion's reward against its group's:
                                                  (r - mean) / (std + 1e-4), std of the group, the batch, or none
    token_losses(logps, old, advantages, ...)     the clipped policy-gradient loss of each completion token,
                                                  plus beta times the KL estimate to a reference
    reduce_loss(losses, mask, loss_type, ...)     one number: grpo (each completion's mean, then the mean),
                                                  dr_grpo (a sum over a fixed length), dapo (a mean over tokens)

GRPO, the objective the one training loop calls (tinygpt.train.objectives): its draw is the rollouts (a
group of completions per prompt sampled from the policy on tinygpt's own decoding, scored by the rewards,
their advantages), its loss the policy gradient on them, its evaluation the held-out prompts answered
greedily (reward, accuracy) and sampled (pass@k). Its rollouts draw from a generator of their own, which
a checkpoint keeps, so a resumed run samples what the uninterrupted one would have.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..config.grpo import LOSS_TYPES, SCALE_REWARDS, GRPOConfig
from ..config.sampling import SampleConfig
from ..config.train import TrainConfig
from ..data.folder import DataSet
from ..distributed import Dist
from ..errors import ConfigError, TrainingError
from ..lora import lora_config_of
from ..model import GPT
from ..run_folder import RunFolder
from ..train.objectives import Batch, Objective
from .rewards import Reward, columns_of, score
from .rollouts import Rollouts, completion_logps, sample_groups

STD_EPS = 1e-4  # TRL's: a group whose rewards agree gets advantages of 0, not a division by 0


def nanstd(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """The sample standard deviation (Bessel's correction) of x's values that are not NaN; NaN where fewer
    than two are.

    Args:
        x: the values.
        dim: the dimension to reduce, or None for all of them.
    """
    if dim is None:
        x, dim = x.reshape(-1), 0
    count = (~torch.isnan(x)).sum(dim)
    variance = torch.nanmean((x - torch.nanmean(x, dim=dim, keepdim=True)) ** 2, dim=dim)
    variance = torch.where(count > 1, variance * count / (count - 1).clamp(min=1), float("nan"))
    return variance.sqrt()


def advantages(rewards: torch.Tensor, weights: torch.Tensor, group: int,
               scale: str = "group") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each completion's advantage, from the rewards of every reward function.

    The weighted rewards are summed (a function's None, NaN here, adds nothing; a completion no function
    scored is left out of its group's mean and gets an advantage of 0), and the sum is compared with its
    group's mean: divided by the group's standard deviation (scale "group", GRPO's), the whole batch's
    ("batch"), or not at all ("none", Dr. GRPO's advice), as TRL's scale_rewards.

    Args:
        rewards: (N, F) each completion's reward from each of F functions; N = prompts x group, a prompt's
            completions next to each other.
        weights: (F,) each function's weight.
        group: completions per prompt (num_generations).
        scale: "group", "batch" or "none".

    Returns:
        (advantages (N,), the summed rewards (N,), whether each completion's group, or the batch, has a
        standard deviation of zero (N,)).
    """
    if scale not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards: one of {', '.join(SCALE_REWARDS)}, got {scale!r}")
    unscored = torch.isnan(rewards).all(dim=1)
    total = (rewards * weights.to(rewards.dtype)).nansum(dim=1)
    total[unscored] = float("nan")
    grouped = total.view(-1, group)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(group)
    if scale == "batch":
        std = nanstd(total).expand_as(total) if total.numel() > 1 else torch.zeros_like(total)
    else:
        std = nanstd(grouped, dim=1).repeat_interleave(group) if group > 1 else torch.zeros_like(total)
    out = total - mean
    if scale != "none":
        out = out / (std + STD_EPS)
    zero_std = torch.isclose(std, torch.zeros_like(std))
    return torch.nan_to_num(out, nan=0.0), total, zero_std


def token_losses(logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor, *,
                 epsilon_low: float = 0.2, epsilon_high: float | None = None, beta: float = 0.0,
                 ref_logps: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss of each completion token: PPO's clipped surrogate with the token's probability ratio to the
    policy that sampled it, plus beta times the KL estimate exp(ref - logp) - (ref - logp) - 1 (Schulman's
    k3, always >= 0) to the reference.

    On the first pass over a batch the ratio is 1 and the loss's gradient is -advantage times the gradient
    of the log-probability; clipping acts from the second pass on (TRL's num_iterations), where a token
    whose ratio has left [1 - epsilon_low, 1 + epsilon_high] in the advantage's direction stops pulling.

    Args:
        logps: (N, T) the policy's log-probability of each completion token (with its gradient).
        old_logps: (N, T) the same under the policy that sampled the batch (no gradient).
        advantages: (N,) each completion's.
        epsilon_low, epsilon_high: the clipping range (epsilon_high None: epsilon_low).
        beta: the KL term's weight; 0 needs no reference.
        ref_logps: (N, T) the reference's log-probabilities, with beta > 0.

    Returns:
        (the losses (N, T), and per token: "kl" (with beta > 0), "clipped_low", "clipped_high" as 0/1 floats,
        to be averaged over the completion mask).
    """
    high = epsilon_low if epsilon_high is None else epsilon_high
    adv = advantages.unsqueeze(1)
    ratio = torch.exp(logps - old_logps)
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + high)
    losses = -torch.min(ratio * adv, clipped * adv)
    parts = {"clipped_low": ((ratio < 1 - epsilon_low) & (adv < 0)).float(),
             "clipped_high": ((ratio > 1 + high) & (adv > 0)).float()}
    if beta != 0.0:
        if ref_logps is None:
            raise ValueError("beta > 0 needs the reference's log-probabilities")
        gap = ref_logps - logps
        kl = torch.exp(gap) - gap - 1
        losses = losses + beta * kl
        parts["kl"] = kl
    return losses, parts


def reduce_loss(losses: torch.Tensor, mask: torch.Tensor, loss_type: str = "dapo", *,
                max_completion_length: int | None = None, tokens: torch.Tensor | float | None = None) -> torch.Tensor:
    """The batch's loss from its tokens' losses, as TRL's loss_type says:

        grpo      each completion's mean over its tokens, then the mean over completions (long completions'
                  tokens count less: the length bias Dr. GRPO and DAPO remove)
        dr_grpo   the sum over every token / (completions x max_completion_length)
        dapo      the sum over every token / the tokens in the batch (`tokens`: the whole generation batch's
                  where a micro-batch is part of it; default this one's)

    Args:
        losses: (N, T) from token_losses.
        mask: (N, T) 1 on completion tokens (up to and including the one that ended it), 0 after.
        loss_type: "grpo", "dr_grpo" or "dapo".
        max_completion_length: dr_grpo's constant.
        tokens: dapo's normaliser.
    """
    mask = mask.to(losses.dtype)
    masked = losses * mask
    if loss_type == "grpo":
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "dr_grpo":
        if max_completion_length is None:
            raise ValueError("dr_grpo divides by max_completion_length")
        return masked.sum() / (losses.shape[0] * max_completion_length)
    if loss_type == "dapo":
        total = mask.sum() if tokens is None else torch.as_tensor(tokens, dtype=losses.dtype)
        return masked.sum() / total.clamp(min=1.0)
    raise ValueError(f"loss_type: one of {', '.join(LOSS_TYPES)}, got {loss_type!r}")


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The mean of x (N, T) over the tokens where mask is 1 (0 where there are none): TRL's metrics' mean.

    Args:
        x: per-token values.
        mask: the completion mask.
    """
    mask = mask.to(x.dtype)
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


# ---- the objective ----------------------------------------------------------------------------------


@dataclass
class Prompts:
    """Prompts as TRL's prompt-only rows, and their ids as the policy reads them.

    Args:
        rows: each row's "prompt" (a string or a list of messages) and its other columns.
        ids: each prompt's token ids (a conversation rendered with the chat template and the assistant's start).
    """

    rows: list[dict[str, Any]]
    ids: list[list[int]]

    def __len__(self) -> int:
        return len(self.rows)


@dataclass
class Plan:
    """What GRPO trains with, settled before the run begins (tinygpt.align.grpo_run builds it).

    Args:
        config: the GRPO settings.
        train: the prompts rollouts are drawn from.
        held_out: the prompts an evaluation answers.
        rewards: the reward functions, the task's first.
        tokenizer: the policy's.
        stops: the ids that end a completion (EOS, the end of turn, a task's end of answer).
        hidden: the stop ids that are no text (left out of a completion as the rewards read it).
        max_new_tokens: a completion's most tokens.
        task: the built-in task, whose checker gives the held-out accuracy and pass@k.
        reference: builds the frozen reference of a full run with beta > 0 (a LoRA run's is its base, the
            adapters switched off).
    """

    config: GRPOConfig
    train: Prompts
    held_out: Prompts
    rewards: list[Reward]
    tokenizer: Any
    stops: list[int]
    hidden: set[int]
    max_new_tokens: int
    task: Any = None
    reference: Callable[[], GPT] | None = None

    def texts(self, rollouts: Rollouts) -> list[Any]:
        """Each completion's text as the rewards read it, without the stop ids that are no text."""
        ids = (rollouts.ids(i) for i in range(len(rollouts)))
        return [self.tokenizer.decode([t for t in row if t not in self.hidden]) for row in ids]


@dataclass
class Scored:
    """A batch of rollouts and what the loss needs of them, as draw makes it.

    Args:
        rollouts: the completions.
        advantages: (N,) each completion's.
        mask: (N, L) the tokens that count in the loss.
        old_logps: (N, L) the sampling policy's log-probs, from a forward pass (num_iterations > 1), else None.
        ref_logps: (N, L) the reference's (beta > 0), else None.
        metrics: the rollouts' metrics (reward, reward_std, rewards/NAME/mean, ...), scalar tensors.
    """

    rollouts: Rollouts
    advantages: torch.Tensor
    mask: torch.Tensor
    old_logps: torch.Tensor | None
    ref_logps: torch.Tensor | None
    metrics: dict[str, torch.Tensor]

    def state(self) -> dict[str, Any]:
        r = self.rollouts
        return {"prompts": r.prompts, "completions": r.completions, "rollout_mask": r.mask, "logps": r.logps,
                "truncated": r.truncated, "advantages": self.advantages, "mask": self.mask,
                "old_logps": self.old_logps, "ref_logps": self.ref_logps, "metrics": self.metrics}

    @classmethod
    def of_state(cls, s: dict[str, Any]) -> Scored:
        rollouts = Rollouts(s["prompts"], s["completions"], s["rollout_mask"], s["logps"], s["truncated"])
        return cls(rollouts, s["advantages"], s["mask"], s["old_logps"], s["ref_logps"], s["metrics"])


@dataclass
class RolloutBatch(Batch):
    """A micro-batch of GRPO: positions are the prompts' indices, and `scored` what its loss takes."""

    scored: Scored | None = field(default=None)


class GRPO(Objective):
    """Group relative policy optimisation on the one training loop: each micro-batch batch_size completions,
    batch_size / num_generations prompts drawn at random from the plan's with num_generations completions
    each. With num_iterations > 1 each step's rollouts serve that many optimizer steps (a step's grad_accum
    micro-batches generated, then gone through again), as TRL's num_iterations.

    Raises:
        ConfigError: a batch_size that is not a multiple of num_generations.
        TrainingError: several processes (GRPO's rollouts run on one).
    """

    evaluate_first = True  # the held-out scores at step 0: the curves start at the model trained from

    def __init__(self, dataset: DataSet, cfg: TrainConfig, window: int, ctx: Dist, *, plan: Plan) -> None:
        super().__init__(dataset, cfg, window, ctx)
        group = plan.config.num_generations
        if ctx.enabled:
            raise TrainingError("GRPO trains on one process: its rollouts are not shared between processes yet "
                                "(run it without torchrun)")
        if cfg.batch_size % group:
            raise ConfigError(f"batch_size: {cfg.batch_size} completions a micro-step are not whole groups of "
                              f"num_generations {group}: use a multiple of {group}")
        self.plan, self.group, self.prompts_per_batch = plan, group, cfg.batch_size // group
        self.generator = torch.Generator().manual_seed(cfg.seed)
        self.cache: list[Scored] = []  # a step's micro-batches, gone through num_iterations times
        self.drawn = 0  # micro-batches drawn so far
        self._reference: GPT | None = None

    def draw(self, model: GPT) -> Batch:
        cycle = self.cfg.grad_accum * self.plan.config.num_iterations
        k = self.drawn % cycle
        self.drawn += 1
        if k >= self.cfg.grad_accum:  # another pass over this step's rollouts
            scored = self.cache[k % self.cfg.grad_accum]
            return RolloutBatch(torch.empty(0, dtype=torch.long), (), int(scored.mask.sum()), scored)
        which = torch.randint(len(self.plan.train), (self.prompts_per_batch,), generator=self.generator)
        scored = self._rollouts(model, which.tolist())
        self.cache = [*self.cache[: k], scored] if k else [scored]
        return RolloutBatch(which, (), int(scored.mask.sum()), scored)

    def _rollouts(self, model: GPT, which: list[int]) -> Scored:
        """The rollouts of prompts `which`, scored: their advantages, and the log-probs the loss compares with."""
        plan, cfg = self.plan, self.plan.config
        sampling = SampleConfig(temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p)
        rollouts = sample_groups(model, [plan.train.ids[i] for i in which], self.group, plan.max_new_tokens,
                                 config=sampling, stop_tokens=plan.stops, generator=self.generator,
                                 vocab_size=plan.tokenizer.vocab_size)
        rows = [plan.train.rows[i] for i in which]
        rewards = _score(plan, rows, rollouts, self.group)
        weights = torch.tensor([r.weight for r in plan.rewards])
        adv, total, zero_std = advantages(rewards, weights, self.group, cfg.scale_rewards)
        mask = rollouts.mask * (~rollouts.truncated).unsqueeze(1) if cfg.mask_truncated_completions \
            else rollouts.mask
        with torch.no_grad():
            old = completion_logps(model, rollouts, cfg.temperature) if cfg.num_iterations > 1 else None
            ref = self._reference_logps(model, rollouts) if cfg.beta > 0 else None
        metrics = _rollout_metrics(plan.rewards, rewards, total, zero_std, rollouts)
        return Scored(rollouts, adv, mask, old, ref, metrics)

    def _reference_logps(self, model: GPT, rollouts: Rollouts) -> torch.Tensor:
        """The reference's log-probs: LoRA's base with the adapters off, else the frozen copy of FROM."""
        if lora_config_of(model) is not None:
            from ..lora import adapters_off

            with adapters_off(model):
                return completion_logps(model, rollouts, self.plan.config.temperature)
        if self._reference is None:
            self._reference = self.plan.reference().to(model.wte.weight.device).eval().requires_grad_(False)
        return completion_logps(self._reference, rollouts, self.plan.config.temperature)

    def loss(self, model: torch.nn.Module, batch: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        cfg, s = self.plan.config, batch.scored
        logps = completion_logps(model, s.rollouts, cfg.temperature)
        old = s.old_logps if s.old_logps is not None else logps.detach()
        losses, parts = token_losses(logps, old, s.advantages, epsilon_low=cfg.epsilon, epsilon_high=cfg.epsilon_high,
                                     beta=cfg.beta, ref_logps=s.ref_logps)
        loss = reduce_loss(losses, s.mask, cfg.loss_type, max_completion_length=self.plan.max_new_tokens)
        low, high = parts["clipped_low"], parts["clipped_high"]
        metrics = {**s.metrics, "clip_ratio/low_mean": masked_mean(low, s.mask),
                   "clip_ratio/high_mean": masked_mean(high, s.mask),
                   "clip_ratio/region_mean": masked_mean(torch.maximum(low, high), s.mask)}
        if "kl" in parts:
            metrics["kl"] = masked_mean(parts["kl"], s.mask).detach()
        return loss, metrics

    def evaluate(self, model: GPT, iters: int | None) -> dict[str, float]:
        n = len(self.plan.held_out)
        if iters is not None:  # a time budget's last evaluation: the share of the held-out prompts it affords
            n = max(1, math.ceil(n * iters / self.cfg.eval_iters))
        record = held_out_scores(model, self.plan, n, self.cfg.seed)
        return {"val_loss": -record["reward"], **{f"val_{k}": v for k, v in record.items()}}

    def save_state(self, state: dict[str, Any]) -> None:
        state["rng"]["data"] = self.generator.get_state()
        k = self.drawn % (self.cfg.grad_accum * self.plan.config.num_iterations)
        # between a step's passes over its rollouts (num_iterations > 1), those rollouts, to go on with
        state["grpo"] = {"drawn": self.drawn, "cache": [s.state() for s in self.cache] if k else []}

    def restore_state(self, state: dict[str, Any], run: RunFolder) -> None:
        saved = state.get("grpo")
        if not isinstance(saved, dict):
            raise TrainingError(f"{run.path} is not a GRPO run (its training state has no rollouts' place)")
        self.generator.set_state(state["rng"]["data"])
        self.drawn = int(saved["drawn"])
        self.cache = [Scored.of_state(s) for s in saved["cache"]]


def _score(plan: Plan, rows: list[dict[str, Any]], rollouts: Rollouts, group: int) -> torch.Tensor:
    """Every reward function's score of the rollouts of `rows` (N, F), called as TRL calls them: a conversation's
    completion as a list of one assistant message."""
    texts = plan.texts(rollouts)
    chat = [isinstance(row["prompt"], list) for row in rows for _ in range(group)]
    completions = [[{"role": "assistant", "content": t}] if c else t for t, c in zip(texts, chat)]
    prompts = [row["prompt"] for row in rows for _ in range(group)]
    ids = [rollouts.ids(i) for i in range(len(rollouts))]
    return score(plan.rewards, prompts, completions, ids, columns_of(rows, group))


def _rollout_metrics(rewards: list[Reward], per_function: torch.Tensor, total: torch.Tensor, zero_std: torch.Tensor,
                     rollouts: Rollouts) -> dict[str, torch.Tensor]:
    """The rollouts' metrics under TRL's names: the reward and its spread, each function's, the share of
    groups whose rewards agree (no signal), the completions' lengths and the share cut at the limit."""
    lengths = rollouts.lengths.float()
    ended = lengths[~rollouts.truncated]
    out = {"reward": torch.nanmean(total), "reward_std": nanstd(total),
           "frac_reward_zero_std": zero_std.float().mean(),
           "completions/mean_length": lengths.mean(), "completions/min_length": lengths.min(),
           "completions/max_length": lengths.max(), "completions/clipped_ratio": rollouts.truncated.float().mean(),
           "completions/mean_terminated_length": ended.mean() if len(ended) else torch.tensor(0.0)}
    for j, reward in enumerate(rewards):
        out[f"rewards/{reward.label}/mean"] = torch.nanmean(per_function[:, j])
        out[f"rewards/{reward.label}/std"] = nanstd(per_function[:, j])
    return {k: torch.nan_to_num(v.float()) for k, v in out.items()}


EVAL_SEED = 4321  # pass@k's samples: the same draws at every evaluation, so two evaluations differ by the weights


@torch.no_grad()
def held_out_scores(model: GPT, plan: Plan, n: int | None = None, seed: int = 0) -> dict[str, float]:
    """The first n held-out prompts answered greedily (the mean reward, and with a task the accuracy) and,
    with a task and pass_k > 0, sampled pass_k times each (pass@1: a sample's accuracy; pass@k: a prompt's
    share with a right one among its k).

    Args:
        model: the policy.
        plan: the prompts, rewards and task.
        n: how many held-out prompts (default all).
        seed: added to pass@k's fixed seed.
    """
    cfg = plan.config
    which = list(range(len(plan.held_out) if n is None else min(n, len(plan.held_out))))
    rows, ids = [plan.held_out.rows[i] for i in which], [plan.held_out.ids[i] for i in which]
    greedy = sample_groups(model, ids, 1, plan.max_new_tokens, config=SampleConfig(greedy=True),
                           stop_tokens=plan.stops, vocab_size=plan.tokenizer.vocab_size)
    rewards = _score(plan, rows, greedy, 1)
    weights = torch.tensor([r.weight for r in plan.rewards])
    out = {"reward": float(torch.nan_to_num((rewards * weights).nansum(1)).mean()),
           "mean_length": float(greedy.lengths.float().mean())}
    if plan.task is None:
        return out
    answers = [row["answer"] for row in rows]
    texts = plan.texts(greedy)
    out["accuracy"] = sum(plan.task.correct(t, a) for t, a in zip(texts, answers)) / len(rows)
    if cfg.pass_k:
        g = torch.Generator().manual_seed(EVAL_SEED + seed)
        sampled = sample_groups(model, ids, cfg.pass_k, plan.max_new_tokens, config=SampleConfig(
            temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p), stop_tokens=plan.stops, generator=g,
            vocab_size=plan.tokenizer.vocab_size)
        right = torch.tensor([plan.task.correct(t, answers[i // cfg.pass_k])
                              for i, t in enumerate(plan.texts(sampled))]).view(len(rows), cfg.pass_k)
        out["pass@1"] = float(right.float().mean())
        out[f"pass@{cfg.pass_k}"] = float(right.any(dim=1).float().mean())
    return out
