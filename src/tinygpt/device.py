"""Device, dtype and autocast, resolved in one place."""

from __future__ import annotations

import contextlib
import ctypes
import os
from pathlib import Path

import torch

from .calc.units import plural
from .errors import ConfigError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


DEVICE_NAMES = "auto, cpu, cuda, cuda:N or mps"


def resolve_device(name: str = "auto") -> torch.device:
    """"auto" picks cuda, then mps, then cpu; an explicit name must be one tinygpt runs on (cpu,
    cuda, cuda:N, mps) and available here.

    Raises:
        ConfigError: another kind of device (xpu, meta, ...), a name torch does not know, or one this
            machine lacks (cuda without a GPU, cuda:3 with two).
    """
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError, ValueError):
        raise ConfigError(f"device: {name!r} is not a device name ({DEVICE_NAMES})") from None
    if device.type not in ("cpu", "cuda", "mps"):
        # torch knows xpu, meta, hpu, ...; the model, its cache and autocast are written for these three
        raise ConfigError(f"device: {name!r} is not a device tinygpt runs on ({DEVICE_NAMES})")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("device: cuda was asked for but no CUDA device is available")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise ConfigError(f"device: {name} was asked for but this machine has {plural(count, 'CUDA device')}"
                              f" (cuda:0 to cuda:{count - 1})")
    elif device.index not in (None, 0):
        raise ConfigError(f"device: {name!r}: there is one {device.type} device ({device.type} or {device.type}:0)")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError("device: mps was asked for but MPS is not available")
    return device


def cpu_flag_set(cpuinfo: str | None = None) -> set[str] | None:
    """The CPU's instruction-set flags from /proc/cpuinfo's first flags line (avx2, fma, avx512_bf16, ...);
    None where there is none to read (not Linux, not x86).

    Args:
        cpuinfo: the text of /proc/cpuinfo (default: read it).
    """
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return None
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return None


def last_level_cache() -> int | None:
    """The bytes of this CPU's last-level cache, as Linux's sysfs gives cpu0's highest level (shared by
    the cores listed there, and on a virtual machine by other guests); None where it cannot be read."""
    levels = {}
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            level, size = int((index / "level").read_text()), (index / "size").read_text().strip()
            levels[level] = int(size[:-1]) * {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[size[-1]]
        except (OSError, ValueError, KeyError, IndexError):
            continue
    return levels[max(levels)] if levels else None


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (x86 AVX-512 BF16 or AMX tiles)."""
    cpu = getattr(torch, "cpu", None)
    checks = [getattr(cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    return any(check is not None and check() for check in checks)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """The compute dtype for training or inference. "auto": bfloat16 where the hardware computes it
    natively (CUDA GPUs that support it; CPUs with AVX-512 BF16 or AMX, where autocast trains
    faster than float32 for the same loss: the README's Performance section), else float32 (MPS
    included)."""
    if name == "auto":
        if device.type == "cuda" and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        if device.type == "cpu" and cpu_has_native_bf16():
            return torch.bfloat16
        return torch.float32
    if name not in DTYPES:
        raise ConfigError(f"dtype: must be one of auto, {', '.join(DTYPES)}; got {name!r}")
    if DTYPES[name] is torch.float16 and device.type != "cuda":
        raise ConfigError("dtype: float16 needs a CUDA device (use bfloat16 on CPU)")
    return DTYPES[name]


def autocast(device: torch.device, dtype: torch.dtype):
    """Mixed precision for the forward pass when dtype is lower than float32; a no-op otherwise."""
    if dtype is torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def allow_fast_float32(device: torch.device) -> None:
    """On CUDA, let float32 matmuls and convolutions use TF32 tensor cores (float32 range and
    accumulation, 10-bit mantissa inputs), as PyTorch recommends for training; elsewhere nothing."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


# mallopt's parameters (glibc's malloc.h), the largest mmap threshold it takes on 64 bits, and the environment
# through which a user sets glibc's own (whose choice then stands)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD_MAX = 32 * 1024 * 1024
GLIBC_MALLOC_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "GLIBC_TUNABLES")


def reuse_freed_memory(device: torch.device) -> None:
    """On a CPU under glibc, let a training step reuse the memory the step before it freed. glibc gives a freed
    block past its mmap threshold (128 KiB, then the largest such block freed) back to the system, and its heap's
    free top past twice that; the next step's activations, the same sizes, are then mapped again and fault in page
    by page: 10-23 thousand faults and 12-58 ms of system time a step of the 4 x 128 default at batch 32 x 128
    (AMD EPYC Zen 3), 0-2 with this. The threshold is fixed at glibc's largest (32 MiB: bigger blocks are mapped
    and returned as before) and the heap keeps what it frees, so the process holds the most its steps held at once.
    Nothing elsewhere (another device or C library), nor where glibc's own settings are in the environment
    (GLIBC_MALLOC_ENV).

    Args:
        device: where the steps run.
    """
    if device.type != "cpu" or not _glibc() or any(os.environ.get(v) for v in GLIBC_MALLOC_ENV):
        return
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is not None:
        mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX)
        mallopt(M_TRIM_THRESHOLD, 2**31 - 1)  # an int: the largest it takes


def _glibc() -> bool:
    """Whether this process runs on glibc (its confstr names it; musl, macOS and Windows have none)."""
    try:
        return (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc")
    except (AttributeError, ValueError, OSError):
        return False


def free_memory(device: torch.device) -> int | None:
    """Bytes that can still be allocated on `device`, or None where that cannot be told (MPS).

    On a CPU: the kernel's MemAvailable, or less where a cgroup (a container) caps this process.
    """
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type != "cpu":
        return None
    free = None
    try:
        with open("/proc/meminfo") as f:
            free = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        pass
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            used = int(f.read())
        if limit != "max":
            free = min(free if free is not None else int(limit), int(limit) - used)
    except (OSError, ValueError):
        pass
    return free


def free_cores() -> int | None:
    """Cores this process may run on that no other program is using at this moment, at least 1; None
    where that cannot be told (no Linux /proc).

    Linux's procs_running counts the threads running or waiting for a core, this process's own
    among them (an OpenMP thread still spinning after its work, too): those are taken out. A moment's
    count, which a program that works in bursts makes noisy: read it more than once to decide much.
    """
    try:
        cores = len(os.sched_getaffinity(0))
        with open("/proc/stat") as f:
            running = next(int(line.split()[1]) for line in f if line.startswith("procs_running "))
        own = 0
        for task in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{task}/stat") as f:
                    own += f.read().rsplit(")", 1)[1].split()[0] == "R"
            except OSError:  # a thread that ended while being read
                pass
    except (AttributeError, OSError, StopIteration, ValueError):
        return None
    return max(1, cores - max(0, running - own))
