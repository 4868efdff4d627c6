"""A run as it trains. Phase 1, settings: what to train and how, every refusal made before anything is
written (Setup; a Start for a model built elsewhere). Phase 2, Run: the model, its optimizer and the
state a checkpoint keeps, built (or restored, on resume: tinygpt.train.state); then the phases the
loop goes through, a method each: train_step, evaluate, save, decide."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .. import checkpoint, distributed
from ..config.model import GPTConfig
from ..config.train import DEFAULT_LR, TrainConfig
from ..data.folder import DataSet
from ..device import allow_fast_float32, autocast, resolve_dtype, reuse_freed_memory
from ..errors import CheckpointError, NonFiniteError, TrainingError
from ..model import GPT
from ..optim import BudgetSchedule, decay_start, lr_at, lr_scales, make_optimizer, warmup_steps
from ..run_folder import RunFolder
from ..sizing import ModelChoice
from . import state
from .callbacks import TrainCallback
from .objectives import Objective, objective_for
from .pacing import Pace, Stop

DEFAULT_MAX_ITERS = 2000


@dataclass(frozen=True)
class Start:
    """A run whose model comes from elsewhere than GPT(config): what tinygpt.finetune gives train()
    in place of a GPTConfig, so that fine-tuning is settings of the one loop, not a copy of it.

    Args:
        config: the architecture it trains (its dropout included): what config.json records and a
            resume must match.
        build: the model of a new run (on the CPU), with what is not to train already frozen.
        load: the model of a saved checkpoint in the run folder, prepared the same way (resume).
        lr: the learning rate when the TrainConfig leaves it to choose.
        adapter_base: for LoRA, the base model's folder: checkpoints are adapter runs naming it
            (adapter_model.safetensors beside train_state.pt) instead of full weights.
        base_checksum: the base's weights_checksum, computed once.
        keep: "last", or "best": an evaluation saves only when its validation loss is the lowest yet. With
            best, a new run evaluates and saves its starting model at step 0, which stays the best until
            a step beats it: a run that only gets worse keeps the model it started from (a full run its
            weights, an adapter run its adapters at zero), never a worse one.
        record: JSON-ready settings kept in train_config.json beside the training's.
        window: the tokens a training sequence holds, at most config.block_size (default: all of it).
            Only the batches are shorter: the model keeps config's context, so a rotary model's run
            reads as long a prompt as its base, and a learned position table keeps every row (those
            past the window get no gradient).
        dtypes: each weight's dtype in the checkpoints (a bfloat16 base's, so its run is saved in
            bfloat16), where the model trains in float32; the float32 weights a save rounds are kept
            in the training state, and a resume goes on from them. None: saved as trained.
        objective: what a step optimises, made from (dataset, cfg, window, ctx) as
            tinygpt.train.objectives.Objective is; None: the data's own (objective_for: the masked
            loss on chat data, else the next-token loss).
    """

    config: GPTConfig
    build: Callable[[], GPT]
    load: Callable[[Path], GPT]
    lr: float
    adapter_base: Path | None = None
    base_checksum: str | None = None
    keep: str = "last"
    record: dict[str, Any] = dataclasses.field(default_factory=dict)
    window: int | None = None
    dtypes: dict[str, torch.dtype] | None = None
    objective: Callable[[DataSet, TrainConfig, int, distributed.Dist], Objective] | None = None


@dataclass
class Setup:
    """What a run trains and how, settled before anything is built or written."""

    dataset: DataSet
    model_config: GPTConfig
    cfg: TrainConfig  # with its lr filled in
    state: dict[str, Any] | None  # the checkpoint's training state, when resuming
    notes: dict[str, Any] | None  # to record in train_config.json
    start: Start | None = None  # a model built elsewhere (fine-tuning)
    objective: Objective | None = None  # what a step optimises

    @property
    def window(self) -> int:
        """The tokens a training sequence holds: a Start's window, else the model's whole context."""
        start = self.start
        return start.window if start is not None and start.window is not None else self.model_config.block_size


def settings(
    ctx: distributed.Dist, run: RunFolder, dataset: DataSet, model_config: GPTConfig | ModelChoice | Start | None,
    cfg: TrainConfig, resume: bool, notes: dict[str, Any] | None,
) -> Setup:
    """Phase 1: the model's settings (the run's own on resume), its training state, the learning rate
    left to choose, the objective; everything refused here leaves the run folder as it was."""
    choice = model_config if isinstance(model_config, ModelChoice) else None
    start = model_config if isinstance(model_config, Start) else None
    model_config = choice.config if choice is not None else start.config if start is not None else model_config
    state = None
    if resume:
        saved = run.model_config()
        if model_config is not None and model_config != saved:
            raise TrainingError(f"{run.path}: the model settings differ from the run's; drop them to resume")
        model_config = saved
        if start is None:
            run.check_objective(None)
        run.check_data(dataset)  # before anything in the run is touched
        state = ctx.main_first(run.load_state)  # rank 0 may finish a cut-short save
        run.check_state(state)
    else:
        run.check_new()
        if choice is not None:
            notes = {**(notes or {}), "model_choice": choice.to_dict()}
    if cfg.lr is None:
        if resume:
            lr = run.train_config()[0].lr if run.recorded() else None
        else:  # a model sized for a time budget trains at the rate for its width
            lr = choice.lr if choice is not None else None
        if lr is None and start is not None:  # fine-tuning's rate, far below pretraining's
            lr = start.lr
        cfg = dataclasses.replace(cfg, lr=lr or DEFAULT_LR)
    setup = Setup(dataset, model_config, cfg, state, notes, start)
    vocab = int(dataset.meta["vocab_size"])
    if model_config.vocab_size < vocab:
        raise TrainingError(f"vocab_size={model_config.vocab_size} is smaller than the data's vocabulary of {vocab}")
    make = start.objective if start is not None and start.objective is not None else objective_for
    setup.objective = make(dataset, cfg, setup.window, ctx)
    return setup


class Run:
    """One run as it trains: the model, its optimizer and what a checkpoint keeps (step, tokens seen,
    the schedule, the random streams, the objective's own), with the phases of the loop as methods:
    train_step, evaluate, save, decide. Phase 2, setting up, is the constructor (and restore, on resume)."""

    def __init__(self, ctx: distributed.Dist, folder: RunFolder, setup: Setup,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        cfg = self.cfg = setup.cfg
        self.clock, self.started = clock, 0.0  # started: when this invocation's steps began (the loop sets it)
        self.seconds_before = 0.0  # the run's training time before this invocation (a resumed checkpoint's)
        self.ctx, self.folder, self.dataset, self.start = ctx, folder, setup.dataset, setup.start
        self.objective = setup.objective
        self.device, self.dtype = ctx.device, resolve_dtype(cfg.dtype, ctx.device)
        allow_fast_float32(self.device)
        reuse_freed_memory(self.device)  # a CPU's steps, one like the next, keep their memory
        fsdp = cfg.fsdp and ctx.enabled  # one process has nothing to shard
        if fsdp and self.dtype is torch.float16:
            raise TrainingError("--fsdp trains in float32 or bfloat16: float16 needs loss scaling across the shards")
        torch.manual_seed(cfg.seed)
        home = torch.device("cpu") if fsdp else self.device  # fully_shard moves each process's shard to the device
        self.model = _build_model(setup, folder, home)
        self.model.train()
        self.wrapped = distributed.wrap(self.model, ctx, fsdp=fsdp)
        self.optimizer = make_optimizer(self.model, cfg, self.device)
        self.lr_scales = lr_scales(self.optimizer, cfg)
        if ctx.rank > 0:  # each process draws its own dropout masks
            torch.manual_seed(cfg.seed + ctx.rank)
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.dtype is torch.float16)
        self.step, self.tokens, self.step_tokens, self.horizon = 0, 0, 0, cfg.max_iters
        self.keep_best = setup.start is not None and setup.start.keep == "best"
        self.best = math.inf  # the lowest validation loss saved, with keep best
        self.budget = cfg.max_iters is None and cfg.max_time is not None  # a time budget alone: its length is estimated
        if self.horizon is None and cfg.max_time is None:
            self.horizon = DEFAULT_MAX_ITERS
        self.schedule = BudgetSchedule(cfg) if self.budget else None
        # the length the warmup is a share of: the run's as it begins, kept by every resume and by a
        # continuation from before-decay/ with another length, which warm up as the run did
        self.begun = self.horizon
        if setup.state is not None:
            state.restore(self, setup.state)
        self.warmup = warmup_steps(cfg, self.begun)
        self.step_model = torch.compile(self.wrapped) if cfg.compile else self.wrapped

    def record_settings(self, data: str | Path | DataSet, notes: dict[str, Any] | None, *, fresh: bool) -> None:
        """Rank 0 writes train_config.json (the data, its tokenizer's fingerprint, the settings, the notes
        merged with a resumed run's) and, for a new run, an empty metrics.jsonl."""
        if not self.ctx.is_main:
            return
        where = str(data.path) if isinstance(data, DataSet) else str(Path(data).resolve())
        record = {"data": where, "tokenizer_fingerprint": self.dataset.fingerprint,
                  "train": self.cfg.to_dict(), **(self.start.record if self.start is not None else {})}
        self.folder.write_record(record, notes, fresh=fresh)

    def train_step(self, hooks: TrainCallback) -> dict[str, Any]:
        """Phase 3: one optimizer step on a global batch (grad_accum micro-steps); its metrics line."""
        cfg, ctx = self.cfg, self.ctx
        before = self.schedule.state() if self.schedule is not None else None
        lr = (self.schedule.next_lr(self.step) if self.schedule is not None
              else lr_at(self.step, cfg, self.horizon, self.warmup))
        if self.decay_begins(before):  # kept as it is before this step, the first of the decay
            self.save(self.folder.before_decay, before)
        for group, scale in zip(self.optimizer.param_groups, self.lr_scales):
            group["lr"] = lr * scale
        loss_sum = torch.zeros((), device=self.device)
        sums: dict[str, torch.Tensor] = {}
        self.step_tokens = 0
        for micro in range(cfg.grad_accum):
            with autocast(self.device, self.dtype):
                batch = self.objective.draw(self.model)
            hooks.on_batch(batch.positions)
            self.step_tokens += batch.tokens
            # gradients are reduced across processes once, in the last micro-step's backward
            with distributed.gradient_sync(self.wrapped, micro == cfg.grad_accum - 1):
                with autocast(self.device, self.dtype):
                    loss, metrics = self.objective.loss(self.step_model, batch)
                loss = loss / cfg.grad_accum
                self.scaler.scale(loss).backward()
            loss_sum += loss.detach()
            for name, value in metrics.items():
                sums[name] = sums.get(name, 0) + value.detach() / cfg.grad_accum
        loss_value = ctx.mean(loss_sum)  # the global batch's loss, the same in every process
        if not math.isfinite(loss_value):
            raise NonFiniteError(f"step {self.step + 1}: the loss is {loss_value}; stopped before the update",
                                 self.step + 1)
        self.scaler.unscale_(self.optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip or math.inf)
        grad_norm = distributed.full_value(grad_norm).item()  # over all shards under FSDP
        if not math.isfinite(grad_norm) and not self.scaler.is_enabled():
            raise NonFiniteError(
                f"step {self.step + 1}: the gradient norm is {grad_norm}; stopped before the update", self.step + 1
            )
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self.tokens += self.step_tokens
        return {"step": self.step, "tokens": self.tokens, "loss": loss_value, "lr": lr, "grad_norm": grad_norm,
                **{name: ctx.mean(value) for name, value in sums.items()}}

    def decay_begins(self, before: dict[str, float] | None) -> bool:
        """Whether the step about to run is a WSD run's first at a decaying rate (`before`: a time
        budget's schedule as it was before this step's rate was drawn)."""
        if self.cfg.lr_schedule != "wsd":
            return False
        if self.schedule is not None:
            return before["progress"] == 0 and self.schedule.progress > 0
        return self.step == decay_start(self.cfg, self.horizon, self.warmup)

    def evaluate(self, iters: int | None = None) -> dict[str, Any]:
        """Phase 4a: the objective's evaluation (eval_iters batches, or the first `iters`); its metrics line."""
        self.model.eval()
        with autocast(self.device, self.dtype):
            values = self.objective.evaluate(self.model, iters)
        self.model.train()
        record = {"step": self.step, "tokens": self.tokens, **values}
        return {**record, "eval_iters": iters} if iters is not None and iters < self.cfg.eval_iters else record

    def save(self, folder: RunFolder | None = None, schedule: dict[str, float] | None = None) -> None:
        """Phase 4b: a checkpoint of the weights and the training state (every process takes part; rank 0 writes)
        in the run folder, or as a run folder of its own (`folder`, with the run's settings and metrics so
        far beside it, and the schedule's state `schedule` in place of the current one)."""
        state.save(self, folder, schedule)

    def decide(self, stop: Stop, should_stop: Callable[[int], bool] | None, pace: Pace, now: float) -> str | None:
        """Phase 5: whether to stop after this step, the same in every process: why, or None to go on."""
        cfg, schedule = self.cfg, self.schedule
        left = pace.steps_left(now) if self.budget else None
        # one small all-reduce a step: a signal or a time limit seen by any process stops all of them
        # here, and they agree on the shortest estimate of the steps left (clocks differ between them)
        sigterm, sigint, requested, time_up, fewest = self.ctx.max([
            stop.signal == "SIGTERM", stop.signal == "SIGINT", bool(should_stop and should_stop(self.step)),
            # the budget is spent once what is left would not buy half a step and the last evaluation
            cfg.max_time is not None and pace.time_left(now) < pace.per_step() / 2,
            -math.inf if left is None else -left,
        ])
        if schedule is not None and fewest != -math.inf:
            schedule.left = -fewest
        if sigterm or sigint or requested:
            return "SIGTERM" if sigterm else "SIGINT" if sigint else "requested"
        # a time budget alone also ends when what is left would not buy half a step and the
        # last evaluation: it was used
        if time_up or (schedule is not None and schedule.left is not None and schedule.left < 0.5):
            return "max_time"
        return None

    def seconds(self, now: float | None = None) -> float:
        """The run's training time so far (up to `now`, a reading of the clock, or this moment), its earlier
        invocations' included."""
        return self.seconds_before + ((self.clock() if now is None else now) - self.started)

    def total(self) -> int | None:
        """The run's length in steps as now known: its horizon, or the steps a time budget is estimated to buy."""
        if self.schedule is not None and self.schedule.left is not None:
            return self.step + max(0, round(self.schedule.left))
        return self.horizon


def _build_model(setup: Setup, folder: RunFolder, home: torch.device) -> GPT:
    """The model a run starts from: new from the seed (the same in every process), or the checkpoint's
    (its float32 weights, where the checkpoint kept them beside rounded ones); a Start's own (a
    pretrained model) when it has one."""
    if setup.state is None:
        return (setup.start.build() if setup.start is not None else GPT(setup.model_config)).to(home)
    model = setup.start.load(folder.path) if setup.start is not None else checkpoint.load(folder.path)
    if setup.state.get("master") is not None:
        try:
            model.float().load_state_dict(setup.state["master"])
        except RuntimeError as e:
            raise CheckpointError(f"{folder.state_file}: its float32 weights do not fit the run's model "
                                  f"({' '.join(str(e).split())[:300]})") from None
    return model.to(home)
