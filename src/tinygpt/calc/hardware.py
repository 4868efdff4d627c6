"""Datasheet limits of the GPUs a report may name: what MFU and bandwidth use are measured against.

MFU as PaLM defines it divides the FLOP/s a run's matrix products do by the chip's peak for their dtype:
for training in bfloat16 that is the dense (not 2:4 sparse) bfloat16 tensor-core rate. The figures are
NVIDIA's datasheets' for each part; a GPU not listed is measured instead (tinygpt.lab.bench).
"""

from __future__ import annotations

# (a part of torch's device name, dense bf16 TFLOP/s, memory GB/s); the first that the name contains wins,
# so each specific part comes before the name it extends ("H200 NVL" before "H200")
GPU_PEAKS = (
    ("H200 NVL", 835, 4800), ("H200", 989, 4800),
    ("H100 NVL", 835, 3900), ("H100 PCIe", 756, 2000), ("H100", 989, 3350),
    ("A100-SXM4-80GB", 312, 2039), ("A100 80GB PCIe", 312, 1935), ("A100", 312, 1555),
    ("L40S", 362, 864), ("L4", 121, 300),
)


def gpu_peaks(name: str) -> tuple[float, float] | None:
    """(dense bf16 TFLOP/s, memory GB/s) from the datasheet of the GPU torch names `name`
    (torch.cuda.get_device_name: "NVIDIA H200", "NVIDIA H100 80GB HBM3"), or None for one not listed."""
    return next(((flops, gbs) for part, flops, gbs in GPU_PEAKS if part in name), None)
