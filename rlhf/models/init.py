"""A fresh, randomly initialised HF model folder (config, safetensors, tokenizer) to start a run from nothing."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from transformers import (AutoModelForCausalLM, LlamaConfig, MixtralConfig, PretrainedConfig, Qwen2Config,
                          Qwen3Config, Qwen3MoeConfig)

from rlhf.errors import ConfigError

ARCHS = ("llama", "qwen2", "qwen3", "qwen3_moe", "mixtral")


@dataclass(kw_only=True)
class InitModelConfig:
    """Llama-, Qwen2-, Qwen3-, Qwen3-MoE- or Mixtral-style decoder sizes; the vocab comes from the tokenizer.

    MoE models route every layer to `num_experts_per_token` of `num_experts` experts of width
    `expert_intermediate_size` (Mixtral: `intermediate_size` is the experts' width).
    """

    arch: Literal["llama", "qwen2", "qwen3", "qwen3_moe", "mixtral"] = "llama"
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 4
    intermediate_size: int = 512
    max_position_embeddings: int = 256
    tie_embeddings: bool = False
    num_experts: int = 8
    num_experts_per_token: int = 2
    expert_intermediate_size: int = 128
    seed: int = 0

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise ConfigError(f"model arch={self.arch!r} is not one of {', '.join(ARCHS)}")
        if not 1 <= self.num_experts_per_token <= self.num_experts:
            raise ConfigError(f"num_experts_per_token={self.num_experts_per_token} must be between 1 and "
                              f"num_experts={self.num_experts}")
        if self.hidden_size % self.num_heads:
            raise ConfigError(f"hidden_size={self.hidden_size} is not divisible by num_heads={self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_heads={self.num_heads} is not divisible by num_kv_heads={self.num_kv_heads}")


def init_hf_model(config: InitModelConfig, tokenizer: Any, out_dir: str | Path) -> Path:
    """Write a seeded random model plus `tokenizer` to `out_dir` (loadable by transformers and rlhf)."""
    common = dict(vocab_size=len(tokenizer), hidden_size=config.hidden_size,
                  intermediate_size=config.intermediate_size, num_hidden_layers=config.num_layers,
                  num_attention_heads=config.num_heads, num_key_value_heads=config.num_kv_heads,
                  max_position_embeddings=config.max_position_embeddings, tie_word_embeddings=config.tie_embeddings,
                  bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                  pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(config.seed)
    model = AutoModelForCausalLM.from_config(_hf_config(config, common)).float()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def _hf_config(config: InitModelConfig, common: dict) -> PretrainedConfig:
    routing = dict(num_experts_per_tok=config.num_experts_per_token)
    if config.arch == "qwen3_moe":
        return Qwen3MoeConfig(**common, **routing, num_experts=config.num_experts, norm_topk_prob=True,
                              moe_intermediate_size=config.expert_intermediate_size,
                              head_dim=config.hidden_size // config.num_heads)
    if config.arch == "mixtral":
        return MixtralConfig(**common, **routing, num_local_experts=config.num_experts)
    if config.arch == "qwen3":
        return Qwen3Config(**common, head_dim=config.hidden_size // config.num_heads)
    return {"llama": LlamaConfig, "qwen2": Qwen2Config}[config.arch](**common)
