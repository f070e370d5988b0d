"""Every megatron parameter of a model as data: name, HF sources, full shape, how it is split over tp.

`param_specs(hf_config, layout)` is the one mapping HF <-> megatron; the loader, the exporter and the
resharding planner all read it. Shard kinds (rank r of tp, shard = rows/cols of the full megatron tensor):

- `replicated`: every tp rank holds the full tensor (norms, value head);
- `row`: split along dim 1 (attention output, MLP down projection);
- `vocab`: split along dim 0 after padding the vocab with zero rows to a multiple of tp;
- `qkv`: dim 0 holds, per query group, that group's q heads then its k head then its v head; tp ranks own
  whole groups, so rank r's shard is rows [r, r+1) * full/tp of the interleaved tensor;
- `gate_up`: rank r's shard is [gate rows of r; up rows of r] -- the full tensor is NOT [gate; up].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rlhf.dist.layout import ParallelLayout
from rlhf.models.spec import ModelSpec

KINDS = ("replicated", "row", "vocab", "qkv", "gate_up")


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

    def __post_init__(self) -> None:
        assert self.kind in KINDS, self.kind

    def local_name(self, layers_per_stage: int) -> str:
        if self.layer is None:
            return self.name
        prefix = f"decoder.layers.{self.layer}."
        return f"decoder.layers.{self.layer % layers_per_stage}." + self.name[len(prefix):]

    def shard_shape(self, tp: int) -> tuple[int, ...]:
        if self.partition_dim is None:
            return self.full_shape
        shape = list(self.full_shape)
        shape[self.partition_dim] //= tp
        return tuple(shape)


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
        ParamSpec(mg + "mlp.linear_fc1.weight", (hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight"),
                  (2 * spec.ffn_hidden_size, h), 0, "gate_up", stage, layer),
        ParamSpec(mg + "mlp.linear_fc2.weight", (hf + "mlp.down_proj.weight",), (h, spec.ffn_hidden_size), 1,
                  "row", stage, layer),
    ]
    if spec.qkv_bias:
        bias_sources = tuple(f"{hf}self_attn.{p}_proj.bias" for p in "qkv")
        specs.insert(2, ParamSpec(mg + "self_attention.linear_qkv.bias", bias_sources, (qkv_rows,), 0, "qkv",
                                  stage, layer))
    return specs


def param_specs(hf_config: Any, layout: ParallelLayout, *, value_head: bool = False) -> list[ParamSpec]:
    """All parameters of the model on `layout`, stage by stage, in megatron's parameter order."""
    spec = ModelSpec.from_hf(hf_config)
    spec.check_layout(layout.tp, layout.pp)
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
    h, d, ffn = spec.hidden_size, spec.head_dim, spec.ffn_hidden_size
    q_rows, kv_rows = spec.num_heads * d, spec.num_kv_heads * d
    shapes = {"model.embed_tokens.weight": (spec.vocab_size, h), "model.norm.weight": (h,)}
    for layer in range(spec.num_layers):
        p = f"model.layers.{layer}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                       p + "self_attn.q_proj.weight": (q_rows, h), p + "self_attn.k_proj.weight": (kv_rows, h),
                       p + "self_attn.v_proj.weight": (kv_rows, h), p + "self_attn.o_proj.weight": (h, q_rows),
                       p + "mlp.gate_proj.weight": (ffn, h), p + "mlp.up_proj.weight": (ffn, h),
                       p + "mlp.down_proj.weight": (h, ffn)})
        if spec.qkv_bias:
            shapes.update({p + "self_attn.q_proj.bias": (q_rows,), p + "self_attn.k_proj.bias": (kv_rows,),
                           p + "self_attn.v_proj.bias": (kv_rows,)})
    if head == "score":
        shapes["score.weight"] = (1, h)
    elif head == "lm" and not spec.tie_embeddings:
        shapes["lm_head.weight"] = (spec.vocab_size, h)
    return shapes
