"""Build a megatron-core `GPTModel` (or its value-head variant) from an HF config on explicit process groups.

The layer spec is chosen here and only here: Transformer-Engine when it is importable and a GPU is present,
megatron's local spec otherwise (its attention core rlhf's `FusedDotProductAttention`: fused, packed-aware; its
torch RMSNorms rlhf's `FusedRMSNorm` and, in dense models, its MLP activation rlhf's `FusedSwiGLU`: one C pass
forward and backward each on CPU).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

from rlhf.models.lm_head import GPTModelWithHiddenOutput
from rlhf.models.moe_tp import tensor_parallel_moe_spec
from rlhf.models.spec import ModelSpec
from rlhf.models.value_head import ValueHead
from rlhf.platform import current_device, has_accelerator
from rlhf.platform.compat import megatron as megatron_compat
from rlhf.platform.fused_attention import FusedDotProductAttention
from rlhf.platform.rms_norm import use_fused_rms_norms
from rlhf.platform.swiglu import FusedSwiGLU


def moe_config(spec: ModelSpec, *, ep: int = 1, aux_loss_coeff: float = 0.0, z_loss_coeff: float = 0.0,
               token_dispatcher: str = "allgather") -> dict:
    """TransformerConfig fields of `spec`'s experts (none for a dense model): softmax top-k routing in fp32,
    renormalised top-k as a softmax over the k chosen logits (megatron's non-pre-softmax router), no grouped GEMM."""
    moe = spec.moe
    if moe is None:
        return {}
    return dict(num_moe_experts=moe.num_experts, moe_ffn_hidden_size=moe.expert_ffn_hidden_size,
                moe_router_topk=moe.top_k, moe_layer_freq=[int(routed) for routed in moe.moe_layers],
                moe_router_pre_softmax=not moe.normalize_top_k, moe_router_score_function="softmax",
                moe_router_dtype="fp32", moe_token_dispatcher_type=token_dispatcher, moe_grouped_gemm=False,
                moe_router_load_balancing_type="aux_loss" if aux_loss_coeff else "none",
                moe_aux_loss_coeff=aux_loss_coeff, moe_z_loss_coeff=z_loss_coeff or None,
                expert_model_parallel_size=ep, expert_tensor_parallel_size=None, moe_permute_fusion=False)


def transformer_config(spec: ModelSpec, *, tp: int, pp: int, params_dtype: torch.dtype = torch.float32,
                       recompute: bool = False, moe_kwargs: dict | None = None) -> TransformerConfig:
    """The megatron TransformerConfig for `spec` split tp-ways over pp stages (dropout off, fusions off)."""
    spec.check_layout(tp, pp, (moe_kwargs or {}).get("expert_model_parallel_size", 1))
    recompute_kwargs = dict(recompute_granularity="full", recompute_method="uniform",
                            recompute_num_layers=1) if recompute else {}
    return TransformerConfig(
        num_layers=spec.num_layers, hidden_size=spec.hidden_size, ffn_hidden_size=spec.ffn_hidden_size,
        num_attention_heads=spec.num_heads, num_query_groups=spec.num_kv_heads, kv_channels=spec.head_dim,
        normalization="RMSNorm", layernorm_epsilon=spec.rms_norm_eps, gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, add_qkv_bias=spec.qkv_bias,
        hidden_dropout=0.0, attention_dropout=0.0, init_method_std=spec.initializer_range,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, sequence_parallel=False,
        params_dtype=params_dtype, pipeline_dtype=params_dtype, bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16, use_cpu_initialization=not has_accelerator(),
        gradient_accumulation_fusion=False, bias_activation_fusion=False, masked_softmax_fusion=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, persist_layer_norm=False, qk_layernorm=spec.qk_norm,
        **recompute_kwargs, **(moe_kwargs or {}))


def _use_transformer_engine() -> bool:
    if not has_accelerator():
        return False
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def layer_spec(config: TransformerConfig, pp_rank: int, pg_collection: ProcessGroupCollection,
               transformer_engine: bool = True) -> ModuleSpec | TransformerBlockSubmodules:
    """Transformer-Engine layers on GPU when TE is installed (and `transformer_engine`), megatron's local layers
    otherwise; MoE models get megatron's per-layer block spec (routed and dense layers) for this pipeline stage,
    its MoE layers sequence-parallel islands at tp > 1 (`rlhf.models.moe_tp`)."""
    use_te = transformer_engine and _use_transformer_engine()
    if config.num_moe_experts:
        block = get_gpt_decoder_block_spec(config, use_transformer_engine=use_te, normalization="RMSNorm",
                                           pp_rank=pp_rank)
        if not use_te:
            for layer in block.layer_specs:
                _with_packed_attention(layer)
        return tensor_parallel_moe_spec(block, pg_collection) if config.tensor_model_parallel_size > 1 else block
    if use_te:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=config.qk_layernorm)
    return _with_fused_swiglu(
        _with_packed_attention(get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=config.qk_layernorm)),
        config)


def _with_fused_swiglu(layer: ModuleSpec, config: TransformerConfig) -> ModuleSpec:
    """A dense local layer spec whose MLP applies rlhf's SwiGLU (`rlhf.platform.swiglu`: one C pass forward and
    backward on CPU) to its whole fc1 output, through the activation-module hook megatron names after TE
    (`use_te_activation_func`, set on `config` here: it applies to every MLP of the model, so never on MoE ones)."""
    assert not config.num_moe_experts and config.gated_linear_unit and config.activation_func is F.silu
    layer.submodules.mlp.submodules.activation_func = FusedSwiGLU
    config.use_te_activation_func = True
    return layer


def _with_packed_attention(layer: ModuleSpec) -> ModuleSpec:
    """A local layer spec whose attention core also takes packed (THD) micro-batches (`rlhf.models.packing`)
    and runs torch's fused attention on unpacked ones (`rlhf.platform.fused_attention`); TE's core takes packed
    micro-batches natively."""
    layer.submodules.self_attention.submodules.core_attention = FusedDotProductAttention
    return layer


def build_gpt(hf_config: Any, pg_collection: ProcessGroupCollection, *, pre_process: bool | None = None,
              post_process: bool | None = None, value_head: bool = False, recompute: bool = False,
              params_dtype: torch.dtype = torch.float32, seed: int = 1234,
              moe_kwargs: dict | None = None, transformer_engine: bool = True) -> GPTModelWithHiddenOutput:
    """This rank's stage of the model described by `hf_config`, on the groups in `pg_collection`.

    `pre_process`/`post_process` default to "first/last pipeline stage" of `pg_collection.pp`. With
    `value_head=True` the LM head is replaced by a scalar head (critic / reward model). Weights are randomly
    initialised (seeded); load real ones with `rlhf.models.hf_load`. The model can also return its final
    hidden states (`rlhf.models.lm_head.hidden_output`) for the fused logprob path. `moe_kwargs` (router
    losses, token dispatcher: `rlhf.models.routing.MoeConfig.build_kwargs`) go to `moe_config`; expert
    parallelism is `pg_collection.ep`'s size. `transformer_engine=False` keeps megatron's local layers on a GPU
    (LoRA adapts their unfused linears).
    """
    megatron_compat.apply()
    spec = ModelSpec.from_hf(hf_config)
    tp, pp = pg_collection.tp.size(), pg_collection.pp.size()
    pp_rank = pg_collection.pp.rank()
    pre_process = pp_rank == 0 if pre_process is None else pre_process
    post_process = pp_rank == pp - 1 if post_process is None else post_process
    config = transformer_config(spec, tp=tp, pp=pp, params_dtype=params_dtype, recompute=recompute,
                                moe_kwargs=moe_config(spec, ep=pg_collection.ep.size(), **(moe_kwargs or {})))
    megatron_compat.seed_rng_tracker(seed, pg_collection.tp.rank())
    megatron_compat.ensure_memory_buffer()
    model = GPTModelWithHiddenOutput(
        config=config, transformer_layer_spec=layer_spec(config, pp_rank, pg_collection, transformer_engine),
        vocab_size=spec.padded_vocab_size(tp),
        max_sequence_length=spec.max_position_embeddings, pre_process=pre_process, post_process=post_process,
        parallel_output=True, share_embeddings_and_output_weights=spec.tie_embeddings and not value_head,
        position_embedding_type="rope", rotary_base=spec.rope_theta, pg_collection=pg_collection)
    # The local spec's torch norms are built on the host even when the linear layers are on the accelerator
    # (found by benchmarks/gpu_check on an H200); one move puts every parameter and buffer on the device.
    model.to(current_device())
    # ... and in fp32 whatever `params_dtype` is; their weights follow the model's dtype (buffers such as the
    # rotary frequencies stay fp32).
    for param in model.parameters():
        if param.dtype != params_dtype:
            param.data = param.data.to(params_dtype)
    model.rotary_pos_emb.inv_freq = spec.inv_freq().to(model.rotary_pos_emb.inv_freq.device)
    use_fused_rms_norms(model)  # the local layers' torch norms: one C pass forward and backward on CPU in fp32
    if value_head and post_process:
        head = ValueHead(spec.hidden_size, init_std=spec.initializer_range, seed=seed, dtype=params_dtype)
        model.output_layer = head.to(current_device())
    model.rlhf_spec, model.rlhf_hf_config, model.rlhf_value_head = spec, hf_config, value_head
    return model
