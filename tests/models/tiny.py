"""Tiny seeded HF models built locally (no downloads) and the inputs the model tests share."""

from __future__ import annotations

import json
import os

import torch
from transformers import (AutoModelForCausalLM, LlamaConfig, MistralConfig, MixtralConfig, Qwen2Config, Qwen3Config,
                          Qwen3MoeConfig)

VOCAB = 101  # not divisible by 2 or 4: exercises vocab padding


def llama_config(**overrides) -> LlamaConfig:
    """Llama-style: GQA (4 heads, 2 kv heads), untied embeddings, Llama-3 rope scaling."""
    values = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  tie_word_embeddings=False, rms_norm_eps=1e-5,
                  rope_parameters={"rope_type": "llama3", "rope_theta": 50000.0, "factor": 4.0,
                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 16})
    values.update(overrides)
    return LlamaConfig(**values)


def qwen2_config(**overrides) -> Qwen2Config:
    """Qwen2-style: qkv bias, tied embeddings, 4 heads / 4 kv heads."""
    values = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                  tie_word_embeddings=True, rms_norm_eps=1e-6, rope_parameters={"rope_type": "default",
                                                                                 "rope_theta": 10000.0})
    values.update(overrides)
    return Qwen2Config(**values)


def mistral_config(**overrides) -> MistralConfig:
    """Mistral without sliding window: 8 heads / 2 kv heads, head_dim 16 != hidden / heads."""
    values = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=8, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                  sliding_window=None, tie_word_embeddings=False)
    values.update(overrides)
    return MistralConfig(**values)


def qwen3_config(**overrides) -> Qwen3Config:
    """Qwen3-style: per-head q/k RMSNorm, no qkv bias, head_dim 24 != hidden / heads, tied embeddings."""
    values = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=24, max_position_embeddings=64,
                  tie_word_embeddings=True, rms_norm_eps=1e-6)
    values.update(overrides)
    return Qwen3Config(**values)


def qwen3_moe_config(**overrides) -> Qwen3MoeConfig:
    """Qwen3-MoE-style: 4 experts, top-2 renormalised, expert width 48 != dense width 96, layer 1 dense."""
    values = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=48, num_experts=4,
                  num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1], decoder_sparse_step=1,
                  num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  max_position_embeddings=64, tie_word_embeddings=False, rms_norm_eps=1e-6)
    values.update(overrides)
    return Qwen3MoeConfig(**values)


def mixtral_config(**overrides) -> MixtralConfig:
    """Mixtral-style: every layer routed, 4 experts of width 48, top-2."""
    values = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=48, num_local_experts=4,
                  num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=64, sliding_window=None, tie_word_embeddings=False)
    values.update(overrides)
    return MixtralConfig(**values)


def save_hf_model(config, path: str, seed: int = 0, dtype=torch.float32):
    """Build a random HF model (biases and norms randomised too, so every tensor matters) and save it."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(dtype)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.normal_(1.0 if "norm" in name else 0.0, 0.1)
            elif name.endswith("gate.weight"):  # routers: decisive top-k choices (no near-ties)
                param.normal_(0.0, 0.5)
    model.save_pretrained(path)
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"model_max_length": 64}, f)  # stands in for the tokenizer files export must copy
    return model


def sample_tokens(batch: int, seq: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def hf_rl_loss_backward(logits, tokens):
    """`world.rl_loss` on HF logits (-mean logprob - 0.1 mean entropy), backpropagated; (logprobs, entropy)."""
    logprobs = torch.log_softmax(logits, -1)
    token_lp = logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    entropy = -(logprobs.exp() * logprobs).sum(-1)
    (-token_lp.mean() - 0.1 * entropy.mean()).backward()
    return token_lp.detach(), entropy.detach()
