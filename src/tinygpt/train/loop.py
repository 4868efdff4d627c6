"""The one training loop: AdamW (or Muon beside it), warmup + cosine (or WSD, ...), clipping, accumulation,
mixed precision, evaluation, checkpoints and exact resume, on one process or several (torchrun: DDP or FSDP2).
It trains the model it is given, returns a TrainResult or raises, and never prints or exits:
what a caller shows as a run goes (a progress bar, a trace) hangs on its TrainCallback hooks.

train() reads top to bottom: the settings, checked before anything is written (run.settings), the run
set up (run.Run, restored on resume by state.restore), then the loop in steps: Run.train_step,
Run.evaluate and Run.save as it goes, with Run.decide to stop. What a step optimises is the run's
objective (tinygpt.train.objectives): the loop asks it for each micro-batch and its loss, and for each
evaluation. Fine-tuning (tinygpt.finetune) is this loop with a Start: the starting model built elsewhere
(a pretrained one, with what is not to train frozen or LoRA's adapters added), how a checkpoint of it is
saved (an adapter run, for LoRA) and read back, keep best, and the objective when it is not the data's own."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .. import distributed, kernels
from ..config.model import GPTConfig
from ..config.train import TrainConfig
from ..data.folder import DataSet, load_data
from ..device import resolve_device
from ..errors import ConfigError, TinyGPTError, TrainingError
from ..run_folder import MetricsLog, RunFolder
from ..sizing import ModelChoice
from .callbacks import AllOf, ProgressBar, RunStart, TrainCallback, TrainResult
from .pacing import Pace, Stop, signals
from .run import Run, Start, settings


def train(
    data: str | Path | DataSet,
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
        data: a folder written by `tinygpt prepare`, or a DataSet: load_data's, or one made in memory for an
            objective that draws its own rows (GRPO's prompts, named by their file), recorded by its path.
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
    hooks = AllOf([*([ProgressBar()] if progress else []), *callbacks])
    folder = RunFolder(Path(out))
    with distributed.process_group(resolve_device(cfg.device), cfg.dist_timeout) as ctx:
        try:
            dataset = data if isinstance(data, DataSet) else load_data(data)
            setup = settings(ctx, folder, dataset, model_config, cfg, resume, notes)
            run = Run(ctx, folder, setup, clock)
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


def _steps(run: Run, hooks: TrainCallback, should_stop: Callable[[int], bool] | None,
           clock: Callable[[], float]) -> TrainResult:
    """The loop: steps until a stop, evaluating and saving every eval_interval steps and at the end."""
    cfg = run.cfg
    metrics = run.folder.metrics_log() if run.ctx.is_main else MetricsLog(None)
    stop = Stop()
    loss: float | None = None
    val_loss: float | None = None
    stopped = "max_iters"
    try:
        hooks.on_start(RunStart(run.folder.path, run.ctx.rank, run.ctx.world_size, run.step, run.total(), run.model,
                                metrics.log))
        if run.device.type == "cpu":
            kernels.lowbit()  # training's GELU and attention kernels, compiled (once a machine) before the clock
        started = run.started = clock()
        pace = Pace(cfg, started)
        with signals(stop):
            # a new run (a resumed one has a best); the starting model is the one to beat (nanoGPT evaluates at
            # iteration 0 for this), or the point an objective's curves start from
            at_start = (run.keep_best or run.objective.evaluate_first) and run.step == 0 and run.best == math.inf
            if at_start:
                t_eval = clock()
                # keep last saves nothing at step 0: the model trained from is not a step of the run
                val_loss = _evaluate_and_save(run, metrics, hooks, save=run.keep_best)
                pace.evaluation(clock() - t_eval)
            while run.horizon is None or run.step < run.horizon:
                t0 = clock()
                record = run.train_step(hooks)
                now = clock()
                dt = now - t0
                pace.step(dt)
                loss = record["loss"]
                record.update(tokens_per_s=run.step_tokens / dt if dt > 0 else None, time=now - started)
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


def _evaluate_and_save(run: Run, metrics: MetricsLog, hooks: TrainCallback, iters: int | None = None, *,
                       save: bool = True) -> float:
    """Phase 4: evaluate, log it, save a checkpoint (with keep best, only one that improves on the
    lowest validation loss saved; none unless `save`); the validation loss."""
    record = run.evaluate(iters)
    keep = not run.keep_best or record["val_loss"] < run.best
    if run.keep_best:
        record["kept"] = keep
    metrics.log(record)
    hooks.on_eval(record)
    if keep:
        run.best = min(run.best, record["val_loss"])
        if save:
            run.save()
    return record["val_loss"]
