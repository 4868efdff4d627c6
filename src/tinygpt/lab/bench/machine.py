"""The machine a bench run measures on: its processor, the instruction sets that decide which kernels
are fast, threads and load; and its limits (dense matmul FLOP/s, memory bandwidth, on a GPU the
datasheet's peaks) that turn speeds into MFU and bandwidth use."""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

import torch

from ... import kernels
from ...calc.hardware import gpu_peaks
from ...device import allow_fast_float32, cpu_flag_set, cpu_has_native_bf16
from .clock import best_time
from .plans import Plan, bf16_native


def machine(device: torch.device) -> dict[str, Any]:
    """What the run measured on: processor, threads, torch, load."""
    info: dict[str, Any] = {
        "device": str(device),
        "processor": _cpu_name(),
        "cores": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_flags": cpu_flags(),
        "native_bf16": cpu_has_native_bf16(),
        # built (seconds to a minute, once) only where they are used: a GPU run computes nothing on them
        "tinygpt_kernels": kernels.lowbit() is not None if device.type == "cpu" else None,
        "load_average": load_average(),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(gpu=torch.cuda.get_device_name(device), gpu_memory_gib=round(props.total_memory / 2**30, 1),
                    gpu_capability=f"{props.major}.{props.minor}", gpu_multiprocessors=props.multi_processor_count,
                    cuda=torch.version.cuda)
    return info


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# /proc/cpuinfo flag -> the name a report prints; these decide which CPU kernels are fast
CPU_FLAGS = {
    "avx2": "AVX2", "fma": "FMA", "f16c": "F16C", "avx512f": "AVX-512", "avx512_bf16": "AVX-512 BF16",
    "avx512_fp16": "AVX-512 FP16", "avx512_vnni": "AVX-512 VNNI", "avx_vnni": "AVX-VNNI", "amx_tile": "AMX",
}


def cpu_flags(cpuinfo: str | None = None) -> dict[str, bool]:
    """Which of CPU_FLAGS this CPU has (report names -> yes/no), from /proc/cpuinfo's first flags line;
    empty where there is none to read (not Linux, not x86).

    Args:
        cpuinfo: the text of /proc/cpuinfo (default: read it).
    """
    have = cpu_flag_set(cpuinfo)
    return {} if have is None else {name: flag in have for flag, name in CPU_FLAGS.items()}


def describe_cpu(info: dict[str, Any]) -> str:
    """One line naming the CPU's flags and what torch makes of them, from `machine()`'s dict."""
    flags = info.get("cpu_flags") or {}
    listed = ", ".join(f"{name} {'yes' if flag else 'no'}" for name, flag in flags.items()) or "flags unknown"
    built = info.get("tinygpt_kernels")  # None: not tried, on a GPU run
    return (f"cpu: {info['processor']}; {listed}; torch kernels {info['cpu_capability']}, "
            f"native bf16 {'yes' if info.get('native_bf16') else 'no'}, "
            f"tinygpt's CPU kernels {'not used' if built is None else 'yes' if built else 'no'}")


def load_average() -> float | None:
    """The 1-minute load average (None where the OS has none)."""
    try:
        return round(os.getloadavg()[0], 2)
    except (OSError, AttributeError):
        return None


def limits(plan: Plan, device: torch.device) -> dict[str, Any]:
    """Dense matmul GFLOP/s in float32 (TF32 on a GPU, as training sets it) and bfloat16, and memory GB/s:
    a sum over a big tensor (read), on a GPU a device-to-device copy (bytes read and written). On a GPU also
    peak_bf16_gflops and peak_memory_gbs, the limits its MFU and bandwidth use are measured against: the
    datasheet's where tinygpt.calc.hardware knows the GPU (peak_source names it), else the measured ones. A CPU
    that emulates bfloat16 gets no bfloat16 figure: no row trains in it there, and its matmul (0.26 GFLOP/s on a
    Zen 3) took 9 of a bench's first 10 minutes."""
    out: dict[str, Any] = {}
    n = plan.matmul_n
    allow_fast_float32(device)
    dtypes = (("float32", torch.float32), ("bfloat16", torch.bfloat16))
    for name, dtype in dtypes if bf16_native(device) else dtypes[:1]:
        a = torch.randn(n, n, device=device).to(dtype)  # random values: zeros multiply faster than data
        b = torch.randn(n, n, device=device).to(dtype)
        seconds = best_time(lambda: a @ b, plan.repeats, device)
        out[f"matmul_{name}_gflops"] = 2 * n**3 / seconds / 1e9
        del a, b
    x = torch.ones(plan.memory_mib * 2**20 // 4, device=device)
    if device.type == "cuda":
        y = torch.empty_like(x)
        seconds = best_time(lambda: y.copy_(x), plan.repeats, device)
        out["memory_read_gbs"] = 2 * x.numel() * 4 / seconds / 1e9
        del y
        datasheet = gpu_peaks(torch.cuda.get_device_name(device))
        if datasheet is not None:
            out.update(peak_bf16_gflops=datasheet[0] * 1e3, peak_memory_gbs=float(datasheet[1]),
                       peak_source=f"datasheet: {torch.cuda.get_device_name(device)}")
        else:
            out.update(peak_bf16_gflops=out["matmul_bfloat16_gflops"], peak_memory_gbs=out["memory_read_gbs"],
                       peak_source="measured")
    else:
        seconds = best_time(lambda: x.sum(), plan.repeats, device)
        out["memory_read_gbs"] = x.numel() * 4 / seconds / 1e9
    return out


def peak_flops(lim: dict[str, Any], dtype: str) -> float:
    """FLOP/s a training row's MFU divides by: the GPU's dense bf16 peak, on a CPU the measured matmul of its dtype."""
    return lim.get("peak_bf16_gflops", lim[f"matmul_{dtype}_gflops"]) * 1e9


def peak_bandwidth(lim: dict[str, Any]) -> float:
    """Bytes/s a decode row's bandwidth use divides by: the GPU's peak, on a CPU the measured read."""
    return lim.get("peak_memory_gbs", lim["memory_read_gbs"]) * 1e9


def describe_limits(lim: dict[str, Any]) -> str:
    """The limits line of a report: measured matmuls and memory, and a GPU's peaks with their source."""
    bf16 = lim.get("matmul_bfloat16_gflops")
    line = (f"limits: matmul {lim['matmul_float32_gflops']:.0f} GFLOP/s float32, "
            f"{'bfloat16 emulated (not measured)' if bf16 is None else f'{bf16:.0f} GFLOP/s bfloat16'}; "
            f"memory {lim['memory_read_gbs']:.1f} GB/s")
    if "peak_source" in lim:
        line += (f"; MFU and bandwidth against {lim['peak_bf16_gflops'] / 1e3:.0f} TFLOP/s bf16 and "
                 f"{lim['peak_memory_gbs']:.0f} GB/s ({lim['peak_source']})")
    return line
