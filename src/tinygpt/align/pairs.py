"""What the objectives that learn from preference pairs share (DPO, a reward model): the data folder's pairs
fitted to the window, a micro-batch's pairs drawn at random, the validation pairs scored in order, and
what a resume needs.

    PairObjective       an Objective on a preference data folder: pairs, positions, eval_positions, totals
    preference_pairs    both splits' pairs fitted to the window, each holding at least one
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from ..config.train import TrainConfig
from ..data.batches import Pairs, share
from ..data.folder import DataSet
from ..distributed import Dist
from ..errors import TrainingError
from ..run_folder import RunFolder
from ..train.objectives import Objective


def preference_pairs(dataset: DataSet, window: int) -> dict[str, Pairs]:
    """Both splits' pairs fitted to the window (a pair whose completions leave no room for a prompt token
    dropped and counted), each split holding at least one.

    Args:
        dataset: the run's data folder.
        window: the longest sequence, prompt and completion.

    Raises:
        TrainingError: data that are not preference pairs, or a split without a pair that fits the window.
    """
    if not dataset.is_preference:
        raise TrainingError(f"{dataset.path} holds no preference pairs: prepare them with "
                            "`tinygpt prepare FILE.jsonl --format preference`")
    pairs = {split: Pairs.of(dataset, split, window) for split in ("train", "val")}
    for split, kept in pairs.items():
        if not len(kept):
            raise TrainingError(f"the {split} split of {dataset.path} has no pair whose completions leave room in "
                                f"{window} tokens for a prompt token ({kept.dropped} dropped); use a longer "
                                "--max-length, or prepare more pairs or another --val-fraction")
    return pairs


class PairObjective(Objective):
    """An objective on preference pairs: each micro-batch batch_size pairs a process, drawn at random (with
    replacement) from the run's data generator, seeded with cfg.seed and kept by every checkpoint; each
    evaluation the first eval_iters global batches' worth of validation pairs, in order, the same ones every
    time, at step 0 too (evaluate_first: the curves start at the model trained from).

    Raises:
        TrainingError: as preference_pairs.
    """

    evaluate_first = True

    def __init__(self, dataset: DataSet, cfg: TrainConfig, window: int, ctx: Dist) -> None:
        super().__init__(dataset, cfg, window, ctx)
        self.pairs = preference_pairs(dataset, window)
        self.dropped = {split: pairs.dropped for split, pairs in self.pairs.items()}
        self.generator = torch.Generator().manual_seed(cfg.seed)

    def positions(self) -> tuple[torch.Tensor, int]:
        """This process's share of the next micro-batch's train pairs, which every process draws alike, and
        the tokens the whole micro-batch's rows hold."""
        cfg, ctx, pairs = self.cfg, self.ctx, self.pairs["train"]
        drawn = pairs.sample(cfg.batch_size * ctx.world_size, self.generator)
        return share(drawn, ctx.rank, cfg.batch_size), pairs.count(drawn)

    def eval_size(self, iters: int | None) -> int:
        """The validation pairs an evaluation scores: eval_iters (or `iters`) global batches' worth, at most
        all of them."""
        cfg = self.cfg
        return min(len(self.pairs["val"]), (cfg.eval_iters if iters is None else iters) * cfg.batch_size *
                   self.ctx.world_size)

    def eval_positions(self, iters: int | None) -> Iterator[torch.Tensor]:
        """This process's share of each global batch of the validation pairs an evaluation scores, in order (a
        process whose share of the last batch is empty gets none of it)."""
        n, step = self.eval_size(iters), self.cfg.batch_size * self.ctx.world_size
        for start in range(0, n, step):
            mine = share(torch.arange(start, min(n, start + step)), self.ctx.rank, self.cfg.batch_size)
            if len(mine):
                yield mine

    def totals(self, sums: dict[str, float]) -> dict[str, float]:
        """Sums over this process's validation pairs -> sums over every process's (the same keys, in the same
        order, in every process)."""
        return {name: self.ctx.mean(value) * self.ctx.world_size for name, value in sums.items()}

    def save_state(self, state: dict[str, Any]) -> None:
        state["rng"]["data"] = self.generator.get_state()

    def restore_state(self, state: dict[str, Any], run: RunFolder) -> None:
        self.generator.set_state(state["rng"]["data"])
