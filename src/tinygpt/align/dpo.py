"""Direct preference optimisation as pure functions: a completion's log-prob under a model, and the losses
and metrics of a batch of pairs from the log-probs of their chosen and rejected completions under the
policy and the reference, as TRL's DPOTrainer defines them.

    completion_logps(logits, ids, mask)       each row's log-prob of its completion tokens, summed
    pair_logps(model, ids, mask)              the chosen and rejected rows' log-probs (TRL's layout: the
                                              chosen rows, then the rejected ones) and their token counts
    dpo_losses(...)                           each pair's loss: sigmoid, ipo, hinge or robust
    sft_loss(chosen_logps, chosen_tokens)     the negative log-likelihood of the chosen completions, a
                                              token's mean (TRL's "sft" loss type)
    dpo_metrics(...)                          TRL's logged names and their values
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..errors import ConfigError

LOSSES = ("sigmoid", "ipo", "hinge", "robust")
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")


def check_loss(loss: str, beta: float, label_smoothing: float = 0.0) -> None:
    """Refuse a loss tinygpt does not compute, a beta that is not positive, and a label smoothing outside
    robust's [0, 0.5).

    Args:
        loss: one of LOSSES.
        beta: the strength of the pull towards the reference.
        label_smoothing: the share of pairs robust DPO takes to be flipped.

    Raises:
        ConfigError: naming the setting.
    """
    if loss not in LOSSES:
        raise ConfigError(f"loss: must be one of {', '.join(LOSSES)}, got {loss!r}")
    if not (isinstance(beta, (int, float)) and math.isfinite(beta) and beta > 0):
        raise ConfigError(f"beta: must be a positive number, got {beta!r}")
    if not (isinstance(label_smoothing, (int, float)) and 0.0 <= label_smoothing < 0.5):
        raise ConfigError(f"label_smoothing: must be in [0, 0.5), got {label_smoothing!r}")


def completion_logps(logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each row's log-probability of its completion: the sum over its completion tokens of the log-softmax
    of the logits before each, in float32.

    Args:
        logits: (N, T, V) the model's logits for ids.
        ids: (N, T) the rows, prompt and completion, right-padded.
        mask: (N, T) 1 on completion tokens (TRL's completion_mask).

    Returns:
        (N,) float32.
    """
    logits = logits[:, :-1].float()
    targets, counted = ids[:, 1:], mask[:, 1:] > 0
    token = logits.gather(2, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)  # (N, T-1)
    return torch.where(counted, token, 0.0).sum(dim=1)


def pair_logps(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The chosen and rejected completions' log-probs under `model`, for a batch laid out as TRL's collator
    does (tinygpt.data.batches.Pairs.get): B rows of prompt and chosen completion, then B of prompt and
    rejected completion.

    Args:
        model: the policy or the reference (a GPT, maybe wrapped).
        ids, mask: (2B, T) the rows and their completion mask.

    Returns:
        chosen and rejected log-probs (B,), and their completions' token counts (B,).
    """
    logps = completion_logps(model(ids), ids, mask)
    tokens = mask.sum(dim=1).to(logps.dtype)
    chosen, rejected = logps.chunk(2)
    chosen_tokens, rejected_tokens = tokens.chunk(2)
    return chosen, rejected, chosen_tokens, rejected_tokens


def dpo_losses(
    chosen: torch.Tensor, rejected: torch.Tensor, ref_chosen: torch.Tensor, ref_rejected: torch.Tensor, *,
    beta: float, loss: str = "sigmoid", label_smoothing: float = 0.0, chosen_tokens: torch.Tensor | None = None,
    rejected_tokens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Each pair's DPO loss, as TRL defines its loss types, from the log-ratios of policy to reference:

        sigmoid   -log sigmoid(beta d), d = (chosen - ref_chosen) - (rejected - ref_rejected)
        hinge     relu(1 - beta d)
        ipo       (d' - 1 / (2 beta))^2, d' the same difference with each log-ratio divided by its
                  completion's tokens
        robust    (-(1 - e) log sigmoid(beta d) + e log sigmoid(-beta d)) / (1 - 2 e), e = label_smoothing

    Args:
        chosen, rejected: (B,) the policy's log-probs of the chosen and rejected completions.
        ref_chosen, ref_rejected: (B,) the reference's.
        beta: how strongly the policy is held to the reference.
        loss: one of LOSSES.
        label_smoothing: robust's share of flipped pairs.
        chosen_tokens, rejected_tokens: (B,) the completions' token counts (ipo needs them).

    Returns:
        (B,) float32: the batch's loss is their mean.
    """
    check_loss(loss, beta, label_smoothing)
    chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
    delta = chosen_ratio - rejected_ratio
    if loss == "sigmoid":
        return -F.logsigmoid(beta * delta)
    if loss == "hinge":
        return torch.relu(1 - beta * delta)
    if loss == "ipo":
        if chosen_tokens is None or rejected_tokens is None:
            raise ConfigError("loss ipo: needs the completions' token counts")
        per_token = chosen_ratio / chosen_tokens.clamp(min=1.0) - rejected_ratio / rejected_tokens.clamp(min=1.0)
        return (per_token - 1 / (2 * beta)) ** 2
    e = label_smoothing
    return (-(1 - e) * F.logsigmoid(beta * delta) + e * F.logsigmoid(-beta * delta)) / (1 - 2 * e)


def sft_loss(chosen: torch.Tensor, chosen_tokens: torch.Tensor) -> torch.Tensor:
    """The chosen completions' negative log-likelihood, a mean over their tokens (TRL's "sft" loss type,
    which its DPOTrainer adds to the DPO loss with a weight): what keeps the chosen answers likely while
    DPO widens the gap between the sides.

    Args:
        chosen: (B,) the policy's log-probs of the chosen completions.
        chosen_tokens: (B,) their token counts.
    """
    return -chosen.sum() / chosen_tokens.sum().clamp(min=1.0)


@torch.no_grad()
def dpo_metrics(chosen: torch.Tensor, rejected: torch.Tensor, ref_chosen: torch.Tensor, ref_rejected: torch.Tensor,
                beta: float) -> dict[str, torch.Tensor]:
    """TRL's DPO metrics of a batch, each a mean over its pairs: the implicit rewards beta x (policy -
    reference log-prob) of each side, the share of pairs whose chosen reward is the higher (a tie counts as
    not), their margin, and the policy's log-probs of each side.

    Args:
        chosen, rejected, ref_chosen, ref_rejected: (B,) log-probs, as for dpo_losses.
        beta: as for dpo_losses.

    Returns:
        METRICS' names -> scalar tensors.
    """
    chosen_rewards, rejected_rewards = beta * (chosen - ref_chosen), beta * (rejected - ref_rejected)
    values = (chosen_rewards, rejected_rewards, (chosen_rewards > rejected_rewards).float(),
              chosen_rewards - rejected_rewards, chosen, rejected)
    return {name: v.float().mean() for name, v in zip(METRICS, values)}
