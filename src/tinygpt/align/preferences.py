"""What a model prefers on preference pairs, as `tinygpt eval` and the DPO and reward reports read it: a
language model by its completions' log-probs (the one it finds the likelier is the one it prefers), a
reward model by its scores.

    measure_pairs(model, pairs)   pair accuracy, the mean of each side and their margin (a reward model's
                                  Bradley-Terry loss too), over every pair of a split
"""

from __future__ import annotations

from typing import Any

import torch

from ..data.batches import Pairs
from ..model import GPT
from .dpo import pair_logps
from .reward import reward_loss, scores


@torch.no_grad()
def measure_pairs(model: GPT, pairs: Pairs, batch_size: int = 16, device: torch.device | str = "cpu"
                  ) -> dict[str, Any]:
    """A model's preferences on every pair of a split, fitted to its window: the share of pairs whose chosen
    side it prefers (a tie is no win), and the mean value of each side and of their difference; the values
    are a language model's summed log-probs of each completion ("logps"), or a reward model's scores
    ("scores", with their Bradley-Terry loss, the data's margins in it).

    Args:
        model: a language model or a reward model (config.head), put in eval mode.
        pairs: the split's pairs (data.batches.Pairs).
        batch_size: pairs a forward pass.
        device: where the model is.

    Returns:
        {"pairs", "accuracy", "chosen", "rejected", "margin", "values"} (and "loss" for a reward model).
    """
    model.eval()
    reward = model.config.head == "reward"
    chosen, rejected, losses = [], [], []
    for positions in torch.arange(len(pairs)).split(batch_size):
        if reward:
            ids, last, margins = (t.to(device) for t in pairs.scored(positions))
            c, r = scores(model, ids, last).chunk(2)
            losses.append(reward_loss(c, r, margins if pairs.margins is not None else None) * len(positions))
        else:
            ids, mask = (t.to(device) for t in pairs.get(positions))
            c, r, _, _ = pair_logps(model, ids, mask)
        chosen.append(c.float().cpu())
        rejected.append(r.float().cpu())
    c, r = torch.cat(chosen), torch.cat(rejected)
    out = {"pairs": len(c), "accuracy": float((c > r).float().mean()), "chosen": float(c.mean()),
           "rejected": float(r.mean()), "margin": float((c - r).mean()), "values": "scores" if reward else "logps"}
    if reward:
        out["loss"] = float(sum(losses)) / len(c)
    return out
