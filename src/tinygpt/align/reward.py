"""A reward model's scores and its loss as pure functions, as TRL's RewardTrainer defines them.

    scores(model, ids, last)                      each row's score: the reward head's output at its last token
    reward_loss(chosen, rejected, ...)            Bradley-Terry: -log sigmoid(r_chosen - r_rejected - margin),
                                                  a mean, plus TRL's centering term
    reward_metrics(chosen, rejected)              TRL's logged names: accuracy, margin, min/mean/max_reward

A reward model is the one GPT with its head a score (GPTConfig.head "reward").
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

METRICS = ("accuracy", "margin", "min_reward", "mean_reward", "max_reward")


def scores(model: torch.nn.Module, ids: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """Each row's score: the model's output at the row's last token (right padding after it changes nothing,
    attention being causal), in float32.

    Args:
        model: a reward model (GPTConfig.head "reward"), maybe wrapped.
        ids: (N, T) the rows, right-padded.
        last: (N,) each row's last token's index.

    Returns:
        (N,) float32.
    """
    out = model(ids)  # (N, T, 1)
    return out[torch.arange(len(ids), device=out.device), last.to(out.device), 0].float()


def reward_loss(chosen: torch.Tensor, rejected: torch.Tensor, margin: torch.Tensor | None = None,
                center: float | None = None) -> torch.Tensor:
    """The Bradley-Terry loss of a batch of pairs: the mean of -log sigmoid(r_chosen - r_rejected - margin),
    plus, with centering, center x the mean of (r_chosen + r_rejected)^2 (TRL's center_rewards_coefficient,
    which pulls the scores towards zero mean).

    Args:
        chosen, rejected: (B,) the scores of each pair's sides.
        margin: (B,) by how much each chosen side should win (TRL's "margin" column); None for none.
        center: the centering term's coefficient; None for none.
    """
    diff = chosen - rejected if margin is None else chosen - rejected - margin.to(chosen.dtype)
    loss = -F.logsigmoid(diff).mean()
    if center is not None:
        loss = loss + center * torch.mean((chosen + rejected) ** 2)
    return loss


@torch.no_grad()
def reward_metrics(chosen: torch.Tensor, rejected: torch.Tensor) -> dict[str, torch.Tensor]:
    """TRL's reward metrics of a batch: the share of pairs whose chosen side scores higher (a tie counts as
    not), the mean margin, and the lowest, mean and highest score of all the batch's sides.

    Args:
        chosen, rejected: (B,) the scores.

    Returns:
        METRICS' names -> scalar tensors.
    """
    both = torch.cat([chosen, rejected]).float()
    values = ((chosen > rejected).float().mean(), (chosen - rejected).float().mean(), both.min(), both.mean(),
              both.max())
    return dict(zip(METRICS, values))
