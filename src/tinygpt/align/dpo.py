"""Direct preference optimisation: a completion's log-prob under a model, the losses and metrics of a batch
of pairs from the log-probs of their chosen and rejected completions under the policy and the reference, as
TRL's DPOTrainer defines them, and DPO as an objective of the one training loop.

    completion_logps(logits, ids, mask)       each row's log-prob of its completion tokens, summed
    pair_logps(model, ids, mask)              the chosen and rejected rows' log-probs (TRL's layout: the
                                              chosen rows, then the rejected ones) and their token counts
    dpo_losses(...)                           each pair's loss: sigmoid, ipo, hinge or robust
    sft_loss(chosen_logps, chosen_tokens)     the negative log-likelihood of the chosen completions, a
                                              token's mean (TRL's "sft" loss type)
    dpo_metrics(...)                          TRL's logged names and their values
    Reference                                 where the reference's log-probs come from: a frozen model, or
                                              a LoRA policy with its adapters off
    DPO                                       the objective: pairs drawn from a preference data folder
    collapsing(first, record)                 whether an evaluation shows pure DPO's failure: the chosen
                                              completions' log-probs falling while the margin grows
    CollapseWatch(warn)                       a callback that says so, once a run, in one line
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F

from ..config.preference import DPO_LOSSES, DPOConfig
from ..config.train import TrainConfig
from ..data.folder import DataSet
from ..distributed import Dist
from ..errors import ConfigError
from ..lora import adapters_off
from ..model import GPT
from ..train.callbacks import TrainCallback
from ..train.objectives import Batch
from .pairs import PairObjective

METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")


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
        loss: one of DPO_LOSSES.
        label_smoothing: robust's share of flipped pairs.
        chosen_tokens, rejected_tokens: (B,) the completions' token counts (ipo needs them).

    Returns:
        (B,) float32: the batch's loss is their mean.
    """
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
    if loss == "robust":
        e = label_smoothing
        return (-(1 - e) * F.logsigmoid(beta * delta) + e * F.logsigmoid(-beta * delta)) / (1 - 2 * e)
    raise ConfigError(f"loss: must be one of {', '.join(DPO_LOSSES)}, got {loss!r}")


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


class Reference:
    """Where DPO's reference log-probs come from: a frozen model (FROM as the run starts from it, or another
    named), loaded at its first use and kept; or, with no model to load, the LoRA policy itself with its
    adapters off (its base exactly, no second copy in memory).

    Args:
        load: the reference model (on the CPU); None for a LoRA policy's adapters-off base.
    """

    def __init__(self, load: Callable[[], GPT] | None = None) -> None:
        self.load, self.model = load, None

    @contextmanager
    def of(self, policy: GPT) -> Iterator[GPT]:
        """Within it, the reference model for `policy` (unwrapped), in eval mode, under torch.no_grad."""
        with torch.no_grad():
            if self.load is not None:
                if self.model is None:
                    device = next(policy.parameters()).device
                    self.model = self.load().float().to(device).eval().requires_grad_(False)
                yield self.model
                return
            training = policy.training
            policy.eval()  # the base's log-probs without the policy's dropout
            try:
                with adapters_off(policy):
                    yield policy
            finally:
                policy.train(training)

    def drop(self) -> None:
        """Free the loaded model (its log-probs were precomputed)."""
        self.model = None


class DPO(PairObjective):
    """Direct preference optimisation on a preference data folder's pairs (PairObjective: drawn at random,
    fitted to the window, evaluated in order): the chosen and rejected completions' log-probs under the policy
    against the reference's; the loss TRL's config.loss, plus config.sft_weight times the chosen completions'
    NLL. It logs TRL's metrics (METRICS) a step, and its evaluations the same loss, TRL's metrics and the
    policy's preference accuracy (the share of pairs whose chosen completion it finds the likelier).

    Args:
        dataset, cfg, window, ctx: as Objective takes them.
        config: DPO's settings.
        reference: where the reference's log-probs come from.

    Raises:
        TrainingError: as preference_pairs.
    """

    def __init__(self, dataset: DataSet, cfg: TrainConfig, window: int, ctx: Dist, *, config: DPOConfig,
                 reference: Reference) -> None:
        super().__init__(dataset, cfg, window, ctx)
        self.config, self.reference = config, reference
        self.precomputed: dict[str, torch.Tensor] | None = None  # per split: (pairs, 2) chosen, rejected

    def draw(self, model: GPT) -> Batch:
        positions, tokens = self.positions()
        ids, mask = (t.to(self.ctx.device) for t in self.pairs["train"].get(positions))
        return Batch(positions, (ids, mask, *self._reference_logps(model, "train", positions, ids, mask)), tokens)

    def loss(self, model: torch.nn.Module, batch: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        ids, mask, ref_chosen, ref_rejected = batch.inputs
        chosen, rejected, chosen_tokens, rejected_tokens = pair_logps(model, ids, mask)
        loss = self._losses(chosen, rejected, ref_chosen, ref_rejected, chosen_tokens, rejected_tokens).mean()
        if self.config.sft_weight:
            loss = loss + self.config.sft_weight * sft_loss(chosen, chosen_tokens)
        return loss, dpo_metrics(chosen, rejected, ref_chosen, ref_rejected, self.config.beta)

    @torch.no_grad()
    def evaluate(self, model: GPT, iters: int | None) -> dict[str, float]:
        sums = dict.fromkeys(("loss", "nll", "chosen_tokens", "preference_accuracy", *METRICS), 0.0)
        for positions in self.eval_positions(iters):
            ids, mask = (t.to(self.ctx.device) for t in self.pairs["val"].get(positions))
            chosen, rejected, chosen_tokens, rejected_tokens = pair_logps(model, ids, mask)
            ref_chosen, ref_rejected = self._reference_logps(model, "val", positions, ids, mask)
            losses = self._losses(chosen, rejected, ref_chosen, ref_rejected, chosen_tokens, rejected_tokens)
            metrics = dpo_metrics(chosen, rejected, ref_chosen, ref_rejected, self.config.beta)
            found = {"loss": losses.sum(), "nll": -chosen.sum(), "chosen_tokens": chosen_tokens.sum(),
                     "preference_accuracy": (chosen > rejected).sum(),
                     **{name: value * len(positions) for name, value in metrics.items()}}
            for name, value in found.items():
                sums[name] += float(value)
        totals, n = self.totals(sums), self.eval_size(iters)
        loss = totals.pop("loss") / n
        nll, tokens = totals.pop("nll"), totals.pop("chosen_tokens")
        if self.config.sft_weight:
            loss += self.config.sft_weight * nll / max(tokens, 1.0)
        return {"val_loss": loss, **{f"val_{name}": value / n for name, value in totals.items()}}

    def _losses(self, chosen: torch.Tensor, rejected: torch.Tensor, ref_chosen: torch.Tensor,
                ref_rejected: torch.Tensor, chosen_tokens: torch.Tensor, rejected_tokens: torch.Tensor
                ) -> torch.Tensor:
        """Each pair's DPO loss under the run's settings."""
        c = self.config
        return dpo_losses(chosen, rejected, ref_chosen, ref_rejected, beta=c.beta, loss=c.loss,
                          label_smoothing=c.label_smoothing, chosen_tokens=chosen_tokens,
                          rejected_tokens=rejected_tokens)

    def _reference_logps(self, policy: GPT, split: str, positions: torch.Tensor, ids: torch.Tensor,
                         mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The reference's log-probs of the chosen and rejected completions of the pairs at `positions`."""
        if self.config.precompute_ref:
            if self.precomputed is None:
                self.precomputed = self._precompute(policy)
            both = self.precomputed[split][positions].to(ids.device)
            return both[:, 0], both[:, 1]
        with self.reference.of(policy) as reference:
            chosen, rejected, _, _ = pair_logps(reference, ids, mask)
        return chosen, rejected

    def _precompute(self, policy: GPT) -> dict[str, torch.Tensor]:
        """Every pair's reference log-probs, computed once, and the reference model let go."""
        out = {}
        with self.reference.of(policy) as reference:
            for split, pairs in self.pairs.items():
                rows = []
                for positions in torch.arange(len(pairs)).split(self.cfg.batch_size):
                    ids, mask = (t.to(self.ctx.device) for t in pairs.get(positions))
                    chosen, rejected, _, _ = pair_logps(reference, ids, mask)
                    rows.append(torch.stack([chosen, rejected], dim=1).float())
                out[split] = torch.cat(rows)
        self.reference.drop()
        return out


def collapsing(first: dict[str, Any], record: dict[str, Any]) -> bool:
    """Whether an evaluation shows DPO's known failure against the first: the chosen completions' log-probs
    fell while the margin between the sides grew (the policy pushes both sides down, the rejected faster:
    its preferences look better while its chosen answers grow less likely).

    Args:
        first: the step-0 evaluation's record (val_logps/chosen, val_rewards/margins).
        record: a later one's.
    """
    keys = ("val_logps/chosen", "val_rewards/margins")
    if not all(k in first and k in record for k in keys):
        return False
    return record["val_logps/chosen"] < first["val_logps/chosen"] and \
        record["val_rewards/margins"] > first["val_rewards/margins"]


class CollapseWatch(TrainCallback):
    """Says, once, when an evaluation shows DPO's collapse against the first evaluation the run makes (its step
    0 in a new run): the validation pairs' chosen log-probs fell while the margin grew.

    Args:
        warn: called with the one-line warning.
    """

    def __init__(self, warn: Callable[[str], None]) -> None:
        self.warn, self.first, self.warned = warn, None, False

    def on_eval(self, record: dict[str, Any]) -> None:
        if self.first is None:
            self.first = record
        elif not self.warned and collapsing(self.first, record):
            self.warned = True
            chosen = "val_logps/chosen"
            self.warn(f"step {record['step']}: the chosen completions' log-probs fell ({self.first[chosen]:.3f} -> "
                      f"{record[chosen]:.3f}, logps/chosen on the validation pairs) while the margin grew to "
                      f"{record['val_rewards/margins']:.3f}: DPO is making the chosen answers less likely too; an "
                      "--sft-weight above 0 keeps them")
