"""What a benchmark records about the machine, and its measured fp32 matmul peak (the physical limit)."""

from __future__ import annotations

import os
import platform

import torch

from rlhf.profiling.ops import matmul_peak_gflops  # noqa: F401 - defined once, re-exported for the benchmarks


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def cpu_bf16_flags() -> list[str]:
    """The CPU's native bf16 matmul instruction sets among /proc/cpuinfo's flags (AMX tiles, AVX-512-BF16)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return sorted(set(line.split(":", 1)[1].split()) & {"amx_bf16", "amx_tile", "avx512_bf16"})
    except OSError:
        pass
    return []


def machine_info() -> dict:
    import megatron.core
    import transformers

    return {"cores": os.cpu_count(), "threads": torch.get_num_threads(), "cpu": cpu_model(),
            "cpu_bf16": cpu_bf16_flags(), "torch": torch.__version__, "transformers": transformers.__version__,
            "megatron_core": megatron.core.__version__, "python": platform.python_version(),
            "load_avg_1m_at_start": os.getloadavg()[0]}

