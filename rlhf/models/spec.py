"""What rlhf needs to know about an HF decoder config, validated once: `ModelSpec.from_hf(config)`.

Supported: the Llama family (Llama 2/3, SmolLM, Mistral without sliding window), Qwen2/Qwen2.5 (qkv bias),
Qwen3 (per-head q/k RMSNorm), and the MoE decoders Qwen3-MoE and Mixtral (softmax top-k routers), with
causal-LM or sequence-classification heads. Anything else is a ConfigError naming the field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from rlhf.errors import ConfigError

CAUSAL_LM_ARCHS = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
                   "Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3_moe", "MixtralForCausalLM": "mixtral"}
SEQ_CLS_ARCHS = {"LlamaForSequenceClassification": "llama", "MistralForSequenceClassification": "mistral",
                 "Qwen2ForSequenceClassification": "qwen2", "Qwen3ForSequenceClassification": "qwen3",
                 "Qwen3MoeForSequenceClassification": "qwen3_moe", "MixtralForSequenceClassification": "mixtral"}
MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral")
QK_NORM_TYPES = ("qwen3", "qwen3_moe")


@dataclass(frozen=True, kw_only=True)
class MoeSpec:
    """The mixture-of-experts numbers: `moe_layers[i]` says whether layer i routes (else a dense MLP)."""

    num_experts: int
    top_k: int
    expert_ffn_hidden_size: int
    normalize_top_k: bool  # renormalise the top-k softmax probabilities to sum to 1
    moe_layers: tuple[bool, ...]
    hf_prefix: str  # HF module of the sparse block: "mlp" (Qwen3-MoE) or "block_sparse_moe" (Mixtral)
    hf_expert_names: tuple[str, str, str]  # HF names of an expert's gate, up and down projections


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """The architecture numbers of one decoder, in HF terms (vocab unpadded)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    ffn_hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    qkv_bias: bool
    tie_embeddings: bool
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    initializer_range: float
    qk_norm: bool = False
    moe: MoeSpec | None = None

    @classmethod
    def from_hf(cls, hf_config: Any) -> "ModelSpec":
        model_type = getattr(hf_config, "model_type", None)
        if model_type not in MODEL_TYPES:
            raise ConfigError(f"unsupported architecture model_type={model_type!r}; "
                              f"supported: {', '.join(MODEL_TYPES)} (Llama/Mistral/Qwen2 families)")
        for arch in getattr(hf_config, "architectures", None) or []:
            if arch not in CAUSAL_LM_ARCHS and arch not in SEQ_CLS_ARCHS:
                raise ConfigError(f"unsupported architecture {arch!r}; supported: "
                                  f"{', '.join(sorted(CAUSAL_LM_ARCHS) + sorted(SEQ_CLS_ARCHS))}")
        _check_features(hf_config, model_type)
        moe = _moe_spec(hf_config, model_type)
        num_heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        rope = _rope_parameters(hf_config)
        return cls(model_type=model_type, vocab_size=hf_config.vocab_size, hidden_size=hf_config.hidden_size,
                   ffn_hidden_size=hf_config.intermediate_size, num_layers=hf_config.num_hidden_layers,
                   num_heads=num_heads, num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
                   head_dim=head_dim, rms_norm_eps=hf_config.rms_norm_eps, qkv_bias=model_type == "qwen2",
                   tie_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
                   rope_theta=float(rope.get("rope_theta", 10000.0)),
                   rope_scaling=None if rope.get("rope_type", "default") == "default" else dict(rope),
                   max_position_embeddings=hf_config.max_position_embeddings,
                   initializer_range=getattr(hf_config, "initializer_range", 0.02),
                   qk_norm=model_type in QK_NORM_TYPES, moe=moe)

    def check_layout(self, tp: int, pp: int, ep: int = 1) -> None:
        """ConfigError (naming the numbers) unless this model can be split tp-ways, into pp stages, and its
        experts ep-ways."""
        if ep > 1 and self.moe is None:
            raise ConfigError(f"ep={ep} for a dense model ({self.model_type}): expert parallelism needs experts; "
                              "set ep=1")
        if self.moe and self.moe.num_experts % ep:
            raise ConfigError(f"ep={ep} does not divide num_experts={self.moe.num_experts}; "
                              f"choose ep among the divisors of {self.moe.num_experts}")
        if self.num_heads % tp:
            raise ConfigError(f"tp={tp} does not divide num_attention_heads={self.num_heads}; "
                              f"choose tp among the divisors of {self.num_heads}")
        if self.num_kv_heads % tp:
            raise ConfigError(f"tp={tp} does not divide num_key_value_heads={self.num_kv_heads}; "
                              f"choose tp among the divisors of {self.num_kv_heads}")
        if self.ffn_hidden_size % tp and not (self.moe and all(self.moe.moe_layers)):
            raise ConfigError(f"tp={tp} does not divide intermediate_size={self.ffn_hidden_size}")
        if self.moe and self.moe.expert_ffn_hidden_size % tp:
            raise ConfigError(f"tp={tp} does not divide the experts' intermediate size "
                              f"{self.moe.expert_ffn_hidden_size} (each expert is split over tp: expert-tensor-"
                              "parallel = tp); choose tp among its divisors")
        if self.num_layers % pp:
            raise ConfigError(f"pp={pp} does not divide num_hidden_layers={self.num_layers}; "
                              f"choose pp among the divisors of {self.num_layers}")

    def padded_vocab_size(self, tp: int) -> int:
        """Vocab rounded up to a multiple of tp (the extra rows are zeros and masked out of every softmax)."""
        return math.ceil(self.vocab_size / tp) * tp

    def inv_freq(self) -> torch.Tensor:
        """RoPE inverse frequencies in fp32, with Llama-3 scaling when the config asks for it."""
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.int64).to(torch.float32) / self.head_dim
        inv_freq = 1.0 / (self.rope_theta ** exponents)
        if self.rope_scaling is None:
            return inv_freq
        return _llama3_scaled(inv_freq, self.rope_scaling, self.max_position_embeddings)


def _moe_spec(hf_config: Any, model_type: str) -> MoeSpec | None:
    num_layers = hf_config.num_hidden_layers
    if model_type == "mixtral":
        return MoeSpec(num_experts=hf_config.num_local_experts, top_k=hf_config.num_experts_per_tok,
                       expert_ffn_hidden_size=hf_config.intermediate_size, normalize_top_k=True,
                       moe_layers=(True,) * num_layers, hf_prefix="block_sparse_moe",
                       hf_expert_names=("w1", "w3", "w2"))
    if model_type != "qwen3_moe" or not hf_config.num_experts:
        return None
    sparse = tuple(layer not in (hf_config.mlp_only_layers or []) and (layer + 1) % hf_config.decoder_sparse_step == 0
                   for layer in range(num_layers))
    if not any(sparse):
        return None
    return MoeSpec(num_experts=hf_config.num_experts, top_k=hf_config.num_experts_per_tok,
                   expert_ffn_hidden_size=hf_config.moe_intermediate_size,
                   normalize_top_k=bool(hf_config.norm_topk_prob), moe_layers=sparse, hf_prefix="mlp",
                   hf_expert_names=("gate_proj", "up_proj", "down_proj"))


def _check_features(hf_config: Any, model_type: str) -> None:
    act = getattr(hf_config, "hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"unsupported hidden_act={act!r}; only SwiGLU ('silu') models are supported")
    if model_type == "llama" and getattr(hf_config, "attention_bias", False):
        raise ConfigError("unsupported attention_bias=True for llama (bias on o_proj); only Qwen2-style qkv bias")
    if getattr(hf_config, "mlp_bias", False):
        raise ConfigError("unsupported mlp_bias=True; only bias-free MLPs are supported")
    if model_type in ("qwen3", "qwen3_moe", "mixtral") and getattr(hf_config, "attention_bias", False):
        raise ConfigError(f"unsupported attention_bias=True for {model_type}; only bias-free attention")
    if model_type in ("mistral", "mixtral") and getattr(hf_config, "sliding_window", None) is not None:
        raise ConfigError(f"unsupported sliding_window={hf_config.sliding_window} for {model_type}; "
                          "set it to null")
    if model_type.startswith("qwen") and getattr(hf_config, "use_sliding_window", False):
        raise ConfigError(f"unsupported use_sliding_window=True for {model_type}; only full attention is supported")
    if model_type == "mixtral" and getattr(hf_config, "router_jitter_noise", 0.0):
        raise ConfigError(f"unsupported router_jitter_noise={hf_config.router_jitter_noise} for mixtral; set it to 0")


def _rope_parameters(hf_config: Any) -> dict:
    rope = dict(getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {})
    if "rope_theta" not in rope and getattr(hf_config, "rope_theta", None) is not None:
        rope["rope_theta"] = hf_config.rope_theta
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise ConfigError(f"unsupported rope_type={rope_type!r}; supported: 'default', 'llama3'")
    rope["rope_type"] = rope_type
    return rope


def _llama3_scaled(inv_freq: torch.Tensor, scaling: dict, max_positions: int) -> torch.Tensor:
    """Llama-3.1 frequency scaling: long wavelengths divided by `factor`, a smooth ramp in between."""
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_context = scaling.get("original_max_position_embeddings", max_positions)
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_context / high) & (wavelen <= old_context / low)
    return torch.where(is_medium, smoothed, scaled)
