"""GPUs by name: the capacity CUDA reports and the few device facts vLLM and its kernels read.

``total_bytes`` is what ``torch.cuda.mem_get_info()`` returns as *total* (the figure vLLM multiplies by
``gpu_memory_utilization`` and PyTorch's OOM message prints as "total capacity"), not the marketing
size: the driver keeps part of the board. It varies a little with the driver and ECC setting (an
H100 80GB is reported as 79.11-79.22 GiB across the logs below); each row cites one report.
``num_sms`` feeds FlashAttention's split heuristics; ``sm`` picks FlashAttention-3 on Hopper and the
cuBLAS workspace size (``CublasHandlePool.cpp``: 32 MiB on sm90, 8 MiB + 128 KiB elsewhere, plus
1 MiB for cuBLASLt). ``is_a100`` matters because vLLM's batch defaults check the device name for
"a100" (``engine/arg_utils.py``: A100s keep the small defaults despite 80 GB).
"""

from __future__ import annotations

from dataclasses import dataclass

GiB = 1 << 30
CUBLAS_SM90 = 32 * (1 << 20) + (1 << 20)
CUBLAS_OTHER = 4096 * 1024 * 2 + 16 * 1024 * 8 + (1 << 20)


@dataclass(frozen=True, slots=True)
class Gpu:
    name: str
    total_gib: float
    num_sms: int
    sm: int  # compute capability major*10 + minor
    source: str
    is_a100: bool = False
    bandwidth_bytes_per_s: float = 3.35e12  # HBM bandwidth (vendor datasheets): the step-time model only
    dense_bf16_flops: float = 989e12  # dense bf16 tensor FLOP/s (vendor datasheets): the step-time model only

    @property
    def total_bytes(self) -> int:
        return int(round(self.total_gib * GiB))

    @property
    def cublas_workspace_bytes(self) -> int:
        return CUBLAS_SM90 if self.sm == 90 else CUBLAS_OTHER

    @property
    def flash_attention_version(self) -> int:
        """vLLM's FlashAttention backend uses FA3 on Hopper, FA2 on Ampere/Ada (``fa_utils.py``)."""
        return 3 if self.sm == 90 else 2


GPUS: dict[str, Gpu] = {g.name: g for g in (
    Gpu("h100-80gb", 79.18, 132, 90, "llm-d/llm-d-benchmark config_explorer/empirical-vllm-memory-results.md: "
        "'Free memory on device: 78.57/79.18 GiB on startup' (H100, vLLM 0.11)", False, 3.35e12, 989e12),
    Gpu("h200", 139.80, 132, 90, "'GPU 5 has a total capacity of 139.80 GiB' on 8xH200 (a public training log found "
        "through the code index; the same figure recurs in other H200 OOM messages there)", False, 4.8e12, 989e12),
    Gpu("b200", 178.36, 148, 100, "vllm PR#21489 log: 'Free memory on device (177.66/178.36 GiB) on startup'",
        False, 8.0e12, 2250e12),
    Gpu("a100-40gb", 39.56, 108, 80, "vllm#8731: 'GPU 0 has a total capacity of 39.56 GiB' (A100-40GB)", True,
        1.555e12, 312e12),
    Gpu("l40s", 44.53, 142, 89, "vllm#15598: 'total_gpu_memory (44.53GiB)' on L40S", False, 0.864e12, 362e12),
    Gpu("rtx4090", 23.52, 128, 89, "pytorch/torchchat#1341: 'GPU 0 has a total capacity of 23.52 GiB' "
        "(GPU 0: RTX 4090)", False, 1.008e12, 165e12),
    Gpu("rtx3090", 23.56, 82, 86, "noonghunna/club-3090#58: 'total capacity of 23.56 GiB'; wtdcode/vllm-backport#34: "
        "'Free memory on device (22.93/23.56 GiB)' (RTX 3090)", False, 0.936e12, 71e12),
    Gpu("rtx5090", 31.40, 170, 120, "vllm#52871: 'GPU 0 has a total capacity of 31.40 GiB' (RTX 5090)", False,
        1.79e12, 209e12),
)}


def gpu_by_name(name: str) -> Gpu:
    key = name.strip().lower()
    if key not in GPUS:
        raise ValueError(f"unknown GPU {name!r}: one of {', '.join(GPUS)}, or give --gpu-memory-gib")
    return GPUS[key]


def custom_gpu(total_gib: float) -> Gpu:
    """A GPU known only by its capacity (``--gpu-memory-gib``): an H100's SMs, FlashAttention-3 and cuBLAS
    workspace, bandwidth and FLOP/s (vLLM's own defaults branch on memory size alone for such a GPU)."""
    if not 0 < total_gib <= 4096:
        raise ValueError(f"--gpu-memory-gib: expected a capacity in (0, 4096] GiB, got {total_gib}")
    return Gpu(f"{total_gib:g}GiB", float(total_gib), 132, 90, "given with --gpu-memory-gib")
