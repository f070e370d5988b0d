"""What a benchmark records about the machine, and its measured fp32 matmul peak (the physical limit)."""

from __future__ import annotations

import os
import platform
import statistics
import time

import torch


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_info() -> dict:
    import megatron.core
    import transformers

    return {"cores": os.cpu_count(), "threads": torch.get_num_threads(), "cpu": cpu_model(),
            "torch": torch.__version__, "transformers": transformers.__version__,
            "megatron_core": megatron.core.__version__, "python": platform.python_version(),
            "load_avg_1m_at_start": os.getloadavg()[0]}


def matmul_peak_gflops(size: int = 2048, repeats: int = 5, dtype: torch.dtype = torch.float32) -> float:
    """Median GFLOP/s of a size^3 matmul in `dtype` (fp32 default): the best this CPU does on the model's
    dominant op."""
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    a @ b
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - start)
    return 2 * size**3 / statistics.median(times) / 1e9
