"""The megatron-core GPTModel's parameters, read in place, as the native engine's forward needs them.

Parameters are held by reference, so `load_weights` (an in-place copy into the module) is seen by the
next step. Both the local spec (`input_layernorm`) and the Transformer-Engine spec (norm fused into
`linear_qkv.layer_norm_weight`) are understood, as are per-head q/k norms (Qwen3) and megatron's MoE layer
(router + sequential experts, all experts on this rank).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlhf.errors import ConfigError
from rlhf.models.lora import merged_linear_weight


@dataclass(frozen=True)
class DecoderGeometry:
    """Sizes of this TP rank's shard; `vocab_start` is where its embedding/output rows begin."""

    hidden_size: int
    num_heads: int  # query heads on this rank
    num_groups: int  # key/value heads on this rank
    head_dim: int
    eps: float
    vocab_size: int  # real (unpadded) vocabulary of the whole model
    vocab_start: int
    vocab_shard: int
    num_layers: int


@dataclass(frozen=True)
class MoeParams:
    """A routed MLP: softmax router [experts, hidden], each expert's fused gate/up and down weights."""

    router_weight: torch.Tensor
    fc1_weights: tuple[torch.Tensor, ...]
    fc2_weights: tuple[torch.Tensor, ...]
    top_k: int
    pre_softmax: bool  # softmax over all experts, then top-k (else: top-k logits, then softmax over those k)


@dataclass(frozen=True)
class LayerParams:
    input_norm: torch.Tensor
    qkv_weight: torch.Tensor
    qkv_bias: torch.Tensor | None
    proj_weight: torch.Tensor
    mlp_norm: torch.Tensor
    fc1_weight: torch.Tensor | None  # None in a routed layer (see `moe`)
    fc2_weight: torch.Tensor | None
    q_norm: torch.Tensor | None = None  # per-head RMSNorm weights [head_dim] (Qwen3)
    k_norm: torch.Tensor | None = None
    moe: MoeParams | None = None


@dataclass(frozen=True)
class DecoderParams:
    embedding: torch.Tensor  # [vocab_shard, hidden]
    layers: tuple[LayerParams, ...]
    final_norm: torch.Tensor
    output: torch.Tensor  # [vocab_shard, hidden]; the embedding itself when tied
    inv_freq: torch.Tensor  # RoPE inverse frequencies [head_dim / 2]


def _norm_weight(norm: torch.nn.Module, fused_linear: torch.nn.Module, what: str) -> torch.Tensor:
    weight = getattr(norm, "weight", None)
    if weight is None:
        weight = getattr(fused_linear, "layer_norm_weight", None)
    if weight is None:
        raise ConfigError(f"native rollout engine: found no {what} RMSNorm weight (neither local nor TE spec)")
    return weight


def _moe_params(mlp: torch.nn.Module) -> MoeParams:
    config = mlp.config
    if config.expert_model_parallel_size > 1 or config.moe_router_score_function != "softmax":
        raise ConfigError("the native rollout engine runs MoE models with every expert on the rank (ep=1) and a "
                          f"softmax router (got ep={config.expert_model_parallel_size}, "
                          f"score function {config.moe_router_score_function!r})")
    experts = mlp.experts.local_experts
    return MoeParams(router_weight=mlp.router.weight, fc1_weights=tuple(e.linear_fc1.weight for e in experts),
                     fc2_weights=tuple(e.linear_fc2.weight for e in experts), top_k=config.moe_router_topk,
                     pre_softmax=config.moe_router_pre_softmax)


def _qk_norm(attn: torch.nn.Module, name: str) -> torch.Tensor | None:
    return getattr(getattr(attn, name, None), "weight", None)


def _layer_params(layer: torch.nn.Module) -> LayerParams:
    attn, mlp = layer.self_attention, layer.mlp
    routed = hasattr(mlp, "router")
    dense_fc1 = None if routed else mlp.linear_fc1
    return LayerParams(input_norm=_norm_weight(layer.input_layernorm, attn.linear_qkv, "input"),
                       qkv_weight=merged_linear_weight(attn.linear_qkv),
                       qkv_bias=getattr(attn.linear_qkv, "bias", None),
                       proj_weight=merged_linear_weight(attn.linear_proj),
                       mlp_norm=_norm_weight(layer.pre_mlp_layernorm, dense_fc1, "pre-MLP"),
                       fc1_weight=None if routed else merged_linear_weight(mlp.linear_fc1),
                       fc2_weight=None if routed else merged_linear_weight(mlp.linear_fc2),
                       q_norm=_qk_norm(attn, "q_layernorm"), k_norm=_qk_norm(attn, "k_layernorm"),
                       moe=_moe_params(mlp) if routed else None)


def decoder_params(model: torch.nn.Module) -> DecoderParams:
    """References to the parameters of a megatron GPTModel (pp=1) in the order the forward uses them; a LoRA
    model's adapted linears as merged copies, W + (alpha / r) B A (`rlhf.models.lora`)."""
    if not (model.pre_process and model.post_process):
        raise ConfigError("the native rollout engine runs at pp=1: the model must hold every layer")
    config = model.config
    if config.normalization != "RMSNorm" or not config.gated_linear_unit or config.add_bias_linear:
        raise ConfigError("the native rollout engine supports RMSNorm + SwiGLU models without linear biases "
                          f"(got normalization={config.normalization}, gated_linear_unit="
                          f"{config.gated_linear_unit}, add_bias_linear={config.add_bias_linear})")
    if model.position_embedding_type != "rope" or config.rotary_interleaved:
        raise ConfigError("the native rollout engine supports non-interleaved RoPE only")
    output = (model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights
              else model.output_layer.weight)
    return DecoderParams(embedding=model.embedding.word_embeddings.weight,
                         layers=tuple(_layer_params(layer) for layer in model.decoder.layers),
                         final_norm=model.decoder.final_layernorm.weight, output=output,
                         inv_freq=model.rotary_pos_emb.inv_freq)


def decoder_geometry(model: torch.nn.Module, vocab_size: int, tp_size: int, tp_rank: int) -> DecoderGeometry:
    config = model.config
    if config.num_attention_heads % tp_size or config.num_query_groups % tp_size:
        raise ConfigError(f"rollout tp={tp_size} must divide num_attention_heads={config.num_attention_heads} "
                          f"and num_query_groups={config.num_query_groups}")
    vocab_shard = model.embedding.word_embeddings.weight.shape[0]
    if vocab_shard * tp_size < vocab_size:
        raise ConfigError(f"model vocabulary {vocab_shard}x{tp_size} is smaller than vocab_size={vocab_size}")
    return DecoderGeometry(hidden_size=config.hidden_size, num_heads=config.num_attention_heads // tp_size,
                           num_groups=config.num_query_groups // tp_size, head_dim=config.kv_channels,
                           eps=config.layernorm_epsilon, vocab_size=vocab_size, vocab_start=tp_rank * vocab_shard,
                           vocab_shard=vocab_shard, num_layers=len(model.decoder.layers))
