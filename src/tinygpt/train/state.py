"""A run's saved state: what a checkpoint keeps beside the weights (train_state.pt: the step, the tokens,
the time, the schedule, the optimizer and gradient scaler, every random stream, the objective's own),
and how a resume puts it back. The file's shape and every check on it are the run folder's
(RunFolder.load_state, check_state, check_optimizer_state): nothing is restored before they pass."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from .. import checkpoint, distributed
from ..errors import CheckpointError, TrainingError
from ..optim import BudgetSchedule
from ..run_folder import RunFolder

if TYPE_CHECKING:
    from .run import Run


def save(run: Run, folder: RunFolder | None = None, schedule: dict[str, float] | None = None) -> None:
    """A checkpoint of the run's weights and training state, in its folder or in `folder` (a run folder
    of its own, with the run's train_config.json and metrics.jsonl so far copied beside it), with the
    schedule's state `schedule` in place of the current one. Every process takes part; rank 0 writes."""
    ctx, device = run.ctx, run.device
    rng = {"torch": torch.get_rng_state()}
    if device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(device)
    if ctx.enabled:  # every process's dropout stream, so a resume on as many processes is exact
        rng["torch_ranks"] = ctx.gather(torch.get_rng_state())
        if device.type == "cuda":
            rng["cuda_ranks"] = ctx.gather(torch.cuda.get_rng_state(device))
    weights, optimizer_state = distributed.full_state(run.model, run.optimizer, ctx)  # gathered under FSDP
    if not ctx.is_main:
        return
    weights, master = _stored(run, weights)
    train_state = {
        "step": run.step, "tokens": run.tokens, "elapsed": run.seconds(), "max_iters": run.horizon,
        "begun_max_iters": run.begun,
        "optimizer": optimizer_state,
        "scaler": run.scaler.state_dict() if run.scaler.is_enabled() else None, "rng": rng,
        "schedule": schedule or (run.schedule.state() if run.schedule is not None else None),
        "optimizer_kind": run.cfg.optimizer,
    }
    run.objective.save_state(train_state)
    if run.keep_best:
        train_state["best_val"] = run.best
    if master is not None:
        train_state["master"] = master
    base, checksum = (run.start.adapter_base, run.start.base_checksum) if run.start else (None, None)
    if folder is not None:
        run.folder.copy_records(folder)
    checkpoint.save_training((folder or run.folder).path, run.model, train_state, run.dataset.tokenizer,
                             state_dict=weights, adapter_base=base, base_checksum=checksum)


def _stored(run: Run, weights: dict[str, torch.Tensor] | None) -> tuple[dict | None, dict | None]:
    """The weights to save (full_state's: None for the model's own) in the Start's dtypes, and the
    float32 weights they were rounded from, or None where nothing was rounded: an update smaller
    than half a bfloat16 step is kept there until the steps add up to one."""
    dtypes = run.start.dtypes if run.start is not None else None
    trained = run.model.state_dict() if weights is None else weights
    if not dtypes or all(dtypes.get(k, v.dtype) == v.dtype for k, v in trained.items()):
        return weights, None
    return {k: v.to(dtypes.get(k, v.dtype)) for k, v in trained.items()}, {k: v.cpu() for k, v in trained.items()}


def restore(run: Run, state: dict[str, Any]) -> None:
    """Put a checkpoint's training state back into the run being set up: where it was, its optimizer,
    its random streams, its objective's position; then drop the metrics logged after it."""
    cfg, ctx, folder = run.cfg, run.ctx, run.folder
    run.step, run.tokens = int(state["step"]), int(state["tokens"])
    run.seconds_before = state.get("elapsed") or 0.0  # a state saved before it was kept: unknown, none
    if isinstance(state.get("best_val"), float):
        run.best = state["best_val"]
    if run.budget:
        run.schedule = BudgetSchedule.resumed(cfg, state, run.step)
    elif cfg.max_iters is None and state["max_iters"] is not None:
        run.horizon = int(state["max_iters"])
    # a state saved before tinygpt kept it warmed up over cfg.warmup whole where max_iters was given
    run.begun = state["begun_max_iters"] if "begun_max_iters" in state else (
        run.horizon if cfg.max_iters is None else None)
    kind = state.get("optimizer_kind", "adamw")  # a state saved before muon existed is AdamW's
    if kind != cfg.optimizer:
        raise TrainingError(f"{folder.path} trained with --optimizer {kind}: resume it with {kind} (its optimizer "
                            f"state is {kind}'s), or start a new run for {cfg.optimizer}")
    folder.check_optimizer_state(state["optimizer"], run.optimizer)
    try:
        distributed.load_optimizer_state(run.model, run.optimizer, state["optimizer"])
        if state.get("scaler"):
            run.scaler.load_state_dict(state["scaler"])
        _restore_rng(state["rng"], ctx, run.device, cfg.seed + ctx.rank + 1_000_003 * run.step)
        run.objective.restore_state(state, folder)
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        why = f"{type(e).__name__}: {e}".splitlines()[0]
        raise CheckpointError(f"{folder.state_file}: does not fit this run ({why})") from None
    if ctx.is_main:
        folder.truncate_metrics(run.step)


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
