"""Device choice, distributed backend, memory stats and sync: the torch side of the `rlhf.platform` door."""

from __future__ import annotations

import contextlib
import os

import torch

from rlhf.errors import ConfigError
from rlhf.platform import BACKENDS


def has_accelerator() -> bool:
    return torch.cuda.is_available()


def resolve_backend(backend: str = "auto") -> str:
    """`auto` is nccl when CUDA is present, gloo otherwise; an explicit choice is checked."""
    if backend not in BACKENDS:
        raise ConfigError(f"dist.backend={backend!r} is not one of {', '.join(BACKENDS)}")
    if backend == "auto":
        return "nccl" if has_accelerator() else "gloo"
    if backend == "nccl" and not has_accelerator():
        raise ConfigError("dist.backend='nccl' needs CUDA devices, none are visible; use dist.backend=gloo")
    return backend


def device_for_local_rank(local_rank: int) -> torch.device:
    """The device this process computes on; binds the CUDA device when there is one."""
    if has_accelerator():
        index = local_rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def host_supports_bf16() -> bool:
    """The CPU has native bf16 matmul instructions (AVX-512-BF16 or AMX-BF16), read from /proc/cpuinfo."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool(flags & {"avx512_bf16", "amx_bf16"})
    except OSError:
        pass
    return False


def autocast(dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    """torch autocast to `dtype` on the current device's type (None: no autocast, the weights' dtype)."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=current_device().type, dtype=dtype)


def autocast_weight_cache(dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    """While open, torch autocast keeps its bf16 copies of the weights across the autocast regions opened inside
    (each micro-batch's forward, each linear's backward): a weight is cast once per scope instead of once per
    region. torch drops the cache when the outermost autocast context exits; this is that context, with autocast
    itself left off. Close it before the weights change (the optimizer step): the cache does not see updates."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=current_device().type, enabled=False)


def current_device() -> torch.device:
    if has_accelerator():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def device_name() -> str:
    if has_accelerator():
        return f"cuda:{torch.cuda.current_device()} ({torch.cuda.get_device_name()})"
    return "cpu"


def synchronize() -> None:
    if has_accelerator():
        torch.cuda.synchronize()


def manual_seed_all(seed: int) -> None:
    torch.manual_seed(seed)
    if has_accelerator():
        torch.cuda.manual_seed_all(seed)


def rng_state() -> dict:
    """Every RNG state a rank owns (for exact resume)."""
    state = {"cpu": torch.get_rng_state()}
    if has_accelerator():
        state["accel"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["cpu"])
    if has_accelerator() and "accel" in state:
        torch.cuda.set_rng_state_all(state["accel"])


def peak_memory_bytes() -> int:
    """Peak accelerator memory since the last reset, or this process's peak RSS on CPU."""
    if has_accelerator():
        return int(torch.cuda.max_memory_allocated())
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


# Open `PeakWindow`s: a reset folds the peak so far into each of them first.
_OPEN_WINDOWS: list[PeakWindow] = []


def reset_peak_memory() -> None:
    """Restart the allocator's peak; every open `PeakWindow` keeps the peak it had seen up to here."""
    if _OPEN_WINDOWS:
        now = peak_since_reset_bytes()
        for window in _OPEN_WINDOWS:
            window.peak = max(window.peak, now)
    if has_accelerator():
        torch.cuda.reset_peak_memory_stats()


class PeakWindow:
    """Peak memory between construction and `close()`, exact however windows nest or overlap (the profiler's
    phases and the trainer's memory phases both reset the one allocator peak). On CPU, where no peak can be
    reset: the largest resident set size seen at open, at each reset, and at close."""

    def __init__(self) -> None:
        reset_peak_memory()
        self.peak = peak_since_reset_bytes()
        _OPEN_WINDOWS.append(self)

    def close(self) -> int:
        self.peak = max(self.peak, peak_since_reset_bytes())
        _OPEN_WINDOWS.remove(self)
        return self.peak


_STATM: dict[str, int] = {}  # {"pid", "fd"}: this process's /proc/self/statm, kept open (re-opened after a fork)


def _resident_bytes() -> int:
    """This process's resident set size: one pread of /proc/self/statm on Linux (the step reads it ~10 times;
    psutil opened and parsed the file each time: 23 us a call, 2.5 us so), else psutil."""
    if _STATM.get("pid") != os.getpid():
        try:
            _STATM.update(pid=os.getpid(), fd=os.open("/proc/self/statm", os.O_RDONLY))
        except OSError:
            _STATM.update(pid=os.getpid(), fd=-1)
    if _STATM["fd"] >= 0:
        return int(os.pread(_STATM["fd"], 128, 0).split()[1]) * os.sysconf("SC_PAGE_SIZE")
    import psutil

    return int(psutil.Process().memory_info().rss)


def allocated_memory_bytes() -> int:
    """Memory held now: the accelerator allocator's live bytes, or this process's resident set size on CPU."""
    if has_accelerator():
        return int(torch.cuda.memory_allocated())
    return _resident_bytes()


def peak_since_reset_bytes() -> int:
    """Peak accelerator memory since `reset_peak_memory`; on CPU, where no peak can be reset, the current RSS."""
    return peak_memory_bytes() if has_accelerator() else allocated_memory_bytes()


def fused_decode_attention(dtype: torch.dtype, device: torch.device):
    """The fused decode-attention kernel for this device (`rlhf.kernels`), or None to use torch ops: today a
    C kernel for fp32 and bf16 on CPU, built on first use when a C compiler is present."""
    if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return None
    from rlhf.kernels.cpu_decode_attention import load

    return load()


def fused_decode_step(dtype: torch.dtype, device: torch.device):
    """The one-call decode step of a dense model for this device (`rlhf.kernels.cpu_decode_stack`), or None to run
    it op by op: fp32 on CPU at one torch thread (its GEMMs are rlhf's single-threaded decode GEMM; with more threads
    the per-op path keeps oneDNN's threaded ones), built with the other CPU kernels."""
    if device.type != "cpu" or dtype != torch.float32 or torch.get_num_threads() != 1:
        return None
    from rlhf.kernels.cpu_decode_stack import load

    return load()


ACCELERATOR_HEAD_BYTES = (8 << 30, 1 << 30)  # fused LM head (chunk, block) on accelerators (`rlhf plan` reads it)


def fused_head_bytes() -> tuple[int, int]:
    """(chunk, block) fp32-logit bytes for the fused LM head (`rlhf.models.lm_head`): at most a chunk of logits
    is alive at once (one chunk is kept for the backward, more are recomputed there); elementwise passes run
    over blocks, cache-sized on a CPU. On an H200, 1 GiB chunks (recompute at 8k tokens x 152k vocab) ran
    0.74x the full-logits path's speed, so accelerators get chunks that usually hold a whole micro-batch."""
    if has_accelerator():
        return ACCELERATOR_HEAD_BYTES
    return 1 << 30, 4 << 20


def offload_device() -> torch.device:
    """Where offloaded params and optimizer state wait between phases: host memory."""
    return torch.device("cpu")


def release_cached_memory() -> None:
    """Return freed accelerator memory to the driver (after an offload); nothing to do on CPU."""
    if has_accelerator():
        torch.cuda.empty_cache()


def set_async_error_handling_env() -> None:
    """Make NCCL surface errors/timeouts as exceptions instead of hanging (read at process-group init)."""
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    os.environ.setdefault("NCCL_ASYNC_ERROR_HANDLING", "1")


def prepare_backend_env(backend: str) -> None:
    """Before init: the NCCL error-handling switches, and torch's compiler imported while no group exists (else a
    finished run can abort at exit: `compat.torch.preload_compiler`)."""
    from rlhf.platform.compat import torch as torch_compat

    torch_compat.preload_compiler()
    if backend == "nccl":
        set_async_error_handling_env()
