"""A fresh, randomly initialised HF model folder (config, safetensors, tokenizer) to start a run from nothing."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from rlhf.errors import ConfigError


@dataclass(kw_only=True)
class InitModelConfig:
    """Llama- or Qwen2-style decoder sizes; the vocab comes from the tokenizer."""

    arch: Literal["llama", "qwen2"] = "llama"
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 4
    intermediate_size: int = 512
    max_position_embeddings: int = 256
    tie_embeddings: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        if self.arch not in ("llama", "qwen2"):
            raise ConfigError(f"model arch={self.arch!r} is not one of llama, qwen2")
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
    hf_config = LlamaConfig(**common) if config.arch == "llama" else Qwen2Config(**common)
    model_class = LlamaForCausalLM if config.arch == "llama" else Qwen2ForCausalLM
    torch.manual_seed(config.seed)
    model = model_class(hf_config).float()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
