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
from .device import cpu_has_native_bf16


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


class Muon(torch.optim.Muon):
    """torch.optim.Muon, with its Newton-Schulz iteration in float32 where `float32` (a CPU that emulates
    bfloat16: there torch's bfloat16 products ran at 0.6-3 GFLOP/s against float32's 50-95 on an AMD EPYC
    Zen 3, and the iteration took most of a 4 x 128 model's training step), the matrices of one shape
    orthogonalised together (a batched product each, not one product a matrix). Elsewhere torch's own step.
    The update is otherwise torch's: momentum, Nesterov, decoupled weight decay, the rate scaled by
    sqrt(max(1, rows / columns)); its state (momentum_buffer) the same, so a run moves between CPUs.

    Args:
        params: the matrices.
        float32: iterate in float32 (else torch's bfloat16 step).
        **kwargs: torch.optim.Muon's settings (adjust_lr_fn left to its default).
    """

    def __init__(self, params, *, float32: bool, **kwargs: Any) -> None:
        super().__init__(params, **kwargs)
        self.float32 = float32

    @torch.no_grad()
    def step(self, closure=None):
        if not self.float32:
            return super().step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            updates = []
            for p in params:
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad)
                buf = state["momentum_buffer"].lerp_(p.grad, 1 - group["momentum"])
                updates.append(p.grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf)
            for p, update in zip(params, orthogonalized(updates, group["ns_coefficients"], group["ns_steps"],
                                                        group["eps"])):
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(update, alpha=-group["lr"] * math.sqrt(max(1, p.shape[0] / p.shape[1])))
        return loss


def orthogonalized(matrices: list[torch.Tensor], coefficients: tuple[float, float, float], steps: int,
                   eps: float) -> list[torch.Tensor]:
    """Muon's Newton-Schulz iteration on each matrix, in float32 (torch.optim.Muon's in bfloat16): X / |X|,
    then `steps` times X <- a X + (b A + c A^2) X with A = X X^T, X taken wide (transposed where it has
    more rows than columns). Matrices of one shape go through together, as one batch; a matrix over 1.5 times
    as wide as tall iterates on its Gram side (gram_side_iteration), in fewer floating-point operations.

    Args:
        matrices: 2-D tensors.
        coefficients: (a, b, c).
        steps: iterations.
        eps: the smallest norm divided by.
    """
    wide = [m.float().T if m.shape[0] > m.shape[1] else m.float() for m in matrices]
    by_shape: dict[tuple[int, ...], list[int]] = {}
    for i, m in enumerate(wide):
        by_shape.setdefault(tuple(m.shape), []).append(i)
    out: list[torch.Tensor] = [torch.empty(0)] * len(matrices)
    for (rows, columns), indices in by_shape.items():
        x = torch.stack([wide[i] for i in indices])  # (n, rows, columns)
        x = x / x.flatten(1).norm(dim=1).clamp(min=eps)[:, None, None]
        # s steps of an r x c matrix cost s (4 r^2 c + 2 r^3) floating-point operations on X's side and
        # 4 r^2 c + (8 s - 6) r^3 on the Gram side between two makings of X: fewer for s > 1 where c > 1.5 r
        gram_side = 2 * columns > 3 * rows and steps > 1
        x = (gram_side_iteration if gram_side else x_side_iteration)(x, coefficients, steps)
        for i, m in zip(indices, x):
            out[i] = m.T if matrices[i].shape[0] > matrices[i].shape[1] else m
    return out


def x_side_iteration(x: torch.Tensor, coefficients: tuple[float, float, float], steps: int) -> torch.Tensor:
    """The Newton-Schulz iteration of orthogonalized on wide matrices X (rows <= columns), as written.

    Args:
        x: (n, rows, columns) wide matrices, rows <= columns.
        coefficients: (a, b, c).
        steps: iterations.
    """
    a, b, c = coefficients
    for _ in range(steps):
        gram = torch.bmm(x, x.transpose(1, 2))
        x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x


def gram_side_iteration(x: torch.Tensor, coefficients: tuple[float, float, float], steps: int) -> torch.Tensor:
    """The Newton-Schulz iteration of orthogonalized on wide matrices X (rows <= columns), run on their Gram
    side: X after some steps is Q X with Q a polynomial of G = X X^T, so each step's factor P = a I + b G + c G^2
    commutes with G and the next G is P X X^T P^T = P^2 G. Only G and the last Q X multiply by the columns, the
    steps between rows x rows matrices. Q grows a singular value of X by up to a a step (3.4445), and its
    rounding with it, so X is made again every three steps: on matrices whose singular values span 1 to 1e-5,
    Muon's five steps come within 3e-6 of the iteration's float64 values, as X's side does (2e-6; five steps on
    one Q, 9e-5).

    Args:
        x: (n, rows, columns) wide matrices, rows <= columns.
        coefficients: (a, b, c).
        steps: iterations.
    """
    a, b, c = coefficients
    for start in range(0, steps, 3):
        end = min(start + 3, steps)
        g = torch.bmm(x, x.transpose(1, 2))  # (n, rows, rows)
        q = None
        for k in range(start, end):
            p = torch.baddbmm(g, g, g, beta=b, alpha=c)
            p.diagonal(dim1=1, dim2=2).add_(a)
            q = p if q is None else torch.bmm(p, q)
            if k < end - 1:
                g = torch.bmm(p, torch.bmm(p, g))
        x = torch.bmm(q, x)
    return x


class MuonAdamW:
    """Muon for the block matrices and a fused AdamW for the other parameters, stepped
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
    on biases and norm gains), or with muon the block matrices (block_matrices) on Muon (torch.optim.Muon's,
    iterating in float32 on a CPU without native bfloat16) at cfg.matrix_lr and the rest on that AdamW.

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
    # bfloat16 where it is native or on a GPU (torch's), float32 on a CPU that emulates it
    float32 = device.type == "cpu" and not cpu_has_native_bf16()
    muon = Muon([p for n, p in named if n in muon_names], float32=float32, lr=cfg.matrix_lr,
                weight_decay=cfg.muon_weight_decay, momentum=cfg.muon_momentum, nesterov=True)
    return MuonAdamW(muon, adamw)


def lr_scales(optimizer: torch.optim.Optimizer | MuonAdamW, cfg: TrainConfig) -> list[float]:
    """Each param group's rate over the schedule's (lr's): muon_lr / lr for Muon's groups, 1 for AdamW's."""
    if not isinstance(optimizer, MuonAdamW):
        return [1.0] * len(optimizer.param_groups)
    muon, adamw = optimizer.optimizers
    return [cfg.matrix_lr / cfg.lr] * len(muon.param_groups) + [1.0] * len(adamw.param_groups)
