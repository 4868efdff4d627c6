"""The optimizer and the learning-rate schedules training uses: AdamW with weight decay on matrices
only, or Muon for the blocks' matrices beside it (MuonAdamW); linear warmup (at most a tenth of the run) then
(TrainConfig.lr_schedule) cosine decay or warmup-stable-decay over a known length (lr_at) or over
a time budget whose length is re-estimated as the run goes (BudgetSchedule), a constant rate, or
inverse-square-root decay; the last two need no length."""

from __future__ import annotations

import math
from typing import Any

import torch

from .config.train import LENGTHLESS_SCHEDULES, TrainConfig


def lr_at(step: int, cfg: TrainConfig, max_iters: int | None, warmup: int | None = None) -> float:
    """Learning rate for optimizer step `step` (0-based): linear warmup, then cfg.lr_schedule:
    cosine to min_lr, constant, or inverse-sqrt.

    Args:
        step: the optimizer step about to run.
        cfg: the run's settings.
        max_iters: the schedule's length; for a time budget it is estimated once training has been
            timed (None until then).
        warmup: the warmup's steps; default warmup_steps(cfg, max_iters). A run passes the warmup it began
            with, which a resume with another max_iters keeps.
    """
    warmup = warmup_steps(cfg, max_iters) if warmup is None else warmup
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    if cfg.lr_schedule in LENGTHLESS_SCHEDULES:
        return lengthless_lr(step, cfg, warmup)
    if max_iters is None:  # a time budget whose length is not known yet
        return cfg.lr
    if cfg.lr_schedule == "wsd":
        start = decay_start(cfg, max_iters, warmup)
        return linear_decay(cfg, 0.0 if step < start else min(1.0, (step + 1 - start) / max(1, max_iters - start)))
    progress = min(1.0, (step - warmup) / max(1, max_iters - warmup))
    return cfg.final_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.lr - cfg.final_lr)


def warmup_steps(cfg: TrainConfig, length: float | None) -> int:
    """The warmup's length: cfg.warmup, at most a tenth of the run's `length` in steps (its max_iters as it
    began, or a time budget's estimate; None while that is not known yet), so that a run shorter than ten
    warmups still reaches its peak rate and its decay. A tenth is short, as in WSD practice (nanochat and
    modded-nanogpt barely warm up and decay over the last 20-50%), leaves the default decay (a fifth)
    whole, and is the share a time budget's warmup already had."""
    if length is None:
        return cfg.warmup
    return min(cfg.warmup, max(1, int(length // 10)))


def decay_start(cfg: TrainConfig, max_iters: int, warmup: int | None = None) -> int:
    """The first step (0-based) of a WSD run's decay: the last decay_fraction of max_iters steps
    (at least one), never inside the warmup (`warmup` steps, default warmup_steps(cfg, max_iters)).
    Steps before it run at lr."""
    warmup = warmup_steps(cfg, max_iters) if warmup is None else warmup
    return max(warmup, max_iters - max(1, round(cfg.decay_fraction * max_iters)))


def linear_decay(cfg: TrainConfig, progress: float) -> float:
    """WSD's rate `progress` (0 to 1) of the way through its decay: from lr down to min_lr in a line."""
    return cfg.lr + (cfg.final_lr - cfg.lr) * progress


def lengthless_lr(step: int, cfg: TrainConfig, warmup: int) -> float:
    """After the warmup, the schedules that need no length: constant holds lr; inverse-sqrt is
    lr x sqrt(w / (step + 1)) (w the warmup, at least 1), which starts at lr where the warmup ends."""
    if cfg.lr_schedule == "constant":
        return cfg.lr
    return cfg.lr * math.sqrt(max(1, warmup) / (step + 1))


class BudgetSchedule:
    """The learning rate of a run with a time budget and no max_iters: linear warmup, then cosine decay
    toward min_lr over a length that is re-estimated after every step from the speed measured so far
    (or WSD's: the rate held until the steps left are the decay's share of the estimated length, then
    the same fraction moving in a line).

    Both phases are fractions that only grow. The warmup moves 1/W of the way each step, W being
    cfg.warmup until the run is timed and then at most a tenth of the estimated length. The decay's
    progress p moves (1 - p) / R each step, R the steps the time left is estimated to buy (this one
    included): at a steady speed that is the plain cosine over the run, and when the estimate
    changes the rest of the decay stretches or squeezes from where it is. So the rate never goes
    back up after the warmup, and it reaches min_lr as the budget runs out.

    Args:
        cfg: the run's settings (lr, min_lr, warmup).
        warm, progress: where a resumed run's schedule was (its train_state.pt "schedule").
    """

    def __init__(self, cfg: TrainConfig, warm: float = 0.0, progress: float = 0.0) -> None:
        self.cfg, self.warm, self.progress = cfg, warm, progress
        self.left: float | None = None  # steps the time left buys, the next one included (None: not timed yet)

    def next_lr(self, step: int) -> float:
        """The rate for optimizer step `step` (0-based), which is about to run; moves the schedule on."""
        cfg = self.cfg
        if self.warm < 1:
            length = warmup_steps(cfg, None if self.left is None else step + self.left)
            self.warm = min(1.0, self.warm + 1 / max(1, length))
            return cfg.lr * self.warm
        if cfg.lr_schedule in LENGTHLESS_SCHEDULES:  # needs no length: the budget's estimate does not change it
            return lengthless_lr(step, cfg, cfg.warmup)
        if cfg.lr_schedule == "wsd":  # held until what is left is the decay's share of the run, then a line
            if self.left is not None and (self.progress > 0 or self.left <= cfg.decay_fraction * (step + self.left)):
                self.progress = min(1.0, self.progress + (1 - self.progress) / max(1.0, self.left))
            return linear_decay(cfg, self.progress)
        if self.left is not None:
            self.progress = min(1.0, self.progress + (1 - self.progress) / max(1.0, self.left))
        return cfg.final_lr + 0.5 * (1.0 + math.cos(math.pi * self.progress)) * (cfg.lr - cfg.final_lr)

    def state(self) -> dict[str, float]:
        return {"warm": self.warm, "progress": self.progress}

    @classmethod
    def resumed(cls, cfg: TrainConfig, state: dict[str, Any], step: int) -> BudgetSchedule:
        """Where a saved run's schedule was; a state saved before this schedule existed gives its
        fixed length (max_iters), from which lr_at's position follows."""
        saved = state.get("schedule")
        if saved is not None:
            return cls(cfg, float(saved["warm"]), float(saved["progress"]))
        length = state.get("max_iters")
        warmup = warmup_steps(cfg, length)
        if step < warmup:
            return cls(cfg, step / warmup)
        return cls(cfg, 1.0, 0.0 if length is None else min(1.0, (step - warmup) / max(1, length - warmup)))


def block_matrices(model: torch.nn.Module) -> list[str]:
    """The names of the parameters Muon trains: the 2-D weight matrices inside the blocks (h.N...),
    those that train. The embeddings and the head are 2-D too, but a row of them is one token's
    vector, not a map between hidden features: they stay with AdamW, as norms and biases do."""
    return [name for name, p in model.named_parameters()
            if p.requires_grad and p.dim() == 2 and name.startswith("h.")]


class MuonAdamW:
    """torch.optim.Muon for the block matrices and a fused AdamW for the other parameters, stepped
    as one optimizer: param_groups lists Muon's groups then AdamW's (the schedule sets each one's
    rate), and state_dict is Optimizer.state_dict()'s layout over them in that order (parameters
    numbered across the groups), so a checkpoint holds it as it holds AdamW's alone.

    Args:
        muon: the optimizer of the block matrices.
        adamw: the optimizer of everything else.
    """

    def __init__(self, muon: torch.optim.Muon, adamw: torch.optim.AdamW) -> None:
        self.optimizers = (muon, adamw)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [g for o in self.optimizers for g in o.param_groups]

    @property
    def state(self) -> dict[torch.Tensor, Any]:
        return {p: s for o in self.optimizers for p, s in o.state.items()}

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        for o in self.optimizers:
            o.step()

    def state_dict(self) -> dict[str, Any]:
        state: dict[int, Any] = {}
        groups: list[dict[str, Any]] = []
        offset = 0
        for o in self.optimizers:
            saved = o.state_dict()
            state.update({offset + i: s for i, s in saved["state"].items()})
            groups += [{**g, "params": [offset + i for i in g["params"]]} for g in saved["param_groups"]]
            offset += sum(len(g["params"]) for g in saved["param_groups"])
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        groups, offset = list(saved["param_groups"]), 0
        for o in self.optimizers:
            mine, groups = groups[:len(o.param_groups)], groups[len(o.param_groups):]
            count = sum(len(g["params"]) for g in mine)
            o.load_state_dict({
                "state": {i - offset: s for i, s in saved["state"].items() if offset <= i < offset + count},
                "param_groups": [{**g, "params": [i - offset for i in g["params"]]} for g in mine],
            })
            offset += count


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig, device: torch.device) -> torch.optim.AdamW | MuonAdamW:
    """The optimizer of cfg.optimizer: AdamW with weight decay on matrices and embeddings only (not
    on biases and norm gains), or with muon the block matrices (block_matrices) on torch.optim.Muon
    at cfg.matrix_lr and the rest on that AdamW.

    Each group's "lr" is set every step from the schedule's rate: lr_scales (one number a group,
    muon_lr / lr for Muon's, 1 for AdamW's) says by how much it is multiplied."""
    muon_names = set(block_matrices(model)) if cfg.optimizer == "muon" else set()
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    params = [p for n, p in named if n not in muon_names]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    # the fused kernel reads and writes each parameter and its two moments once, where the foreach
    # loop makes a pass per elementwise operation: the update is memory-bound, so that is most of its
    # time (the README's Performance section has the figure)
    fused = device.type in ("cuda", "cpu")
    adamw = torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), fused=fused)
    if not muon_names:
        return adamw
    muon = torch.optim.Muon([p for n, p in named if n in muon_names], lr=cfg.matrix_lr,
                            weight_decay=cfg.muon_weight_decay, momentum=cfg.muon_momentum, nesterov=True)
    return MuonAdamW(muon, adamw)


def lr_scales(optimizer: torch.optim.Optimizer | MuonAdamW, cfg: TrainConfig) -> list[float]:
    """Each param group's rate over the schedule's (lr's): muon_lr / lr for Muon's groups, 1 for AdamW's."""
    if not isinstance(optimizer, MuonAdamW):
        return [1.0] * len(optimizer.param_groups)
    muon, adamw = optimizer.optimizers
    return [cfg.matrix_lr / cfg.lr] * len(muon.param_groups) + [1.0] * len(adamw.param_groups)
