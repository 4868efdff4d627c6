"""Several processes training one model, on PyTorch's own engine (torch.distributed).

torchrun starts one process per device and tells each who it is through the environment (RANK,
LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT). `process_group` joins that job: gloo on CPU,
NCCL on CUDA with one GPU per process (cuda:LOCAL_RANK). `Dist` describes this process's place in
the job and holds the few collectives the training loop needs; with one process it is a no-op,
so the single-process path runs exactly as before.

The model is wrapped in one of two ways:
- DDP: every process holds the whole model and optimizer; gradients are averaged by all-reduce.
- FSDP2 (`fully_shard`): parameters, gradients and optimizer state are sharded across processes
  (each transformer block is its own unit, then the root takes the embeddings, the final
  LayerNorm and the head, which keeps a tied head and embedding one shared tensor).

Checkpoints are always a normal run folder: the full model and optimizer state, gathered to rank
0, in the single-process layout (optimizer state keyed by parameter index), so any run resumes on
any number of processes, with or without FSDP.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from .errors import TrainingError

T = TypeVar("T")


_joined = False  # whether process_group() took this process into a multi-process job (see joined_a_group)


def joined_a_group() -> bool:
    """Whether this process took part in a multi-process job through process_group().

    PyTorch keeps a gloo group's worker threads after destroy_process_group() once DDP or FSDP2 has
    used the group (their caches hold on to it), and a worker that is still letting go of a finished
    collective's tensors when the interpreter shuts down aborts the process ("terminate called
    without an active exception", after the run was saved). Such a process ends without the
    interpreter's teardown: tinygpt.cli.leave.
    """
    return _joined


def env_world_size() -> int:
    """The number of processes torchrun started (1 when not launched by torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


@dataclass(frozen=True)
class Dist:
    """This process's place in the job, and the collectives the training loop uses.

    Every collective here must be called by all processes in the same order; with one process
    each returns its input.
    """

    device: torch.device
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()

    def _reduce(self, values: list[float], op) -> list[float]:
        if not self.enabled:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=op)
        return t.tolist()

    def mean(self, value: float | torch.Tensor) -> float:
        """The mean over processes of a per-process scalar (each process's share is equal)."""
        value = float(value)
        return self._reduce([value], dist.ReduceOp.SUM)[0] / self.world_size if self.enabled else value

    def max(self, values: list[float]) -> list[float]:
        """Element-wise maximum over processes: used to agree on flags (any process set it)."""
        return self._reduce(values, dist.ReduceOp.MAX)

    def min(self, value: float) -> float:
        return self._reduce([value], dist.ReduceOp.MIN)[0]

    def gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every process's copy of a same-shaped tensor, on the CPU, in rank order."""
        if not self.enabled:
            return [tensor.cpu()]
        local = tensor.to(self.device)  # NCCL only moves CUDA tensors
        out = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.all_gather(out, local)
        return [t.cpu() for t in out]

    def main_first(self, fn: Callable[[], T]) -> T:
        """Run fn on rank 0, then, if it succeeded, on the others (rank 0 may repair files first)."""
        if not self.enabled:
            return fn()
        result, error = None, None
        if self.is_main:
            try:
                result = fn()
            except Exception as e:  # the others must still take part in the agreement below
                error = e
        failed = self.max([float(error is not None)])[0]
        if self.is_main:
            if error is not None:
                raise error
            return result
        if failed:
            raise TrainingError("process 0 could not read the run; see its message")
        return fn()


def _device_for(device: torch.device, local_rank: int) -> tuple[torch.device, str]:
    if device.type == "cuda":
        if device.index is not None and device.index != local_rank:
            raise TrainingError(
                f"--device {device}: with several processes each uses cuda:LOCAL_RANK; pass --device cuda"
            )
        return torch.device("cuda", local_rank), "nccl"
    if device.type == "cpu":
        return device, "gloo"
    raise TrainingError(f"multi-process training runs on cpu (gloo) or cuda (NCCL), not on {device.type}")


@contextmanager
def process_group(device: torch.device, timeout: float = 600.0) -> Iterator[Dist]:
    """Join the job torchrun started (or describe the one already joined); one process: no group.

    A group created here is destroyed on the way out; a group the caller created is left alone.

    Args:
        device: the resolved training device; under torchrun a CUDA device becomes cuda:LOCAL_RANK.
        timeout: seconds a collective waits for the other processes before failing, which bounds
            how long the survivors of a dead or hung process keep waiting.
    """
    initialized = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size() if initialized else env_world_size()
    if world <= 1:
        yield Dist(device)
        return
    global _joined
    _joined = True
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device, backend = _device_for(device, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if initialized:
        yield Dist(device, dist.get_rank(), local_rank, world)
        return
    dist.init_process_group(
        backend, timeout=timedelta(seconds=timeout), device_id=device if device.type == "cuda" else None
    )
    try:
        yield Dist(device, dist.get_rank(), local_rank, dist.get_world_size())
    finally:
        dist.destroy_process_group()


def is_comm_failure(error: BaseException) -> bool:
    """Whether an exception means another process died or stopped answering (not a bug here)."""
    if isinstance(error, dist.DistError):
        return True
    text = str(error)
    # gloo raises plain RuntimeErrors for a closed connection or a timed-out collective
    return isinstance(error, RuntimeError) and any(
        s in text for s in ("Connection closed by peer", "Connection reset by peer", "Timed out", "timed out",
                            "NCCL", "ProcessGroup", "gloo")
    )


def describe_failure(error: BaseException) -> str:
    """The gist of a communication error, without the backend's source location and advice."""
    text = " ".join(str(error).split()) or type(error).__name__
    text = re.sub(r"^\[[^\]]*\]\s*", "", text)  # gloo: "[.../pair.cc:553] Connection closed by peer ..."
    return text.split(". ")[0][:200]


# ---- wrapping the model ----------------------------------------------------------------------


def wrap(model: nn.Module, ctx: Dist, *, fsdp: bool) -> nn.Module:
    """The module the training step calls: the model itself (one process), DDP, or FSDP2.

    With FSDP the model is sharded in place (its class becomes an FSDP subclass, its parameters
    DTensors) and returned; with DDP the wrapper is returned and `model` stays the plain GPT.
    """
    if not ctx.enabled:
        return model
    if fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
        for block in model.h:  # one unit per block: only one block's full weights live at a time
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)  # the rest, including a tied wte/lm_head as one parameter
        return model
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)


def is_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def gradient_sync(wrapped: nn.Module, sync: bool):
    """Context for one micro-step's backward: skip the gradient reduction unless `sync` (the last
    micro-step of an accumulation), so accumulated gradients are reduced once per optimizer step."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    if isinstance(wrapped, DDP):
        return nullcontext() if sync else wrapped.no_sync()
    if is_sharded(wrapped):
        wrapped.set_requires_gradient_sync(sync)
    return nullcontext()


def full_value(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor from a DTensor (e.g. a gradient norm computed over sharded gradients)."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def full_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter in full on every process (a collective under FSDP); for checks and debugging."""
    return {n: full_value(p.detach()).cpu() for n, p in model.named_parameters()}


# ---- checkpoints -----------------------------------------------------------------------------


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer, ctx: Dist) -> tuple[dict | None, dict | None]:
    """The model's weights and the optimizer's state in full, in the single-process layout.

    Returns (weights, optimizer_state) on rank 0 and (None, None) elsewhere. weights is None also
    when the plain module's own state_dict() is the answer (no sharding). Under FSDP this is a
    collective: every process must call it.
    """
    if not is_sharded(model):
        return None, (optimizer.state_dict() if ctx.is_main else None)
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)  # gathered to rank 0's CPU memory
    weights = get_model_state_dict(model, options=options)
    optim = get_optimizer_state_dict(model, optimizer, options=options)
    if not ctx.is_main:
        return None, None
    return weights, _state_by_index(optim)


def load_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Load a single-process layout optimizer state (full tensors) into a plain or sharded model's optimizer."""
    if not is_sharded(model):
        optimizer.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    names = {p: n for n, p in model.named_parameters()}
    fqns = [names[p] for group in optimizer.param_groups for p in group["params"]]
    # every process read the same file, so each shards its own full copy: no broadcast needed
    set_optimizer_state_dict(
        model, optimizer, optim_state_dict=_state_by_name(state, fqns), options=StateDictOptions(full_state_dict=True)
    )


def _state_by_index(state: dict[str, Any]) -> dict[str, Any]:
    """torch.distributed.checkpoint's optimizer layout (keyed by parameter name) -> Optimizer.state_dict()'s
    (keyed by position across the param groups, in order)."""
    index: dict[str, int] = {}
    groups = []
    for group in state["param_groups"]:
        ids = []
        for fqn in group["params"]:
            index.setdefault(fqn, len(index))
            ids.append(index[fqn])
        groups.append({**group, "params": ids})
    return {"state": {index[fqn]: s for fqn, s in state["state"].items()}, "param_groups": groups}


def _state_by_name(state: dict[str, Any], fqns: list[str]) -> dict[str, Any]:
    """The inverse of _state_by_index, given the parameter names in the optimizer's order."""
    groups = [{**group, "params": [fqns[i] for i in group["params"]]} for group in state["param_groups"]]
    if sum(len(g["params"]) for g in groups) != len(fqns):
        raise TrainingError("the saved optimizer state does not match the model's parameters")
    return {"state": {fqns[int(i)]: s for i, s in state["state"].items()}, "param_groups": groups}
