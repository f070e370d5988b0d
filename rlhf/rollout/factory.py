"""Build the configured rollout engine for this rank from an HF folder, in the rollout layout's groups."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from rlhf.errors import ConfigError
from rlhf.rollout.config import RolloutConfig
from rlhf.rollout.engine import EngineLayout, RolloutEngine


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
                 dtype: torch.dtype = torch.float32, lora: Any = None, adapter_dtype: torch.dtype | None = None,
                 adapter_folder: str = "", adapter_slots: int = 1) -> RolloutEngine:
    """The engine for this rank; the native one builds the megatron model on `pg_collection` (pp must be 1).
    `dtype`: the engine's weights (the trainer passes `model.dtype`; vllm: unless rollout.vllm.dtype is set);
    `lora` (a `LoraConfig`, fed by `lora.sync=adapter`): native: the model gets adapters of its own in
    `adapter_dtype`; vllm: vLLM's LoRA support, `adapter_slots` versions loaded, their folders under
    `adapter_folder` (`rlhf.rollout.vllm_lora`)."""
    layout = engine_layout(pg_collection)
    eos = eos_token_ids(hf_path)
    if config.engine == "vllm":
        from rlhf.rollout.vllm_engine import VllmEngine
        from rlhf.rollout.vllm_lora import VllmLoraSpec

        world = pg_collection.layout_all  # vLLM's world: the rollout mesh, when it is not every rank
        spec = None if lora is None else VllmLoraSpec(lora=lora, base_path=hf_path, folder=adapter_folder,
                                                      slots=adapter_slots)
        return VllmEngine(hf_path, config=config.vllm, layout=layout, eos_token_ids=eos, dtype=dtype,
                          world=world if dist.get_world_size(world) < dist.get_world_size() else None, lora=spec)
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
    if lora is not None:
        from rlhf.models.lora import apply_lora

        apply_lora(model, lora, dtype=adapter_dtype)
    return NativeEngine(model, vocab_size=hf_config.vocab_size, config=config.native, eos_token_ids=eos,
                        layout=layout, tp_group=pg_collection.tp)


def close_engine(engine: RolloutEngine | None) -> None:
    """Release an engine that holds its own runtime (vLLM) before the process groups go; others hold none."""
    close = getattr(engine, "close", None)
    if close is not None:
        close()
