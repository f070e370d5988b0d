"""Tiny randomly initialised HF causal LMs (Llama, Qwen2, Qwen3 and the MoE Qwen3-MoE / Mixtral) for tests and
benchmarks; no downloads."""

from __future__ import annotations

import torch
from transformers import (AutoModelForCausalLM, LlamaConfig, MixtralConfig, PretrainedConfig, Qwen2Config, Qwen3Config,
                          Qwen3MoeConfig)

FAMILIES = ("llama", "qwen2", "qwen3")  # dense: every tp
MOE_FAMILIES = ("qwen3_moe", "mixtral")  # routed


def tiny_hf_config(family: str, *, vocab_size: int = 101, hidden_size: int = 64, num_layers: int = 2,
                   num_heads: int = 4, num_kv_heads: int = 2, intermediate_size: int = 128,
                   tie_word_embeddings: bool | None = None) -> PretrainedConfig:
    """Llama: untied, no qkv bias, Llama-3 RoPE scaling; Qwen2: tied embeddings and qkv bias."""
    common = dict(vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_layers,
                  num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                  intermediate_size=intermediate_size, max_position_embeddings=512, rms_norm_eps=1e-6,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if family == "llama":
        rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
        return LlamaConfig(**common, tie_word_embeddings=bool(tie_word_embeddings), rope_parameters=rope)
    if family == "qwen2":
        tie = True if tie_word_embeddings is None else tie_word_embeddings
        return Qwen2Config(**common, tie_word_embeddings=tie,
                           rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    if family == "qwen3":  # q/k norms, head_dim 24 != hidden / heads
        tie = True if tie_word_embeddings is None else tie_word_embeddings
        return Qwen3Config(**common, head_dim=24, tie_word_embeddings=tie)
    moe = dict(common, tie_word_embeddings=bool(tie_word_embeddings), num_experts_per_tok=2)
    if family == "qwen3_moe":  # 4 experts of width intermediate/2, layer 1 dense
        return Qwen3MoeConfig(**moe, num_experts=4, moe_intermediate_size=intermediate_size // 2,
                              norm_topk_prob=True, mlp_only_layers=[1], head_dim=hidden_size // num_heads)
    if family == "mixtral":
        moe["intermediate_size"] = intermediate_size // 2
        return MixtralConfig(**moe, num_local_experts=4, sliding_window=None)
    raise ValueError(f"unknown tiny model family {family!r}; choose from {FAMILIES + MOE_FAMILIES}")


def tiny_hf_model(family: str, seed: int = 0, **config_overrides) -> torch.nn.Module:
    """A fp32 eval-mode model with weights scaled up so greedy outputs depend on the input."""
    torch.manual_seed(seed)
    config = tiny_hf_config(family, **config_overrides)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2:  # 3-D: transformers' fused experts
                param.normal_(0.0, 0.2 if "embed" in name else 0.5 if name.endswith("gate.weight") else 0.08)
            elif "bias" in name:
                param.normal_(0.0, 0.05)
            else:
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
    return model.eval()
