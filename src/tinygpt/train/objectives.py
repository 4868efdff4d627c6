"""What a training step optimises: an objective, which the one loop calls for each micro-batch and each
evaluation, and the three of them today.

    NextToken   running text: every next token's loss, on windows of the train split drawn at random
                offsets or in order (TrainConfig.data_order)
    Masked      chat data (supervised fine-tuning): the next-token loss of the assistant's tokens only (the
                loss mask), on packed rows of whole conversations, each seeing only itself
    Distill     running text, a teacher's distributions at every position learned (KL divergence): a draft
                for speculative decoding, from its target

The loop owns the model, the optimizer, the processes, the precision, the schedule, the checkpoints and
the stop; an objective owns its data and what a step learns from it:

    draw(model)            this process's share of one micro-batch (a Batch), and what it must first
                           compute from the policy (a rollout's completions)
    loss(model, batch)     the micro-batch's loss, and the metrics to log beside it
    evaluate(model, iters) its evaluation's record, val_loss in it (keep best and the summary read it)
    save_state / restore_state   what a checkpoint keeps so that a resume draws on exactly where it stopped

draw, loss and evaluate run under the run's autocast. A new way to train (preference pairs, a reward
model, rollouts scored by a reward) is a class beside these two, handed to train() through a Start
(Start.objective), never a flag in the loop: see Objective.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ..config.train import TrainConfig
from ..data.batches import Batches, Stream, data_order, share
from ..data.folder import DataSet
from ..data.shards import ShardedTokens
from ..distributed import Dist
from ..errors import TrainingError
from ..model import GPT
from ..run_folder import RunFolder


@dataclass
class Batch:
    """One micro-batch as an objective draws it.

    Args:
        positions: where this process's rows come from in the train split (TrainCallback.on_batch gets them).
        inputs: what the objective's loss takes (for NextToken, Batches.get's tensors).
        tokens: the tokens the whole micro-batch, every process's rows, trains on (the run counts them).
    """

    positions: torch.Tensor
    inputs: tuple[torch.Tensor, ...]
    tokens: int


class Objective:
    """What a training step optimises. The loop calls, for every optimizer step, draw and loss once a
    micro-step (grad_accum of them), then backward on the mean loss; every eval_interval steps, evaluate;
    with every checkpoint, save_state; on resume, restore_state once, before the first step. Under torchrun
    every process makes the same calls in the same order, so an objective may run collectives in them.

    A new objective subclasses this, takes (dataset, cfg, window, ctx) as NextToken does, plus its own
    settings (through a closure or functools.partial as Start.objective), and refuses in its constructor
    what it cannot train on, before the run folder is touched. Whatever else it needs (a frozen reference
    model, a reward, a generator for rollouts) it builds there, or at its first draw from the model it
    is given.

    Args:
        dataset: the data folder the run trains on (load_data).
        cfg: the run's TrainConfig (batch_size is per process).
        window: the tokens a training sequence holds.
        ctx: the processes (rank, world size, device, collectives).
    """

    # True: a new run evaluates (and saves) its starting model at step 0, as keep best does, so that the
    # objective's curves start where the model did (DPO's margins and log-probs are read against step 0)
    evaluate_first = False

    def __init__(self, dataset: DataSet, cfg: TrainConfig, window: int, ctx: Dist) -> None:
        self.dataset, self.cfg, self.window, self.ctx = dataset, cfg, window, ctx

    def draw(self, model: GPT) -> Batch:
        """This process's share of the next micro-batch, which every process draws alike (the same
        generator state, or the same position in the data) before taking its own rows.

        Args:
            model: the model being trained, unwrapped (an objective that samples from the policy uses it).
        """
        raise NotImplementedError

    def loss(self, model: torch.nn.Module, batch: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The micro-batch's loss (a scalar the loop back-propagates) and metrics to log beside it: each a
        detached scalar tensor, a mean over the micro-batch's rows, which the loop averages over the
        micro-steps and the processes into the step's metrics line (DPO's rewards/accuracies, say).

        Args:
            model: the model to compute it with (wrapped for several processes, maybe compiled).
            batch: what draw returned.
        """
        raise NotImplementedError

    def evaluate(self, model: GPT, iters: int | None) -> dict[str, float]:
        """The evaluation's record, the same in every process: at least "val_loss" (lower is better: keep
        best saves on it, and the run's summary reports it), under torch.no_grad and in eval mode.

        Args:
            model: the model being trained, unwrapped.
            iters: the batches to evaluate on, where a time budget's last evaluation affords fewer than
                cfg.eval_iters; None for all of them.
        """
        raise NotImplementedError

    def save_state(self, state: dict[str, Any]) -> None:
        """Add to the training state a checkpoint keeps what a resume needs to draw on exactly where this
        run stopped (a generator's state, a position in the data). Nothing by default."""

    def restore_state(self, state: dict[str, Any], run: RunFolder) -> None:
        """Take back what save_state added (RunFolder.check_state has checked the state's shape).

        Args:
            state: the checkpoint's training state.
            run: the run folder, for messages.

        Raises:
            TrainingError: the run was trained in a way this objective would not continue.
        """


def batch_loss(model: torch.nn.Module, batch: tuple[torch.Tensor, ...], device) -> torch.Tensor:
    """The loss of one batch from Batches.get: every target's for text; the weighted targets' (the
    assistant's tokens), each conversation seeing only itself, for chat. The model computes it
    from its last hidden states (GPT.forward's targets), so a batch's logits never exist whole."""
    if len(batch) == 2:
        x, y = batch
        return model(x.to(device), targets=y.to(device))
    x, y, weights, documents = (t.to(device) for t in batch)
    return model(x, documents=documents, targets=y, loss_weights=weights)


@torch.no_grad()
def estimate_loss(
    model: GPT, tokens: np.ndarray | Batches, cfg: TrainConfig, device: torch.device, *, rank: int = 0,
    world_size: int = 1, iters: int | None = None,
) -> float:
    """Mean loss over eval_iters random batches (the first `iters` of them when given), under the caller's
    autocast; the same batches at every evaluation. On chat data (a Batches of it) the loss is the
    assistant's tokens'.

    With several processes each batch holds batch_size x world_size sequences and this process
    evaluates its own slice; the mean of the processes' results is the loss over the whole batch.
    """
    batches = tokens if isinstance(tokens, Batches) else Batches(tokens, model.config.block_size)
    g = torch.Generator().manual_seed(cfg.seed + 1)
    losses = []
    for _ in range(cfg.eval_iters if iters is None else iters):
        positions = batches.sample(cfg.batch_size * world_size, g)
        batch = batches.get(share(positions, rank, cfg.batch_size))
        losses.append(batch_loss(model, batch, device).item())
    return float(np.mean(losses))


def check_has_val(dataset: DataSet) -> None:
    """Refuse a data folder prepared without a validation split (training evaluates on it).

    Args:
        dataset: the data folder (load_data).
    """
    if not dataset.is_chat and not int(dataset.meta["val_tokens"]):
        raise TrainingError(f"{dataset.path} has no validation split (prepared with --val-fraction 0): "
                            "prepare it again with a --val-fraction above 0")


class NextToken(Objective):
    """Every next token's loss on running text: each micro-batch batch_size windows of window + 1 tokens
    per process, at offsets drawn from the run's data generator (seeded with cfg.seed), or one after
    another (Stream, TrainConfig.data_order); its evaluation the mean loss of both splits on eval_iters
    batches, the same ones at every evaluation.

    Raises:
        TrainingError: a split shorter than one window, no validation split, or too little text for one
            sequential batch.
    """

    def __init__(self, dataset: DataSet, cfg: TrainConfig, window: int, ctx: Dist) -> None:
        super().__init__(dataset, cfg, window, ctx)
        self.check()
        self.order = data_order(cfg, dataset)
        if self.order == "sequential":
            rows, n = cfg.batch_size * ctx.world_size, len(dataset.train)
            if n < rows * window + 1:
                raise TrainingError(f"the train split has {n:,} tokens, fewer than one sequential batch of {rows} x "
                                    f"{window} + 1; use more text, a smaller batch or --data-order random")
        self.generator = torch.Generator().manual_seed(cfg.seed)
        self.batches = {s: Batches.of(dataset, s, window) for s in ("train", "val")}
        self.stream = Stream(dataset.train, window) if self.order == "sequential" else None

    def check(self) -> None:
        """Each split must hold one training window of `window` tokens."""
        check_has_val(self.dataset)
        for split in ("train", "val"):
            n = len(getattr(self.dataset, split))
            if n < self.window + 1:
                raise TrainingError(
                    f"the {split} split has {n} tokens, fewer than block_size + 1 = {self.window + 1}; "
                    "use more text or a smaller --block-size"
                )

    def draw(self, model: GPT) -> Batch:
        # every process draws the whole global batch (from the same generator, or the next in the
        # stream) and takes its slice
        cfg, ctx = self.cfg, self.ctx
        rows = cfg.batch_size * ctx.world_size
        offsets = self.stream.draw(rows) if self.stream else self.batches["train"].sample(rows, self.generator)
        if isinstance(self.dataset.train, ShardedTokens):  # the whole global batch's: every process stops alike
            self.dataset.train.check_windows(offsets.numpy(), self.window + 1)
        offsets = share(offsets, ctx.rank, cfg.batch_size)
        return Batch(offsets, self.batches["train"].get(offsets), rows * self.window)

    def loss(self, model: torch.nn.Module, batch: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return batch_loss(model, batch.inputs, self.ctx.device), {}

    def evaluate(self, model: GPT, iters: int | None) -> dict[str, float]:
        ctx = self.ctx
        return {f"{s}_loss": ctx.mean(estimate_loss(model, self.batches[s], self.cfg, ctx.device, rank=ctx.rank,
                                                    world_size=ctx.world_size, iters=iters))
                for s in ("train", "val")}

    def save_state(self, state: dict[str, Any]) -> None:
        state["rng"]["data"] = self.generator.get_state()
        state["data"] = self.stream.state() if self.stream is not None else {"order": "random"}

    def restore_state(self, state: dict[str, Any], run: RunFolder) -> None:
        self.generator.set_state(state["rng"]["data"])  # the same in every process: they draw the same global batches
        saved = state.get("data") or {"order": "random"}  # a state saved before data orders existed: random
        if saved["order"] != self.order:
            raise TrainingError(f"{run.path} trained with --data-order {saved['order']}: resume it with that order")
        if self.stream is not None:
            self.stream.restore(saved, run.state_file)


class Distill(NextToken):
    """A teacher's next-token distributions, learned: on NextToken's windows, the KL divergence from the
    teacher's distribution at every position to the model's (soft targets at temperature 1: Hinton et al.,
    2015), where the next-token loss learns from the one token the text has there. What a draft for
    speculative decoding wants, whose proposals stand where it chooses what its target would: distilled from
    the target, it agrees with it more than one trained on the text for the same time (DistillSpec, Zhou et
    al., 2024; benchmarks/speculative.py measures both). A step pays for the teacher's forward pass, under
    no_grad. Its evaluation is NextToken's, the loss on the text.

    Args:
        dataset, cfg, window, ctx: as Objective takes them.
        teacher: the model whose distributions are learned, on the run's device; never trained (eval mode,
            no gradients), and its head covering the data's vocabulary.

    Raises:
        TrainingError: chat data, or a teacher whose vocabulary or context is smaller than the data's and
            the window.
    """

    def __init__(self, dataset: DataSet, cfg: TrainConfig, window: int, ctx: Dist, teacher: GPT) -> None:
        if dataset.is_chat:
            raise TrainingError(f"{dataset.path} is chat data: a teacher is distilled on running text")
        super().__init__(dataset, cfg, window, ctx)
        vocab, tcfg = int(dataset.meta["vocab_size"]), teacher.config
        if tcfg.vocab_size < vocab or tcfg.block_size < window:
            raise TrainingError(f"the teacher reads {tcfg.vocab_size:,} ids in {tcfg.block_size} positions; the data "
                                f"has {vocab:,} and a window {window}")
        self.teacher = teacher.eval().requires_grad_(False)

    def loss(self, model: torch.nn.Module, batch: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        x = batch.inputs[0].to(self.ctx.device)
        with torch.no_grad():
            teacher = self.teacher(x).float()
        student = model(x).float()
        # the ids both heads have (the data's, at least): a head padded past the vocabulary keeps its padding
        width = min(teacher.shape[-1], student.shape[-1])
        kl = F.kl_div(F.log_softmax(student[..., :width], dim=-1), F.log_softmax(teacher[..., :width], dim=-1),
                      log_target=True, reduction="sum") / x.numel()
        return kl, {}


class Masked(NextToken):
    """Supervised fine-tuning on chat data: the next-token loss of the assistant's tokens only (the loss
    mask prepare wrote), on rows packed with whole conversations, each seeing only itself (GPT.forward's
    documents), drawn in random order; its evaluation the same loss on both splits.

    Raises:
        TrainingError: a split without a conversation, or --data-order sequential.
    """

    def check(self) -> None:
        """Each split must hold a conversation."""
        for split in ("train", "val"):
            if not self.dataset.meta[f"{split}_conversations"]:
                raise TrainingError(f"the {split} split of {self.dataset.path} holds no conversation; "
                                    "prepare more conversations or another --val-fraction")


def objective_for(dataset: DataSet, cfg: TrainConfig, window: int, ctx: Dist) -> Objective:
    """The objective of a run that names none: Masked on chat data, else NextToken.

    Args:
        dataset, cfg, window, ctx: as Objective takes them.
    """
    return (Masked if dataset.is_chat else NextToken)(dataset, cfg, window, ctx)
