"""The one training loop: AdamW (or Muon beside it), warmup + cosine (or WSD, ...), clipping,
accumulation, mixed precision, evaluation, checkpoints and exact resume, on one process or several (torchrun: DDP or FSDP2).
It trains the model it is given, returns a TrainResult or raises, and never prints or exits:
what a caller shows as a run goes (a progress bar, a trace) hangs on its TrainCallback hooks.

A run goes through named phases: _settings (what to train, checked before anything is written),
_Run (the model, its optimizer and the state a checkpoint keeps; restored on resume), then
_Run.train_step, _Run.evaluate and _Run.save as the loop in _steps goes, with _Run.decide to stop.
Fine-tuning (tinygpt.finetune) is this loop with a Start: the starting model built elsewhere (a
pretrained one, with what is not to train frozen or LoRA's adapters added), how a checkpoint of it
is saved (an adapter run, for LoRA) and read back, and keep best."""

from __future__ import annotations

import dataclasses
import math
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from . import checkpoint, distributed, kernels
from .config.model import GPTConfig
from .config.train import DEFAULT_LR, TrainConfig
from .data.batches import Batches, Stream, data_order, share
from .data.folder import DataSet, load_data
from .data.shards import ShardedTokens
from .device import allow_fast_float32, autocast, resolve_device, resolve_dtype
from .errors import (
    CheckpointError,
    ConfigError,
    NonFiniteError,
    TinyGPTError,
    TrainingError,
)
from .model import GPT
from .optim import BudgetSchedule, decay_start, lr_at, lr_scales, make_optimizer, warmup_steps
from .run_folder import MetricsLog, RunFolder
# what users and tests import from here about a run folder; the run folder answers them
from .run_folder import check_data_for_run, has_checkpoint, read_train_config
from .sizing import ModelChoice

DEFAULT_MAX_ITERS = 2000
CALIBRATION_STEPS = 5  # steps timed before a --max-time run first estimates its schedule's length
SPEED_WINDOW = 20  # a time budget's step time: the median of this many most recent steps


@dataclass
class TrainResult:
    run: Path
    step: int  # optimizer steps done in total
    train_loss: float | None  # the last step's loss
    val_loss: float | None  # the last evaluation's
    stopped: str  # "max_iters", "max_time", "SIGINT", "SIGTERM" or "requested"
    tokens: int  # training tokens seen in total
    elapsed: float  # seconds of this invocation
    # seconds of training over the whole run: what its checkpoint recorded before a resume (none in a
    # checkpoint saved before tinygpt kept it) and this invocation's
    total_elapsed: float


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


@dataclass(frozen=True)
class RunStart:
    """What a TrainCallback learns as a run starts.

    Args:
        run: the run folder.
        rank, world_size: this process and how many train together (0 and 1 without torchrun).
        step: optimizer steps already done (a resumed run's).
        total: the run's length in steps, None while a time budget's is not estimated yet.
        model: the model being trained (unwrapped and uncompiled): a hook may measure it, under
            torch.no_grad() and with its own random generator so that training stays as it was.
        log: writes a JSON-ready record (with "step" and "tokens") as a line of the run's
            metrics.jsonl (rank 0 writes; elsewhere it does nothing).
    """

    run: Path
    rank: int
    world_size: int
    step: int
    total: int | None
    model: torch.nn.Module | None = None
    log: Callable[[dict[str, Any]], None] | None = None


class TrainCallback:
    """Hooks train() calls as a run goes; each does nothing here: subclass and override what you need.
    Under torchrun every process calls them at the same points, so a hook may run a collective
    (tinygpt.distributed.full_parameters, say) in on_end. An exception in a hook ends the run."""

    def on_start(self, start: RunStart) -> None:
        """Before the first step."""

    def on_batch(self, offsets: torch.Tensor) -> None:
        """Every micro-step's batch as it is drawn: this process's window start positions in the train split."""

    def on_step(self, record: dict[str, Any], total: int | None) -> None:
        """After every optimizer step (and its evaluation, when one was due) with the step's metrics line
        (step, tokens, loss, lr, grad_norm, tokens_per_s, time) and the run's length as now estimated."""

    def on_eval(self, record: dict[str, Any]) -> None:
        """After every evaluation, with its metrics line (step, tokens, train_loss, val_loss)."""

    def on_end(self, result: TrainResult, model: torch.nn.Module) -> None:
        """Once the run has stopped and its last checkpoint is on disk, with the trained model."""

    def close(self) -> None:
        """Last, whether the run ended or raised."""


class ProgressBar(TrainCallback):
    """A progress bar on stderr (steps, loss, tokens/s) and a line per evaluation on stdout (written
    above the bar), shown by rank 0: what `tinygpt train` shows, and what train(progress=True) installs."""

    def __init__(self) -> None:
        self.bar, self.show = None, False

    def on_start(self, start: RunStart) -> None:
        from tqdm.auto import tqdm

        self.show = start.rank == 0
        self.bar = tqdm(total=start.total, initial=start.step, unit="step", disable=not self.show,
                        file=sys.stderr, dynamic_ncols=True)

    def on_step(self, record: dict[str, Any], total: int | None) -> None:
        self.bar.total = total
        self.bar.update(1)
        rate = record["tokens_per_s"]
        tok_s = f"{rate:,.0f}" if rate is not None else "-"
        self.bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=tok_s, refresh=False)

    def on_eval(self, record: dict[str, Any]) -> None:
        if self.show:
            self.bar.write(f"step {record['step']}: train loss {record['train_loss']:.4f}, "
                           f"val loss {record['val_loss']:.4f}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class _AllOf(TrainCallback):
    """Several callbacks as one, called in order."""

    def __init__(self, callbacks: Sequence[TrainCallback]) -> None:
        self.callbacks = list(callbacks)

    def on_start(self, start: RunStart) -> None:
        for c in self.callbacks:
            c.on_start(start)

    def on_batch(self, offsets: torch.Tensor) -> None:
        for c in self.callbacks:
            c.on_batch(offsets)

    def on_step(self, record: dict[str, Any], total: int | None) -> None:
        for c in self.callbacks:
            c.on_step(record, total)

    def on_eval(self, record: dict[str, Any]) -> None:
        for c in self.callbacks:
            c.on_eval(record)

    def on_end(self, result: TrainResult, model: torch.nn.Module) -> None:
        for c in self.callbacks:
            c.on_end(result, model)

    def close(self) -> None:
        for c in self.callbacks:
            c.close()


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
    model: GPT, tokens: np.ndarray | Batches, cfg: TrainConfig, device, dtype, *, rank: int = 0,
    world_size: int = 1, iters: int | None = None,
) -> float:
    """Mean loss over eval_iters random batches (the first `iters` of them when given); the same
    batches at every evaluation. On chat data (a Batches of it) the loss is the assistant's tokens'.

    With several processes each batch holds batch_size x world_size sequences and this process
    evaluates its own slice; the mean of the processes' results is the loss over the whole batch.
    """
    batches = tokens if isinstance(tokens, Batches) else Batches(tokens, model.config.block_size)
    g = torch.Generator().manual_seed(cfg.seed + 1)
    losses = []
    for _ in range(cfg.eval_iters if iters is None else iters):
        positions = batches.sample(cfg.batch_size * world_size, g)
        batch = batches.get(share(positions, rank, cfg.batch_size))
        with autocast(device, dtype):
            losses.append(batch_loss(model, batch, device).item())
    return float(np.mean(losses))


@torch.no_grad()
def evaluate(
    model: GPT,
    tokens: np.ndarray,
    *,
    batch_size: int = 8,
    device=None,
    dtype=torch.float32,
    segments: list[tuple[int, int]] | None = None,
    block_size: int | None = None,
) -> dict:
    """Loss over a whole token stream, cut into consecutive windows of block_size + 1 tokens.

    Args:
        model: the GPT.
        tokens: the token ids.
        batch_size: windows per forward pass.
        device, dtype: where and in which autocast dtype to run (the model's device, float32).
        segments: (start, end) ranges of `tokens` to score as separate texts: no window crosses
            from one into the next, and each one's first token is not predicted (it has no
            context). Default: the whole stream as one text.
        block_size: the windows' length (a fine-tune's training window); default the model's context.

    Returns {"loss": mean nats per predicted token, "tokens": predicted tokens, "nll": total nats}.
    """
    device = device or next(model.parameters()).device
    block = block_size or model.config.block_size
    n = len(tokens)
    segments = [(0, n)] if segments is None else segments
    # (start, length) of each window: `length` inputs tokens[s:s+length], targets one token later
    windows = [(s, min(block, end - 1 - s)) for start, end in segments for s in range(start, end - 1, block)]
    if not windows:
        what = f"got {n}" if len(segments) == 1 else "in a row between the characters left out"
        raise TrainingError(f"need at least 2 tokens to evaluate, {what}")
    total, count = 0.0, 0
    for i in range(0, len(windows), batch_size):
        # the last window of a text may be shorter: evaluate same-length windows together
        for length, group in _group_by_length(windows[i : i + batch_size]):
            x = torch.stack([torch.from_numpy(np.asarray(tokens[s : s + length], dtype=np.int64)) for s in group])
            y = torch.stack([torch.from_numpy(np.asarray(tokens[s + 1 : s + length + 1], dtype=np.int64)) for s in group])
            with autocast(device, dtype):
                logits = model(x.to(device))
            total += torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]).float(), y.to(device).reshape(-1), reduction="sum"
            ).item()
            count += y.numel()
    return {"loss": total / count, "tokens": count, "nll": total}


@torch.no_grad()
def evaluate_chat(
    model: GPT, dataset: DataSet, split: str = "val", *, batch_size: int = 8, device=None, dtype=torch.float32,
    conversations: int | None = None, block_size: int | None = None,
) -> dict:
    """Loss on chat data's assistant tokens only (the loss mask), as training's evaluation counts it:
    each conversation alone (packed rows, Batches), every trained target of the split once.

    Args:
        model: the GPT.
        dataset: a chat data folder (load_data).
        split: "train" or "val".
        batch_size: packed rows per forward pass.
        device, dtype: as for evaluate().
        conversations: score only the split's first N conversations (default all).
        block_size: the packed rows' length (a fine-tune's training window); default the model's context.

    Returns {"loss": mean nats per trained token, "tokens": trained tokens, "nll": total nats,
    "bytes" and "chars": the UTF-8 bytes and characters of the assistant's text those tokens spell
    (special tokens left out)}.
    """
    if not dataset.is_chat:
        raise TrainingError(f"{dataset.path} is not chat data (prepare it with --format chat)")
    device = device or next(model.parameters()).device
    tokens, mask, starts = getattr(dataset, split), dataset.masks[split], dataset.starts[split]
    if conversations is not None and conversations < len(starts):
        end = int(starts[conversations])
        tokens, mask, starts = tokens[:end], mask[:end], starts[:conversations]
    batches = Batches(tokens, block_size or model.config.block_size, mask, starts)
    special = set(dataset.tokenizer.special_ids().values())
    total, count, text = 0.0, 0, b""
    for i in range(0, len(batches.rows), batch_size):
        x, y, w, documents = batches.get(torch.arange(i, min(i + batch_size, len(batches.rows))))
        with autocast(device, dtype):  # the training loss: the mean over the batch's trained targets
            loss = batch_loss(model, (x, y, w, documents), device)
        keep = w.reshape(-1) > 0
        total += loss.item() * int(keep.sum())
        count += int(keep.sum())
        text += dataset.tokenizer.decode_bytes([t for t in y.reshape(-1)[keep].tolist() if t not in special])
    if not count:
        raise TrainingError(f"the {split} split of {dataset.path} has no assistant tokens to score")
    return {"loss": total / count, "tokens": count, "nll": total, "bytes": len(text),
            "chars": len(text.decode("utf-8", errors="replace"))}


def conversations_within(dataset: DataSet, n_tokens: int, split: str = "val") -> int:
    """How many of a chat split's first conversations fit whole in its first n_tokens tokens (at least
    one): what evaluate_chat's `conversations` takes to score about n_tokens tokens."""
    starts = dataset.starts[split]
    ends = np.append(starts[1:], len(getattr(dataset, split)))
    return max(1, int((ends <= n_tokens).sum()))


def _group_by_length(windows: list[tuple[int, int]]):
    groups: dict[int, list[int]] = {}
    for s, length in windows:
        groups.setdefault(length, []).append(s)
    return groups.items()


def train(
    data: str | Path,
    out: str | Path,
    model_config: GPTConfig | ModelChoice | Start | None = None,
    train_config: TrainConfig | None = None,
    *,
    resume: bool = False,
    progress: bool = False,
    callbacks: Sequence[TrainCallback] = (),
    should_stop: Callable[[int], bool] | None = None,
    notes: dict[str, Any] | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> TrainResult:
    """Train a GPT on a prepared data folder and keep it in a run folder.

    Args:
        data: a folder written by `tinygpt prepare`.
        out: the run folder (created; refused if it already holds a run unless resuming).
        model_config: the architecture, or a ModelChoice (tinygpt.sizing.choose_model picks one
            for the data or a time budget; the choice is recorded in train_config.json under
            notes.model_choice). Required for a new run; on resume None means the run's own, and
            a config that differs from it is refused. A vocab_size smaller than the data's
            vocabulary is refused. A Start trains a model built elsewhere (tinygpt.finetune).
        train_config: the optimization settings (TrainConfig()). Its lr left None is filled in:
            a ModelChoice's learning rate (a model sized for a time budget carries one), the run's
            own on resume, else DEFAULT_LR.
        resume: continue the run in `out` from its last checkpoint; with the same settings the
            result is bitwise equal to an uninterrupted run (CPU, float32).
        progress: show a progress bar on stderr and a line per evaluation on stdout (ProgressBar).
        callbacks: TrainCallback hooks called as the run goes, after the progress bar's.
        should_stop: called after every optimizer step with the step number; True stops
            training there (saving first), as a signal would.
        notes: JSON-ready facts about how the run was set up (how its size was chosen, a sweep's
            grid point), kept in train_config.json under "notes" (merged on resume).
        clock: seconds, for max_time and the step times its schedule is estimated from
            (time.perf_counter; tests pass a fake one to play a machine that speeds up or slows down).

    With max_time and no max_iters the run uses its budget: the schedule's length is re-estimated
    after every step from the measured speed (BudgetSchedule), and it stops ("max_time") when the
    time left would not buy another step and the last evaluation.

    Several processes: launched by torchrun (WORLD_SIZE > 1), every process calls train() with the
    same arguments. They join one process group (gloo on CPU, NCCL with one GPU per process),
    train one model on global batches of batch_size x processes sequences (DDP, or FSDP2 with
    train_config.fsdp), and agree every step on whether to stop, so a signal to any of them stops
    all at the same step. Only rank 0 writes the run folder and shows progress; each returns the
    same result. A group the caller already created is used and left open.

    Raises:
        ConfigError: a new run without a model config.
        TrainingError: bad data or settings, or (several processes) another process died or
            stopped answering within train_config.dist_timeout; NonFiniteError when the loss or the
            gradient norm is not finite (nothing is saved then, the last checkpoint stays as it was).
    """
    if model_config is None and not resume:
        raise ConfigError("a new run needs a model: pass a GPTConfig, or a ModelChoice from "
                          "tinygpt.sizing.choose_model (sized for the data or a time budget)")
    cfg = train_config or TrainConfig()
    hooks = _AllOf([*([ProgressBar()] if progress else []), *callbacks])
    folder = RunFolder(Path(out))
    with distributed.process_group(resolve_device(cfg.device), cfg.dist_timeout) as ctx:
        try:
            setup = _settings(ctx, folder, load_data(data), model_config, cfg, resume, notes)
            run = _Run(ctx, folder, setup, clock)
            run.record_settings(data, setup.notes, fresh=setup.state is None)
            return _steps(run, hooks, should_stop, clock)
        except Exception as e:
            if not ctx.enabled or isinstance(e, TinyGPTError) or not distributed.is_comm_failure(e):
                raise
            kept = "its last checkpoint is kept" if folder.has_weights() else "no checkpoint yet"
            raise TrainingError(
                f"process {ctx.rank}: lost contact with the other processes ({distributed.describe_failure(e)}); "
                f"{out}: {kept}"
            ) from e
        finally:
            hooks.close()


@dataclass
class _Setup:
    """What a run trains and how, settled before anything is built or written."""

    dataset: DataSet
    model_config: GPTConfig
    cfg: TrainConfig  # with its lr filled in
    state: dict[str, Any] | None  # the checkpoint's training state, when resuming
    notes: dict[str, Any] | None  # to record in train_config.json
    start: Start | None = None  # a model built elsewhere (fine-tuning)

    @property
    def window(self) -> int:
        """The tokens a training sequence holds: a Start's window, else the model's whole context."""
        start = self.start
        return start.window if start is not None and start.window is not None else self.model_config.block_size


def _settings(
    ctx: distributed.Dist, run: RunFolder, dataset: DataSet, model_config: GPTConfig | ModelChoice | Start | None,
    cfg: TrainConfig, resume: bool, notes: dict[str, Any] | None,
) -> _Setup:
    """Phase 1: the model's settings (the run's own on resume), its training state, the learning rate
    left to choose; everything refused here leaves the run folder as it was."""
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
            run.check_not_fine_tune()
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
    setup = _Setup(dataset, model_config, cfg, state, notes, start)
    _check_fits(model_config, dataset, setup.window)
    if data_order(cfg, dataset) == "sequential":
        rows, n = cfg.batch_size * ctx.world_size, len(dataset.train)
        if n < rows * setup.window + 1:
            raise TrainingError(f"the train split has {n:,} tokens, fewer than one sequential batch of {rows} x "
                                f"{setup.window} + 1; use more text, a smaller batch or --data-order random")
    return setup


def check_has_val(dataset: DataSet) -> None:
    """Refuse a data folder prepared without a validation split (training evaluates on it)."""
    if not dataset.is_chat and not int(dataset.meta["val_tokens"]):
        raise TrainingError(f"{dataset.path} has no validation split (prepared with --val-fraction 0): "
                            "prepare it again with a --val-fraction above 0")


def _check_fits(model_config: GPTConfig, dataset: DataSet, block: int) -> None:
    """The model must cover the data's vocabulary, and each split must hold one training window of
    `block` tokens (chat data: one conversation)."""
    vocab = int(dataset.meta["vocab_size"])
    if model_config.vocab_size < vocab:
        raise TrainingError(f"vocab_size={model_config.vocab_size} is smaller than the data's vocabulary of {vocab}")
    if dataset.is_chat:
        for split in ("train", "val"):
            if not dataset.meta[f"{split}_conversations"]:
                raise TrainingError(f"the {split} split of {dataset.path} holds no conversation; "
                                    "prepare more conversations or another --val-fraction")
        return
    check_has_val(dataset)
    for split in ("train", "val"):
        n = len(getattr(dataset, split))
        if n < block + 1:
            raise TrainingError(
                f"the {split} split has {n} tokens, fewer than block_size + 1 = {block + 1}; "
                "use more text or a smaller --block-size"
            )


class _Run:
    """One run as it trains: the model, its optimizer and what a checkpoint keeps (step, tokens seen,
    the schedule, the random streams), with the phases of the loop as methods: train_step (the loss
    is `loss`), evaluate, save, decide. Phase 2, setting up, is the constructor (and restore, on resume)."""

    def __init__(self, ctx: distributed.Dist, folder: RunFolder, setup: _Setup,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        cfg = self.cfg = setup.cfg
        self.clock, self.started = clock, 0.0  # started: when this invocation's steps began (_steps sets it)
        self.seconds_before = 0.0  # the run's training time before this invocation (a resumed checkpoint's)
        self.ctx, self.folder, self.dataset, self.start = ctx, folder, setup.dataset, setup.start
        self.device, self.dtype = ctx.device, resolve_dtype(cfg.dtype, ctx.device)
        allow_fast_float32(self.device)
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
        self.data_rng = torch.Generator().manual_seed(cfg.seed)
        self.block = setup.window
        self.batches = {s: Batches.of(self.dataset, s, self.block) for s in ("train", "val")}
        self.order = data_order(cfg, self.dataset)
        self.stream = Stream(self.dataset.train, self.block) if self.order == "sequential" else None
        self.tokens_per_step = cfg.batch_size * cfg.grad_accum * self.block * ctx.world_size
        self.step, self.tokens, self.horizon = 0, 0, cfg.max_iters
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
            self.restore(setup.state)
        self.warmup = warmup_steps(cfg, self.begun)
        self.step_model = torch.compile(self.wrapped) if cfg.compile else self.wrapped

    def restore(self, state: dict[str, Any]) -> None:
        """Put a checkpoint's training state back: where the run was, its optimizer, its random streams."""
        cfg, ctx, run = self.cfg, self.ctx, self.folder
        self.step, self.tokens = int(state["step"]), int(state["tokens"])
        self.seconds_before = state.get("elapsed") or 0.0  # a state saved before it was kept: unknown, none
        if isinstance(state.get("best_val"), float):
            self.best = state["best_val"]
        if self.budget:
            self.schedule = BudgetSchedule.resumed(cfg, state, self.step)
        elif cfg.max_iters is None and state["max_iters"] is not None:
            self.horizon = int(state["max_iters"])
        # a state saved before tinygpt kept it warmed up over cfg.warmup whole where max_iters was given
        self.begun = state["begun_max_iters"] if "begun_max_iters" in state else (
            self.horizon if cfg.max_iters is None else None)
        kind = state.get("optimizer_kind", "adamw")  # a state saved before muon existed is AdamW's
        if kind != cfg.optimizer:
            raise TrainingError(f"{run.path} trained with --optimizer {kind}: resume it with {kind} (its optimizer "
                                f"state is {kind}'s), or start a new run for {cfg.optimizer}")
        run.check_optimizer_state(state["optimizer"], self.optimizer)
        try:
            distributed.load_optimizer_state(self.model, self.optimizer, state["optimizer"])
            if state.get("scaler"):
                self.scaler.load_state_dict(state["scaler"])
            _restore_rng(state["rng"], ctx, self.device, cfg.seed + ctx.rank + 1_000_003 * self.step)
            self.data_rng.set_state(state["rng"]["data"])  # the same in every process: they draw the same global batches
            saved = state.get("data") or {"order": "random"}  # a state saved before data orders existed: random
            if saved["order"] != self.order:
                raise TrainingError(f"{run.path} trained with --data-order {saved['order']}: resume it with that order")
            if self.stream is not None:
                self.stream.restore(saved, run.state_file)
        except (KeyError, TypeError, ValueError, RuntimeError) as e:
            why = f"{type(e).__name__}: {e}".splitlines()[0]
            raise CheckpointError(f"{run.state_file}: does not fit this run ({why})") from None
        if ctx.is_main:
            run.truncate_metrics(self.step)

    def record_settings(self, data: str | Path, notes: dict[str, Any] | None, *, fresh: bool) -> None:
        """Rank 0 writes train_config.json (the data, its tokenizer's fingerprint, the settings, the notes
        merged with a resumed run's) and, for a new run, an empty metrics.jsonl."""
        if not self.ctx.is_main:
            return
        record = {"data": str(Path(data).resolve()), "tokenizer_fingerprint": self.dataset.fingerprint,
                  "train": self.cfg.to_dict(), **(self.start.record if self.start is not None else {})}
        self.folder.write_record(record, notes, fresh=fresh)

    def loss(self, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """The training loss of one micro-batch (Batches.get: inputs x, targets y, and for chat the
        targets' weights and document ids), under autocast."""
        with autocast(self.device, self.dtype):
            return batch_loss(self.step_model, batch, self.device)

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
        for micro in range(cfg.grad_accum):
            # every process draws the whole global batch (from the same generator, or the next in the
            # stream) and takes its slice
            rows = cfg.batch_size * ctx.world_size
            offsets = self.stream.draw(rows) if self.stream else self.batches["train"].sample(rows, self.data_rng)
            if isinstance(self.dataset.train, ShardedTokens):  # the whole global batch's: every process stops alike
                self.dataset.train.check_windows(offsets.numpy(), self.block + 1)
            offsets = share(offsets, ctx.rank, cfg.batch_size)
            hooks.on_batch(offsets)
            batch = self.batches["train"].get(offsets)
            # gradients are reduced across processes once, in the last micro-step's backward
            with distributed.gradient_sync(self.wrapped, micro == cfg.grad_accum - 1):
                loss = self.loss(batch) / cfg.grad_accum
                self.scaler.scale(loss).backward()
            loss_sum += loss.detach()
        loss_value = ctx.mean(loss_sum)  # the global batch's loss, the same in every process
        if not math.isfinite(loss_value):
            raise NonFiniteError(f"step {self.step + 1}: the loss is {loss_value}; stopped before the update", self.step + 1)
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
        self.tokens += self.tokens_per_step
        return {"step": self.step, "tokens": self.tokens, "loss": loss_value, "lr": lr, "grad_norm": grad_norm}

    def decay_begins(self, before: dict[str, float] | None) -> bool:
        """Whether the step about to run is a WSD run's first at a decaying rate (`before`: a time
        budget's schedule as it was before this step's rate was drawn)."""
        if self.cfg.lr_schedule != "wsd":
            return False
        if self.schedule is not None:
            return before["progress"] == 0 and self.schedule.progress > 0
        return self.step == decay_start(self.cfg, self.horizon, self.warmup)

    def evaluate(self, iters: int | None = None) -> dict[str, Any]:
        """Phase 4a: the loss on both splits (eval_iters batches, or the first `iters`); its metrics line."""
        self.model.eval()
        losses = {
            s: self.ctx.mean(estimate_loss(self.model, self.batches[s], self.cfg, self.device, self.dtype,
                                           rank=self.ctx.rank, world_size=self.ctx.world_size, iters=iters))
            for s in ("train", "val")
        }
        self.model.train()
        record = {"step": self.step, "tokens": self.tokens, "train_loss": losses["train"], "val_loss": losses["val"]}
        return {**record, "eval_iters": iters} if iters is not None and iters < self.cfg.eval_iters else record

    def save(self, folder: RunFolder | None = None, schedule: dict[str, float] | None = None) -> None:
        """Phase 4b: a checkpoint of the weights and the training state (every process takes part; rank 0 writes)
        in the run folder, or as a run folder of its own (`folder`, with the run's settings and metrics so
        far beside it, and the schedule's state `schedule` in place of the current one)."""
        ctx, device = self.ctx, self.device
        rng = {"torch": torch.get_rng_state(), "data": self.data_rng.get_state()}
        if device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(device)
        if ctx.enabled:  # every process's dropout stream, so a resume on as many processes is exact
            rng["torch_ranks"] = ctx.gather(torch.get_rng_state())
            if device.type == "cuda":
                rng["cuda_ranks"] = ctx.gather(torch.cuda.get_rng_state(device))
        weights, optimizer_state = distributed.full_state(self.model, self.optimizer, ctx)  # gathered under FSDP
        if not ctx.is_main:
            return
        weights, master = self.stored(weights)
        train_state = {
            "step": self.step, "tokens": self.tokens, "elapsed": self.seconds(), "max_iters": self.horizon,
            "begun_max_iters": self.begun,
            "optimizer": optimizer_state,
            "scaler": self.scaler.state_dict() if self.scaler.is_enabled() else None, "rng": rng,
            "schedule": schedule or (self.schedule.state() if self.schedule is not None else None),
            "optimizer_kind": self.cfg.optimizer,
            "data": self.stream.state() if self.stream is not None else {"order": "random"},
        }
        if self.keep_best:
            train_state["best_val"] = self.best
        if master is not None:
            train_state["master"] = master
        base, checksum = (self.start.adapter_base, self.start.base_checksum) if self.start else (None, None)
        if folder is not None:
            self.folder.copy_records(folder)
        checkpoint.save_training((folder or self.folder).path, self.model, train_state, self.dataset.tokenizer,
                                 state_dict=weights, adapter_base=base, base_checksum=checksum)

    def stored(self, weights: dict[str, torch.Tensor] | None) -> tuple[dict | None, dict | None]:
        """The weights to save (full_state's: None for the model's own) in the Start's dtypes, and the
        float32 weights they were rounded from, or None where nothing was rounded: an update smaller
        than half a bfloat16 step is kept there until the steps add up to one."""
        dtypes = self.start.dtypes if self.start is not None else None
        trained = self.model.state_dict() if weights is None else weights
        if not dtypes or all(dtypes.get(k, v.dtype) == v.dtype for k, v in trained.items()):
            return weights, None
        return {k: v.to(dtypes.get(k, v.dtype)) for k, v in trained.items()}, {k: v.cpu() for k, v in trained.items()}

    def decide(self, stop: _Stop, should_stop: Callable[[int], bool] | None, pace: _Pace, now: float) -> str | None:
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


def _build_model(setup: _Setup, folder: RunFolder, home: torch.device) -> GPT:
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


def _steps(run: _Run, hooks: TrainCallback, should_stop: Callable[[int], bool] | None,
           clock: Callable[[], float]) -> TrainResult:
    """The loop: steps until a stop, evaluating and saving every eval_interval steps and at the end."""
    cfg = run.cfg
    metrics = run.folder.metrics_log() if run.ctx.is_main else MetricsLog(None)
    stop = _Stop()
    loss: float | None = None
    val_loss: float | None = None
    stopped = "max_iters"
    try:
        hooks.on_start(RunStart(run.folder.path, run.ctx.rank, run.ctx.world_size, run.step, run.total(), run.model,
                                metrics.log))
        if run.device.type == "cpu":
            kernels.lowbit()  # training's GELU and attention kernels, compiled (once a machine) before the clock
        started = run.started = clock()
        pace = _Pace(cfg, started)
        with _signals(stop):
            at_start = run.keep_best and run.step == 0 and run.best == math.inf  # a new run (a resumed one has a best)
            if at_start:  # the starting model is the one to beat (nanoGPT evaluates at iteration 0 for this)
                t_eval = clock()
                val_loss = _evaluate_and_save(run, metrics, hooks)
                pace.evaluation(clock() - t_eval)
            while run.horizon is None or run.step < run.horizon:
                t0 = clock()
                record = run.train_step(hooks)
                now = clock()
                dt = now - t0
                pace.step(dt)
                loss = record["loss"]
                record.update(tokens_per_s=run.tokens_per_step / dt if dt > 0 else None, time=now - started)
                metrics.log(record)
                if run.step % cfg.eval_interval == 0:
                    t_eval = clock()
                    val_loss = _evaluate_and_save(run, metrics, hooks)
                    pace.evaluation(clock() - t_eval)
                why = run.decide(stop, should_stop, pace, clock())
                hooks.on_step(record, run.total())
                if why is not None:
                    stopped = why
                    break
            if run.step % cfg.eval_interval != 0 or (run.step == 0 and not at_start):
                # a time budget's last evaluation takes what the budget still affords (the processes agree)
                iters = int(run.ctx.min(pace.final_eval_iters(clock()))) if cfg.max_time is not None else None
                val_loss = _evaluate_and_save(run, metrics, hooks, iters)
            run.ctx.barrier()  # nobody leaves before rank 0's checkpoint is on disk
        now = clock()
        result = TrainResult(run.folder.path, run.step, loss, val_loss, stopped, run.tokens, now - started,
                             run.seconds(now))
        hooks.on_end(result, run.model)
        return result
    finally:
        metrics.close()


def _evaluate_and_save(run: _Run, metrics: MetricsLog, hooks: TrainCallback, iters: int | None = None) -> float:
    """Phase 4: evaluate, log it, save a checkpoint (with keep best, only one that improves on the
    lowest validation loss saved); the validation loss."""
    record = run.evaluate(iters)
    keep = not run.keep_best or record["val_loss"] < run.best
    if run.keep_best:
        record["kept"] = keep
    metrics.log(record)
    hooks.on_eval(record)
    if keep:
        run.best = min(run.best, record["val_loss"])
        run.save()
    return record["val_loss"]


class _Stop:
    """SIGINT/SIGTERM set a flag; the loop finishes its step, saves and returns."""

    def __init__(self) -> None:
        self.signal: str | None = None

    def __call__(self, signum, frame) -> None:
        if self.signal is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now
        self.signal = signal.Signals(signum).name


@contextmanager
def _signals(stop: _Stop):
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


def _restore_rng(rng: dict[str, Any], ctx: distributed.Dist, device: torch.device, fresh_seed: int) -> None:
    """Put back this process's RNG state (dropout). A run saved by as many processes gives each its
    own stream back; with another process count rank 0 continues rank 0's and the others start anew."""
    cuda = device.type == "cuda"
    ranks = rng.get("torch_ranks")
    if ctx.enabled and ranks is not None and len(ranks) == ctx.world_size:
        torch.set_rng_state(ranks[ctx.rank])
        if cuda and "cuda_ranks" in rng:
            torch.cuda.set_rng_state(rng["cuda_ranks"][ctx.rank], device)
    elif ctx.rank == 0:
        torch.set_rng_state(rng["torch"])
        if cuda and "cuda" in rng:
            torch.cuda.set_rng_state(rng["cuda"], device)
    else:
        torch.manual_seed(fresh_seed)


class _Pace:
    """How fast a run with a time budget goes, measured as it goes: the median of the last
    SPEED_WINDOW step times (the first step, which warms caches and kernels up, left out unless it
    is all there is), and the time an evaluation with its checkpoint takes (estimated from
    eval_iters until one has run)."""

    def __init__(self, cfg: TrainConfig, started: float) -> None:
        self.cfg, self.started = cfg, started
        self.first: float | None = None
        self.times: list[float] = []
        self.steps = 0
        self.eval_seconds: list[float] = []

    def step(self, seconds: float) -> None:
        self.steps += 1
        if self.steps == 1:
            self.first = seconds
        else:
            self.times = (self.times + [seconds])[-SPEED_WINDOW:]

    def evaluation(self, seconds: float) -> None:
        self.eval_seconds = (self.eval_seconds + [seconds])[-3:]

    def per_step(self) -> float:
        return float(np.median(self.times)) if self.times else (self.first or 0.0)

    def per_eval(self) -> float:
        """An evaluation's seconds: as measured, else 2 x eval_iters forward passes at a third of a step each."""
        if self.eval_seconds:
            return float(np.mean(self.eval_seconds))
        return self.per_step() * 2 * self.cfg.eval_iters / (3 * self.cfg.grad_accum)

    def time_left(self, now: float) -> float:
        """Seconds of the budget left once the last evaluation is paid for. It is given at most a
        tenth of the budget: when a whole evaluation costs more, it takes fewer batches (final_eval_iters)."""
        return self.cfg.max_time - (now - self.started) - min(self.per_eval(), self.cfg.max_time / 10)

    def steps_left(self, now: float) -> float | None:
        """Steps the rest of the budget buys, after the evaluations they bring and the last one
        (None until CALIBRATION_STEPS steps have been timed)."""
        if self.steps <= CALIBRATION_STEPS or not self.times:
            return None
        return max(0.0, self.time_left(now) / (self.per_step() + self.per_eval() / self.cfg.eval_interval))

    def final_eval_iters(self, now: float) -> int:
        """Batches per split the last evaluation can afford in what is left of the budget: eval_iters
        when it fits, fewer (at least one) when the budget is nearly spent, so the run ends on time."""
        per_batch = self.per_eval() / self.cfg.eval_iters
        affordable = (self.cfg.max_time - (now - self.started)) / per_batch if per_batch > 0 else math.inf
        return int(max(1, min(self.cfg.eval_iters, affordable)))


def eval_report(result: dict[str, Any], n_tokens: int, *, chars: int, nbytes: int, kind: str) -> dict[str, Any]:
    """What an evaluation of a text comes to: loss, perplexity, bits per character (what compares
    models across tokenizers) and, for a tokenizer other than char, bits per UTF-8 byte (its tokens
    need not end on a character).

    The first token of each text is never predicted (it has no context), so the characters or bytes
    are counted for the predicted share of the tokens only.

    Args:
        result: what evaluate() returned for the tokens.
        n_tokens: how many tokens evaluate() was given.
        chars, nbytes: the characters and the UTF-8 bytes those tokens decode to.
        kind: the tokenizer's kind ("char", "bpe", "gpt2").

    Returns {"loss", "perplexity", "bits_per_char", "tokens"} and, but for char, "bits_per_byte".
    """
    share = result["tokens"] / max(1, n_tokens)
    bits = result["nll"] / math.log(2)
    report = {"loss": result["loss"], "perplexity": math.exp(result["loss"]),
              "bits_per_char": bits / (chars * share), "tokens": result["tokens"]}
    if kind != "char":
        report["bits_per_byte"] = bits / (nbytes * share)
    return report
