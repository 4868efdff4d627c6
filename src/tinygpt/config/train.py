"""The training config: TrainConfig, the optimizers and learning-rate schedules it chooses from, and the
recipe a new `tinygpt train` run gets where its flags leave the choice open."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError
from .fields import MAX_SEED, check, check_int, finite, from_mapping

DEFAULT_LR = 1e-3  # TrainConfig.lr when it is left to choose and nothing sized the model
# "adamw" trains every parameter with AdamW; "muon" trains the 2-D weight matrices inside the blocks
# with torch.optim.Muon (momentum orthogonalized by a Newton-Schulz iteration) and the rest (the
# embeddings, the head, norms, biases) with AdamW
OPTIMIZERS = ("adamw", "muon")
# TrainConfig.muon_lr's default, measured (AMD EPYC Zen 5, 4 x 128 models on Shakespeare's
# characters, 300 steps of 16 x 64 tokens, val loss; AdamW at 1e-3: 2.087 llama, 2.487 gpt2):
# llama block 1.946 / 1.919 / 1.950 / 2.064 at 0.01 / 0.02 / 0.04 / 0.08; gpt2 block 2.189 /
# 2.011 / 1.984 at 0.01 / 0.02 / 0.04. Muon's weight decay 0.1 against 0: 1.917 against 1.919.
MUON_LR = 0.02
MUON_MOMENTUM = 0.95  # Keller Jordan's and torch.optim.Muon's
# what follows the warmup: cosine decay to min_lr over the run, the rate held, lr x sqrt(warmup / step),
# or warmup-stable-decay (the rate held, then a linear decay to min_lr over the run's last steps)
LR_SCHEDULES = ("cosine", "constant", "inverse-sqrt", "wsd")
DATA_ORDERS = ("random", "sequential")  # TrainConfig.data_order
LENGTHLESS_SCHEDULES = ("constant", "inverse-sqrt")  # those that need no known length
DECAY_FRACTION = 0.2  # WSD's decay: the last fifth of the steps (Hagele et al. 2024 found 20% matches cosine)

# The recipe a new `tinygpt train` run gets where its flags leave the choice open, the winner of
# `tinygpt bench --recipes` (the README's table): the modern block, the llama layout (rotary positions,
# RMSNorm, SwiGLU, no biases) with QK-norm, zero-initialised output projections and an untied head,
# trained by Muon with warmup-stable-decay. GPTConfig() and TrainConfig() keep GPT-2's block and AdamW
# with cosine (the lesson's objects, and what `--arch gpt2 --optimizer adamw --lr-schedule cosine`
# trains); the model half applies only where no --arch and no --preset is given.
RECIPE_MODEL: dict[str, Any] = dict(arch="llama", qk_norm=True, zero_init=True, tie_weights=False)
RECIPE_TRAIN: dict[str, Any] = dict(optimizer="muon", lr_schedule="wsd")


@dataclass
class TrainConfig:
    """How a model is trained. Every field is a `tinygpt train` flag and a config-file key.

    Args:
        batch_size: sequences per micro-step, per process.
        grad_accum: micro-steps per optimizer step.
        lr: peak learning rate, reached after `warmup` steps. None (the default): DEFAULT_LR, or
            for a model sized for a time budget the rate for its width (ModelChoice.lr), or on
            resume the run's own, or fine-tuning's (FinetuneConfig.default_lr); train() fills it in
            before the first step.
        min_lr: where the cosine or WSD decay ends (default lr / 10).
        warmup: steps of linear warmup, at most a tenth of the run's steps (of max_iters as the run began,
            or of a time budget's estimate) so that a short run reaches its peak rate and its decay.
        lr_schedule: what follows the warmup: "cosine" (decay to min_lr over the run), "constant"
            (lr held, nanoGPT's fine-tuning recipe), "inverse-sqrt" (lr x sqrt(warmup / (step + 1)),
            which needs no known length) or "wsd" (warmup-stable-decay: lr held, then a linear decay
            to min_lr over the last decay_fraction of the steps; the run keeps a checkpoint of the
            step before the decay, from which it can be continued with another length).
        decay_fraction: with wsd, the share of the run's steps its decay takes, in (0, 1].
        max_iters: optimizer steps; the cosine decay spans them. Without it and without max_time, 2000.
        max_time: wall-clock budget in seconds; training stops at whichever limit comes first.
        weight_decay: AdamW weight decay, applied to matrices and embeddings only (with muon: the
            embeddings and an untied head).
        beta1, beta2: AdamW betas.
        optimizer: OPTIMIZERS: "adamw", or "muon" for the 2-D weight matrices inside the blocks
            (torch.optim.Muon) beside AdamW at `lr` for the embeddings, the head, norms and biases.
        muon_lr: muon's peak rate for the block matrices (default MUON_LR), under the same
            schedule as lr (each step's rate is lr's times muon_lr / lr); torch.optim.Muon scales
            it by sqrt(max(1, rows / columns)) for each matrix, as Keller Jordan's Muon does.
        muon_weight_decay: muon's decoupled weight decay on the block matrices (the weights shrink
            by rate x decay each step, as AdamW's).
        muon_momentum: muon's (Nesterov) momentum.
        grad_clip: clip the global gradient norm to this (0 turns clipping off).
        eval_interval: steps between evaluations and checkpoints.
        eval_iters: batches per split in each evaluation.
        seed: seeds the model's initialization, dropout and the batch order.
        device: auto, cpu, cuda, cuda:N or mps.
        dtype: auto, float32, bfloat16 or float16 (CUDA only): the autocast dtype.
        compile: torch.compile the model for training.
        fsdp: under torchrun, shard parameters, gradients and optimizer state across the processes
            (FSDP2) instead of replicating them (DDP); one process has nothing to shard. Not with
            muon, which orthogonalizes each matrix whole (refused).
        dist_timeout: seconds a process waits for the others in a collective before the job fails.
        data_order: DATA_ORDERS: how the training batches go through the train split. "random":
            windows at random offsets (nanoGPT's sampling); "sequential": consecutive windows from
            the start, each global batch the next batch_size x processes x block_size tokens (the
            llm.c / nanochat stream), every process reading only its own rows of it, wrapping round
            at the end; the checkpoint keeps the position, so a resume goes on with the next unseen
            tokens. None (the default): sequential for a data folder of shards, random for one file.
    """

    batch_size: int = 12
    grad_accum: int = 1
    lr: float | None = None
    min_lr: float | None = None
    warmup: int = 100
    lr_schedule: str = "cosine"
    decay_fraction: float = DECAY_FRACTION
    max_iters: int | None = None
    max_time: float | None = None
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    optimizer: str = "adamw"
    muon_lr: float | None = None
    muon_weight_decay: float = 0.0
    muon_momentum: float = MUON_MOMENTUM
    grad_clip: float = 1.0
    eval_interval: int = 250
    eval_iters: int = 20
    seed: int = 1337
    device: str = "auto"
    dtype: str = "auto"
    compile: bool = False
    fsdp: bool = False
    dist_timeout: float = 600.0
    data_order: str | None = None

    def __post_init__(self) -> None:
        finite(self, ("lr", "min_lr", "max_time", "weight_decay", "beta1", "beta2", "grad_clip", "dist_timeout",
                      "muon_lr", "muon_weight_decay", "muon_momentum", "decay_fraction"))
        for name in ("batch_size", "grad_accum", "eval_interval", "eval_iters"):
            check_int(getattr(self, name), name, 1)
        for name in ("warmup", "seed"):
            check_int(getattr(self, name), name, 0)
        check(self.seed <= MAX_SEED, "seed", f"must be at most 2**63 - 1, got {self.seed!r}")
        if self.max_iters is not None:
            check_int(self.max_iters, "max_iters", 1)
        if self.max_time is not None:
            check(self.max_time > 0 and math.isfinite(self.max_time), "max_time",
                  f"must be a positive duration, got {self.max_time!r}")
        if self.lr is not None:
            check(self.lr > 0 and math.isfinite(self.lr), "lr", f"must be > 0, got {self.lr!r}")
        if self.min_lr is not None:
            # against an lr left to choose, it is checked again once train() has chosen one
            top, bound = (math.inf, ">= 0") if self.lr is None else (self.lr, f"in [0, lr={self.lr}]")
            check(0 <= self.min_lr <= top, "min_lr", f"must be {bound}, got {self.min_lr!r}")
        check(self.weight_decay >= 0, "weight_decay", f"must be >= 0, got {self.weight_decay!r}")
        for name in ("beta1", "beta2"):
            check(0 <= getattr(self, name) < 1, name, f"must be in [0, 1), got {getattr(self, name)!r}")
        check(self.dist_timeout > 0 and math.isfinite(self.dist_timeout), "dist_timeout",
              f"must be a positive duration, got {self.dist_timeout!r}")
        check(self.grad_clip >= 0, "grad_clip", f"must be >= 0 (0 turns clipping off), got {self.grad_clip!r}")
        check(self.lr_schedule in LR_SCHEDULES, "lr_schedule",
              f"must be one of {', '.join(LR_SCHEDULES)}, got {self.lr_schedule!r}")
        check(0 < self.decay_fraction <= 1, "decay_fraction", f"must be in (0, 1], got {self.decay_fraction!r}")
        check(self.optimizer in OPTIMIZERS, "optimizer",
              f"must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}")
        if self.muon_lr is not None:
            check(self.muon_lr > 0, "muon_lr", f"must be > 0, got {self.muon_lr!r}")
        check(self.muon_weight_decay >= 0, "muon_weight_decay", f"must be >= 0, got {self.muon_weight_decay!r}")
        check(0 <= self.muon_momentum < 1, "muon_momentum", f"must be in [0, 1), got {self.muon_momentum!r}")
        check(self.data_order in (None, *DATA_ORDERS), "data_order",
              f"must be one of {', '.join(DATA_ORDERS)}, got {self.data_order!r}")
        if self.fsdp and self.optimizer == "muon":
            raise ConfigError("fsdp: FSDP2 shards each weight matrix across the processes and Muon orthogonalizes "
                              "whole matrices: train muon under DDP (no --fsdp), or fsdp with --optimizer adamw")

    @property
    def final_lr(self) -> float:
        return self.lr / 10 if self.min_lr is None else self.min_lr

    @property
    def matrix_lr(self) -> float:
        """Muon's peak rate for the block matrices: muon_lr, or MUON_LR left to choose."""
        return MUON_LR if self.muon_lr is None else self.muon_lr

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        return from_mapping(cls, data)
