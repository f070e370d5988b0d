"""Every megatron parameter of a model as data: name, HF sources, full shape, how it is split over tp.

`param_specs(hf_config, layout)` is the one mapping HF <-> megatron; the loader, the exporter and the
resharding planner all read it. Shard kinds (rank r of tp, shard = rows/cols of the full megatron tensor):

- `replicated`: every tp rank holds the full tensor (norms, value head);
- `row`: split along dim 1 (attention output, MLP down projection);
- `vocab`: split along dim 0 after padding the vocab with zero rows to a multiple of tp;
- `qkv`: dim 0 holds, per query group, that group's q heads then its k head then its v head; tp ranks own
  whole groups, so rank r's shard is rows [r, r+1) * full/tp of the interleaved tensor;
- `gate_up`: rank r's shard is [gate rows of r; up rows of r] -- the full tensor is NOT [gate; up];
- `rows`: split along dim 0 into contiguous blocks (LoRA B of a column-parallel linear, `rlhf.models.lora`).

MoE layers hold a replicated router and one MLP per expert; expert `e` (global index, `ParamSpec.expert`)
lives on expert-parallel rank `e // (num_experts / ep)` as local expert `e % (num_experts / ep)`, and is split
over tp like a dense MLP (megatron's expert-tensor-parallel size = tp).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rlhf.parallel.layout import ParallelLayout
from rlhf.models.spec import ModelSpec

KINDS = ("replicated", "row", "vocab", "qkv", "gate_up", "rows")


@dataclass(frozen=True)
class ParamSpec:
    """One megatron parameter; `name` uses the global layer index (`local_name` gives the stage's)."""

    name: str
    hf_names: tuple[str, ...]
    full_shape: tuple[int, ...]
    partition_dim: int | None
    kind: str
    pp_stage: int
    layer: int | None = None
    tied_copy: bool = False  # last stage's copy of tied embeddings: loaded, never exported
    expert: int | None = None  # global expert index of an expert's weight

    def __post_init__(self) -> None:
        assert self.kind in KINDS, self.kind

    def local_name(self, layers_per_stage: int, experts_per_rank: int | None = None) -> str:
        """The name inside this rank's module: stage-local layer index and ep-local expert index."""
        if self.layer is None:
            return self.name
        prefix = f"decoder.layers.{self.layer}."
        rest = self.name[len(prefix):]
        if self.expert is not None and experts_per_rank is not None:
            expert_prefix = f"mlp.experts.local_experts.{self.expert}."
            rest = f"mlp.experts.local_experts.{self.expert % experts_per_rank}." + rest[len(expert_prefix):]
        return f"decoder.layers.{self.layer % layers_per_stage}." + rest

    def ep_rank(self, experts_per_rank: int) -> int | None:
        """The expert-parallel rank holding this parameter (None: every ep rank holds it)."""
        return None if self.expert is None else self.expert // experts_per_rank

    def shard_shape(self, tp: int) -> tuple[int, ...]:
        if self.partition_dim is None:
            return self.full_shape
        shape = list(self.full_shape)
        shape[self.partition_dim] //= tp
        return tuple(shape)


def _mlp_specs(spec: ModelSpec, layer: int, stage: int) -> list[ParamSpec]:
    """A dense SwiGLU MLP, or a routed layer's router and experts (HF names per `spec.moe`)."""
    h, hf, mg = spec.hidden_size, f"model.layers.{layer}.", f"decoder.layers.{layer}."
    moe = spec.moe
    if moe is None or not moe.moe_layers[layer]:
        return [ParamSpec(mg + "mlp.linear_fc1.weight", (hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight"),
                          (2 * spec.ffn_hidden_size, h), 0, "gate_up", stage, layer),
                ParamSpec(mg + "mlp.linear_fc2.weight", (hf + "mlp.down_proj.weight",), (h, spec.ffn_hidden_size),
                          1, "row", stage, layer)]
    block, ffn = f"{hf}{moe.hf_prefix}.", moe.expert_ffn_hidden_size
    gate, up, down = moe.hf_expert_names
    specs = [ParamSpec(mg + "mlp.router.weight", (block + "gate.weight",), (moe.num_experts, h), None,
                       "replicated", stage, layer)]
    for expert in range(moe.num_experts):
        src, dst = f"{block}experts.{expert}.", f"{mg}mlp.experts.local_experts.{expert}."
        specs += [ParamSpec(dst + "linear_fc1.weight", (f"{src}{gate}.weight", f"{src}{up}.weight"), (2 * ffn, h),
                            0, "gate_up", stage, layer, expert=expert),
                  ParamSpec(dst + "linear_fc2.weight", (f"{src}{down}.weight",), (h, ffn), 1, "row", stage, layer,
                            expert=expert)]
    return specs


def _layer_specs(spec: ModelSpec, layer: int, stage: int) -> list[ParamSpec]:
    h, d = spec.hidden_size, spec.head_dim
    qkv_rows = (spec.num_heads + 2 * spec.num_kv_heads) * d
    hf = f"model.layers.{layer}."
    mg = f"decoder.layers.{layer}."
    qkv_sources = tuple(f"{hf}self_attn.{p}_proj.weight" for p in "qkv")
    specs = [
        ParamSpec(mg + "input_layernorm.weight", (hf + "input_layernorm.weight",), (h,), None, "replicated",
                  stage, layer),
        ParamSpec(mg + "self_attention.linear_qkv.weight", qkv_sources, (qkv_rows, h), 0, "qkv", stage, layer),
        ParamSpec(mg + "self_attention.linear_proj.weight", (hf + "self_attn.o_proj.weight",),
                  (h, spec.num_heads * d), 1, "row", stage, layer),
        ParamSpec(mg + "pre_mlp_layernorm.weight", (hf + "post_attention_layernorm.weight",), (h,), None,
                  "replicated", stage, layer),
    ] + _mlp_specs(spec, layer, stage)
    if spec.qk_norm:
        specs[3:3] = [ParamSpec(f"{mg}self_attention.{m}_layernorm.weight", (f"{hf}self_attn.{m}_norm.weight",),
                                (d,), None, "replicated", stage, layer) for m in "qk"]
    if spec.qkv_bias:
        bias_sources = tuple(f"{hf}self_attn.{p}_proj.bias" for p in "qkv")
        specs.insert(2, ParamSpec(mg + "self_attention.linear_qkv.bias", bias_sources, (qkv_rows,), 0, "qkv",
                                  stage, layer))
    return specs


def param_specs(hf_config: Any, layout: ParallelLayout, *, value_head: bool = False) -> list[ParamSpec]:
    """All parameters of the model on `layout`, stage by stage, in megatron's parameter order."""
    spec = ModelSpec.from_hf(hf_config)
    spec.check_layout(layout.tp, layout.pp, layout.ep)
    h, vocab = spec.hidden_size, spec.padded_vocab_size(layout.tp)
    last, per_stage = layout.pp - 1, spec.num_layers // layout.pp
    embed = ParamSpec("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), (vocab, h), 0,
                      "vocab", 0)
    specs = [embed]
    for layer in range(spec.num_layers):
        specs += _layer_specs(spec, layer, layer // per_stage)
    specs.append(ParamSpec("decoder.final_layernorm.weight", ("model.norm.weight",), (h,), None, "replicated",
                           last))
    if value_head:
        specs.append(ParamSpec("output_layer.weight", ("score.weight",), (1, h), None, "replicated", last))
    elif not spec.tie_embeddings:
        specs.append(ParamSpec("output_layer.weight", ("lm_head.weight",), (vocab, h), 0, "vocab", last))
    elif layout.pp > 1:
        specs.append(ParamSpec("output_layer.weight", ("model.embed_tokens.weight",), (vocab, h), 0, "vocab",
                               last, tied_copy=True))
    return specs


def hf_shapes(spec: ModelSpec, *, head: str) -> dict[str, tuple[int, ...]]:
    """The tensors (name -> shape) of an HF folder for `spec` with `head` in "lm" | "score" | "none".

    A tied model's `lm_head.weight` is not listed (HF omits it; the embedding serves).
    """
    h, d = spec.hidden_size, spec.head_dim
    q_rows, kv_rows = spec.num_heads * d, spec.num_kv_heads * d
    shapes = {"model.embed_tokens.weight": (spec.vocab_size, h), "model.norm.weight": (h,)}
    for layer in range(spec.num_layers):
        p = f"model.layers.{layer}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                       p + "self_attn.q_proj.weight": (q_rows, h), p + "self_attn.k_proj.weight": (kv_rows, h),
                       p + "self_attn.v_proj.weight": (kv_rows, h), p + "self_attn.o_proj.weight": (h, q_rows)})
        if spec.qk_norm:
            shapes.update({p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)})
        shapes.update(_mlp_shapes(spec, layer))
        if spec.qkv_bias:
            shapes.update({p + "self_attn.q_proj.bias": (q_rows,), p + "self_attn.k_proj.bias": (kv_rows,),
                           p + "self_attn.v_proj.bias": (kv_rows,)})
    if head == "score":
        shapes["score.weight"] = (1, h)
    elif head == "lm" and not spec.tie_embeddings:
        shapes["lm_head.weight"] = (spec.vocab_size, h)
    return shapes


def _mlp_shapes(spec: ModelSpec, layer: int) -> dict[str, tuple[int, ...]]:
    h, p, moe = spec.hidden_size, f"model.layers.{layer}.", spec.moe
    if moe is None or not moe.moe_layers[layer]:
        ffn = spec.ffn_hidden_size
        return {p + "mlp.gate_proj.weight": (ffn, h), p + "mlp.up_proj.weight": (ffn, h),
                p + "mlp.down_proj.weight": (h, ffn)}
    block, ffn = f"{p}{moe.hf_prefix}.", moe.expert_ffn_hidden_size
    gate, up, down = moe.hf_expert_names
    shapes = {block + "gate.weight": (moe.num_experts, h)}
    for expert in range(moe.num_experts):
        src = f"{block}experts.{expert}."
        shapes.update({f"{src}{gate}.weight": (ffn, h), f"{src}{up}.weight": (ffn, h), f"{src}{down}.weight": (h, ffn)})
    return shapes
