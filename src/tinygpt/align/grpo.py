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
"""

from __future__ import annotations

import torch

from ..config.grpo import LOSS_TYPES, SCALE_REWARDS

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
