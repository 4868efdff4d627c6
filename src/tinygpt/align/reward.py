"""A reward model's scores and its loss as pure functions, as TRL's RewardTrainer defines them.

    scores(model, ids, last)                      each row's score: the reward head's output at its last token
    score_completions(model, tok, prompts, ...)   each completion to its prompt, written as a pair's side
    reward_loss(chosen, rejected, ...)            Bradley-Terry: -log sigmoid(r_chosen - r_rejected - margin),
                                                  a mean, plus TRL's centering term
    reward_metrics(chosen, rejected)              TRL's logged names: accuracy, margin, min/mean/max_reward
    BradleyTerry                                  the objective: a reward model trained on a preference folder

A reward model is the one GPT with its head a score (GPTConfig.head "reward"; tinygpt.model.score_head makes a
language model one).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..config.preference import RewardConfig
from ..config.train import TrainConfig
from ..data.folder import DataSet
from ..distributed import Dist
from ..model import GPT
from ..tokenizer.base import Tokenizer, encode_named
from ..tokenizer.chat import render_chat
from ..train.objectives import Batch
from .pairs import PairObjective

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


@torch.no_grad()
def score_completions(model: GPT, tokenizer: Tokenizer, prompts: list, completions: list) -> torch.Tensor:
    """A reward model's score of each completion to its prompt, each written as its training wrote a pair's
    side: a text the prompt and the completion (no end of text), a conversation (a list of messages, the
    completion the assistant's) rendered with the chat template; its last block_size tokens.

    Args:
        model: a reward model, in eval mode.
        tokenizer: its tokenizer.
        prompts, completions: one of each per score.

    Returns:
        (N,) float32.

    Raises:
        ConfigError: text its vocabulary cannot write; ChatError: a conversation its template refuses.
    """
    block = model.config.block_size
    rows = [(render_chat(tokenizer, p + c).ids if isinstance(p, list)
             else encode_named(tokenizer, p + c, "the prompt and completion"))[-block:]
            for p, c in zip(prompts, completions)]
    ids = torch.zeros(len(rows), max(map(len, rows)), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
    return scores(model, ids.to(model.wte.weight.device), torch.tensor([len(row) - 1 for row in rows]))


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


class BradleyTerry(PairObjective):
    """A reward model trained on a preference data folder's pairs (PairObjective: drawn at random, fitted to
    the window, evaluated in order): each side's score at its last token, the Bradley-Terry loss with the
    data's margins and config.center's centering (reward_loss), TRL's metrics (METRICS) logged a step; its
    evaluations the same loss and metrics on the validation pairs.

    Args:
        dataset, cfg, window, ctx: as Objective takes them.
        config: the reward model's settings.

    Raises:
        TrainingError: as preference_pairs.
    """

    def __init__(self, dataset: DataSet, cfg: TrainConfig, window: int, ctx: Dist, *,
                 config: RewardConfig) -> None:
        super().__init__(dataset, cfg, window, ctx)
        self.config = config

    def draw(self, model: GPT) -> Batch:
        positions, tokens = self.positions()
        return Batch(positions, self._rows("train", positions), tokens)

    def loss(self, model: torch.nn.Module, batch: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        ids, last, margins = batch.inputs
        chosen, rejected = scores(model, ids, last).chunk(2)
        return reward_loss(chosen, rejected, margins, self.config.center), reward_metrics(chosen, rejected)

    @torch.no_grad()
    def evaluate(self, model: GPT, iters: int | None) -> dict[str, float]:
        sums = dict.fromkeys(("loss", "accuracy", "margin", "mean_reward"), 0.0)
        lowest, highest = float("inf"), -float("inf")
        for positions in self.eval_positions(iters):
            ids, last, margins = self._rows("val", positions)
            chosen, rejected = scores(model, ids, last).chunk(2)
            metrics = reward_metrics(chosen, rejected)
            metrics["loss"] = reward_loss(chosen, rejected, margins, self.config.center)
            for name in sums:
                sums[name] += float(metrics[name]) * len(positions)
            lowest, highest = min(lowest, float(metrics["min_reward"])), max(highest, float(metrics["max_reward"]))
        n = self.eval_size(iters)
        record = {f"val_{name}": value / n for name, value in self.totals(sums).items()}
        low, high = self.ctx.max([-lowest, highest])
        return {**record, "val_min_reward": -low, "val_max_reward": high}

    def _rows(self, split: str, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The pairs' rows to score, their last tokens' indices, and their margins (None where the data has
        none), on the run's device."""
        ids, last, margins = self.pairs[split].scored(positions)
        device = self.ctx.device
        return ids.to(device), last.to(device), margins.to(device) if self.dataset.margins is not None else None
