"""LoRA adapters on a megatron model built by `build_gpt`, laid out as PEFT's on the HF model.

Each adapted megatron linear holds one (A, B) pair per HF linear it fuses: `linear_qkv` has q, k, v (its rows
interleaved per query group, `rlhf.models.param_specs`), `linear_fc1` gate and up ([gate rows; up rows] of the
rank), `linear_proj` o and `linear_fc2` down. Its output gains (alpha / r) B A dropout(x) through a forward hook,
so the base parameters keep their names and the loader, exporter and resharder see the model unchanged.

TP: on a column-parallel base A is replicated and B split by output rows (the rank's contiguous rows of the HF
B); on a row-parallel base A is split by input columns and B replicated. The only communication added is an
all-reduce of the r-wide activations A x (their gradient for column-parallel, their value for row-parallel).
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,
                                                    reduce_from_tensor_model_parallel_region)

from rlhf.errors import CheckpointError, ConfigError
from rlhf.models.config import LORA_MOE_TARGETS, LoraConfig
from rlhf.models.param_specs import ParamSpec
from rlhf.models.shard_rules import merge_shards, read_shard
from rlhf.parallel.wire import broadcast_json

# megatron linear -> (HF module under model.layers.{i}., its targets in output order, base is column-parallel)
LINEARS = {"self_attention.linear_qkv": ("self_attn", ("q", "k", "v"), True),
           "self_attention.linear_proj": ("self_attn", ("o",), False),
           "mlp.linear_fc1": ("mlp", ("gate", "up"), True),
           "mlp.linear_fc2": ("mlp", ("down",), False)}


@dataclass(frozen=True)
class AdapterGeometry:
    """Full (HF) in/out sizes of each target of one linear, and how its local output rows are laid out."""

    column: bool
    in_features: int  # full input size (row-parallel bases split it over tp)
    out_features: dict[str, int]  # target -> full output rows (column-parallel bases split them over tp)
    num_groups: int  # qkv: local query groups (rows interleave q, k, v per group); 1 otherwise


class LoraAdapter(torch.nn.Module):
    """The adapters of one megatron linear (`lora_a[t]`, `lora_b[t]` per target t) on this tp rank."""

    def __init__(self, geometry: AdapterGeometry, targets: tuple[str, ...], config: LoraConfig,
                 tp_group: dist.ProcessGroup, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.geometry, self.targets, self.tp_group = geometry, targets, tp_group
        self.rank, self.scaling, self.enabled = config.rank, config.scaling, True
        self.dropout = torch.nn.Dropout(config.dropout) if config.dropout else torch.nn.Identity()
        tp, rank = tp_group.size(), config.rank
        local_in = geometry.in_features if geometry.column else geometry.in_features // tp
        self.lora_a = torch.nn.ParameterDict()
        self.lora_b = torch.nn.ParameterDict()
        for target in targets:
            out = geometry.out_features[target] // tp if geometry.column else geometry.out_features[target]
            self.lora_a[target] = torch.nn.Parameter(torch.empty(rank, local_in, dtype=dtype, device=device))
            self.lora_b[target] = torch.nn.Parameter(torch.zeros(out, rank, dtype=dtype, device=device))
            split = self.lora_b[target] if geometry.column else self.lora_a[target]
            set_tensor_model_parallel_attributes(split, True, 0 if geometry.column else 1, 1)

    def split_dim(self, which: str) -> int | None:
        """The dim along which tp ranks split `lora_a`/`lora_b` ("a"/"b"), None where replicated."""
        if which == "b":
            return 0 if self.geometry.column else None
        return None if self.geometry.column else 1

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """(alpha / r) B A dropout(x): this rank's share of the base's output ([..., local out rows])."""
        x = self.dropout(x)
        a_cat = torch.cat([self.lora_a[t] for t in self.targets])
        u = x.to(a_cat.dtype) @ a_cat.t()
        if self.geometry.column:
            u = copy_to_tensor_model_parallel_region(u, group=self.tp_group)
        else:
            u = reduce_from_tensor_model_parallel_region(u, group=self.tp_group)
        parts = {t: u_t @ self.lora_b[t].t() for t, u_t in zip(self.targets, u.split(self.rank, dim=-1))}
        return self.fuse(parts, x.shape[:-1]) * self.scaling

    def delta_weight(self) -> torch.Tensor:
        """(alpha / r) B A in the base weight's local layout ([local out, local in], contiguous)."""
        parts = {t: self.lora_b[t] @ self.lora_a[t] for t in self.targets}
        if not self.geometry.column:
            return parts[self.targets[0]] * self.scaling
        some, tp = next(iter(parts.values())), self.tp_group.size()
        full = [parts.get(t, some.new_zeros(rows // tp, some.shape[1]))
                for t, rows in self.geometry.out_features.items()]
        grouped = [part.reshape(self.geometry.num_groups, -1, some.shape[1]) for part in full]
        return torch.cat(grouped, dim=1).reshape(-1, some.shape[1]) * self.scaling

    def fuse(self, parts: dict[str, torch.Tensor], lead: tuple[int, ...]) -> torch.Tensor:
        """Per-target outputs ([..., local rows of t]) as the base's local output rows; absent targets are 0."""
        geometry, tp = self.geometry, self.tp_group.size()
        if not geometry.column:
            return parts[self.targets[0]]
        some = next(iter(parts.values()))
        full = [parts.get(t, some.new_zeros(*lead, geometry.out_features[t] // tp))
                for t in geometry.out_features]
        grouped = [part.reshape(*lead, geometry.num_groups, -1) for part in full]
        return torch.cat(grouped, dim=-1).reshape(*lead, -1)


def _hook(module: torch.nn.Module, inputs: tuple, output: tuple) -> tuple:
    adapter: LoraAdapter = module.lora
    if not adapter.enabled:
        return output
    base_out, bias = output
    return (base_out + adapter.delta(inputs[0])).to(base_out.dtype), bias  # one rounding, as PEFT's


def geometry_of(spec: Any, linear_name: str, tp: int) -> AdapterGeometry:
    """The adapter geometry of `linear_name` in a model of `spec` (a `ModelSpec`) at tensor-parallel size `tp`."""
    h, d = spec.hidden_size, spec.head_dim
    if linear_name == "self_attention.linear_qkv":
        out = {"q": spec.num_heads * d, "k": spec.num_kv_heads * d, "v": spec.num_kv_heads * d}
        return AdapterGeometry(column=True, in_features=h, out_features=out, num_groups=spec.num_kv_heads // tp)
    if linear_name == "self_attention.linear_proj":
        return AdapterGeometry(column=False, in_features=spec.num_heads * d, out_features={"o": h}, num_groups=1)
    ffn = spec.ffn_hidden_size
    if linear_name == "mlp.linear_fc1":
        return AdapterGeometry(column=True, in_features=h, out_features={"gate": ffn, "up": ffn}, num_groups=1)
    return AdapterGeometry(column=False, in_features=ffn, out_features={"down": h}, num_groups=1)


def apply_lora(model: Any, config: LoraConfig, dtype: torch.dtype | None = None) -> None:
    """Attach `config`'s adapters to `model` (A: PEFT's kaiming-uniform, seeded per HF module so every layout
    starts alike; B: zero) in `dtype` (None: the base's) and freeze every base parameter. Call before wrapping
    the model for training."""
    refused = sorted(set(config.targets) & set(LORA_MOE_TARGETS))
    if refused:
        raise ConfigError(f"lora.targets={list(config.targets)}: {', '.join(refused)} adapters are not built yet; "
                          "adapt the attention and dense MLP linears (q, k, v, o, gate, up, down)")
    for param in model.parameters():
        param.requires_grad_(False)
    if _value_head(model) is not None:
        _value_head(model).requires_grad_(True)  # a LoRA critic's value head stays fully trained
    tp_group = model.pg_collection.tp
    for linear_name, linear, layer in _adaptable_linears(model):
        if hasattr(linear, "layer_norm_weight"):
            raise ConfigError("LoRA on Transformer-Engine layers (the norm fused into the linear) is not built yet; "
                              "run LoRA with megatron's local layer spec")
        targets = tuple(t for t in LINEARS[linear_name][1] if t in config.targets)
        if not targets:
            continue
        weight = linear.weight
        adapter = LoraAdapter(geometry_of(model.rlhf_spec, linear_name, tp_group.size()), targets, config,
                              tp_group, dtype or weight.dtype, weight.device)
        _init_a(adapter, config.seed, layer, linear_name)
        linear.add_module("lora", adapter)
        linear.register_forward_hook(_hook)
    model.rlhf_lora = config


def _adaptable_linears(model: Any) -> Iterator[tuple[str, torch.nn.Module, int]]:
    """(megatron linear name, module, global layer index) of every linear LoRA can adapt on this stage."""
    for layer_module in model.decoder.layers:
        layer = layer_module.layer_number - 1
        for linear_name in LINEARS:
            owner_name, attr = linear_name.split(".")
            linear = getattr(getattr(layer_module, owner_name), attr, None)
            if linear is not None:  # routed MLP layers have no linear_fc1/fc2
                yield linear_name, linear, layer


@torch.no_grad()
def _init_a(adapter: LoraAdapter, seed: int, layer: int, linear_name: str) -> None:
    """PEFT's init of each full A (kaiming-uniform, a=sqrt(5): U(+-1/sqrt(in))), then this rank's columns."""
    for target, param in adapter.lora_a.items():
        name = hf_module(layer, linear_name, target)
        generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        bound = 1.0 / math.sqrt(adapter.geometry.in_features)
        full = torch.empty(param.shape[0], adapter.geometry.in_features).uniform_(-bound, bound, generator=generator)
        param.copy_(_local(full, adapter.split_dim("a"), adapter.tp_group))


def _local(full: torch.Tensor, dim: int | None, tp_group: dist.ProcessGroup) -> torch.Tensor:
    return full if dim is None else full.chunk(tp_group.size(), dim=dim)[tp_group.rank()]


def hf_module(layer: int, linear_name: str, target: str) -> str:
    """The HF module an adapter belongs to, e.g. `model.layers.3.self_attn.q_proj`."""
    return f"model.layers.{layer}.{LINEARS[linear_name][0]}.{target}_proj"


def adapters(model: Any) -> Iterator[tuple[str, int, LoraAdapter]]:
    """(megatron linear name, global layer index, adapter) on this stage, in layer order."""
    for linear_name, linear, layer in _adaptable_linears(model):
        if hasattr(linear, "lora"):
            yield linear_name, layer, linear.lora


def adapter_pairs(model: Any) -> list[tuple[ParamSpec, torch.nn.Parameter]]:
    """(spec, this rank's parameter) of every adapter tensor on this stage; a spec's one HF name is PEFT's
    (`base_model.model.<module>.lora_A.weight`) and its kind says how tp splits it (rows / row / replicated)."""
    pp_stage, pairs = model.pg_collection.pp.rank(), []
    for linear_name, layer, adapter in adapters(model):
        for target in adapter.targets:
            module = hf_module(layer, linear_name, target)
            in_features, out_features = adapter.geometry.in_features, adapter.geometry.out_features[target]
            for which, params, shape in (("A", adapter.lora_a, (adapter.rank, in_features)),
                                         ("B", adapter.lora_b, (out_features, adapter.rank))):
                dim = adapter.split_dim(which.lower())
                kind = {None: "replicated", 0: "rows", 1: "row"}[dim]
                name = f"base_model.model.{module}.lora_{which}.weight"
                pairs.append((ParamSpec(name, (name,), shape, dim, kind, pp_stage, layer), params[target]))
    return pairs


def adapter_dtype(config: LoraConfig) -> torch.dtype | None:
    """The adapters' dtype `lora.dtype` asks for (None: the base weights')."""
    return torch.float32 if config.dtype == "fp32" else None


def _value_head(model: Any) -> torch.nn.Parameter | None:
    """The scalar head of a value model's last stage (None elsewhere, and on LM models)."""
    return model.output_layer.weight if getattr(model, "rlhf_value_head", False) and model.post_process else None


def lora_trained_pairs(model: Any) -> list[tuple[ParamSpec, torch.nn.Parameter]]:
    """What a LoRA model trains and checkpoints on this rank: its adapters, and a value model's head (HF
    `score.weight`, replicated over tp)."""
    head = _value_head(model)
    if head is None:
        return adapter_pairs(model)
    stage = model.pg_collection.pp.rank()
    spec = ParamSpec("output_layer.weight", ("score.weight",), tuple(head.shape), None, "replicated", stage)
    return adapter_pairs(model) + [(spec, head)]


def has_adapters(model: Any) -> bool:
    """Whether `apply_lora` gave `model` adapters."""
    return getattr(model, "rlhf_lora", None) is not None


def is_adapter_param(name: str) -> bool:
    """Whether a `named_parameters()` name is a LoRA adapter tensor (not a base weight)."""
    return ".lora.lora_" in name


@torch.no_grad()
def load_adapter_tensors(model: Any, tensors: dict[str, torch.Tensor]) -> None:
    """Copy full PEFT-named adapter tensors into this rank's shards; a missing or misshapen one is a ConfigError."""
    tp_group = model.pg_collection.tp
    for spec, param in adapter_pairs(model):
        name = spec.hf_names[0]
        if name not in tensors:
            raise ConfigError(f"the adapter has no tensor {name!r}; was it trained for another base model or "
                              "other lora.targets?")
        if tuple(tensors[name].shape) != spec.full_shape:
            raise ConfigError(f"adapter tensor {name!r} has shape {list(tensors[name].shape)}, this model's "
                              f"lora.rank and base need {list(spec.full_shape)} (another base or lora.rank?)")
        param.copy_(read_shard(spec, tensors.__getitem__, model.rlhf_spec, tp_group.rank(), tp_group.size()))


def gathered_adapter_tensors(model: Any) -> dict[str, torch.Tensor]:
    """Collective over tp: every adapter tensor of this stage, full and PEFT-named (host copies)."""
    tp_group, out = model.pg_collection.tp, {}
    for spec, param in adapter_pairs(model):
        shards = [param.detach().cpu().clone()]
        if spec.partition_dim is not None:
            shards = [torch.empty_like(param) for _ in range(tp_group.size())]
            dist.all_gather(shards, param.detach().contiguous(), group=tp_group)
        out.update({name: t.cpu() for name, t in merge_shards(spec, shards, model.rlhf_spec).items()})
    return out


@contextlib.contextmanager
def adapters_disabled(model: Any) -> Iterator[None]:
    """The base model: forwards inside skip every adapter (the reference policy of a LoRA actor)."""
    found = [adapter for _, _, adapter in adapters(model)]
    for adapter in found:
        adapter.enabled = False
    try:
        yield
    finally:
        for adapter in found:
            adapter.enabled = True


def merged_weight(model: Any, local_name: str, param: torch.Tensor) -> torch.Tensor:
    """`param` (named `local_name` in `model`) with its adapter merged in, W + (alpha / r) B A; others as they are."""
    if not has_adapters(model):
        return param
    module_name, _, leaf = local_name.rpartition(".")
    return merged_linear_weight(model.get_submodule(module_name)) if leaf == "weight" else param


def merged_linear_weight(linear: torch.nn.Module) -> torch.Tensor:
    """A megatron linear's weight with its adapter (if any, and enabled) merged in."""
    adapter = getattr(linear, "lora", None)
    if adapter is None or not adapter.enabled:
        return linear.weight
    return (linear.weight + adapter.delta_weight()).to(linear.weight.dtype)


def base_identity(path: str) -> dict[str, str]:
    """Collective over the world: the base model a LoRA checkpoint belongs to, its folder and the sha256 of its
    safetensors files' bytes (read once, on rank 0)."""
    digest = None
    if dist.get_rank() == 0:
        sha = hashlib.sha256()
        for file in sorted(f for f in os.listdir(path) if f.endswith(".safetensors")):
            with open(os.path.join(path, file), "rb") as handle:
                for chunk in iter(lambda: handle.read(1 << 24), b""):
                    sha.update(chunk)
        digest = sha.hexdigest()
    return {"path": path, "sha256": broadcast_json(digest, src=0)}


def check_same_base(saved: dict[str, str] | None, current: dict[str, str] | None, role: str) -> None:
    """CheckpointError when a checkpoint's LoRA-ness or base model differs from this run's."""
    if saved == current or (saved and current and saved["sha256"] == current["sha256"]):
        return
    if saved is None or current is None:
        what = "full fine-tuning" if saved is None else "LoRA adapters"
        raise CheckpointError(f"the {role} checkpoint holds {what} but this run has lora.enabled="
                              f"{str(current is not None).lower()}; resume with the run's own lora setting")
    raise CheckpointError(f"the {role} checkpoint's LoRA adapters were trained on {saved['path']} (sha256 "
                          f"{saved['sha256'][:12]}), not on this run's model.path {current['path']} (sha256 "
                          f"{current['sha256'][:12]}); resume with the base model it was trained on")
