"""`lora.sync: adapter`: only the LoRA A/B slices travel to a rollout engine with its own copy of the model.

The native engine's model carries adapters of its own (`rlhf.models.lora`, attached at build in the rollout
layout). The first sync pushes the frozen base once (adapters off, through the base plan); every later sync
plans and moves the adapter tensors alone. The engine keeps its base untouched and, at each policy version,
re-derives its packed weights as W_base + (alpha / r) B A from it (`NativeEngine.generate`), so nothing is ever
unmerged and the merged view is recomputed from a pristine base: bitwise the trainer's merged weights when both
sides hold the base in one dtype. Memory cost on the engine: one merged copy of the adapted linears (the packed
weights), as the colocated engine pays already.

A vLLM engine (`hf_names`) takes the base once as full HF tensors, then each version's full adapter tensors
under PEFT's names (`VllmEngine.load_adapter`: vLLM's own LoRA support, no merged copy).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Mapping
from typing import Any

import torch

from rlhf.models.config import LoraConfig
from rlhf.models.lora import LINEARS, adapters_disabled, geometry_of, hf_module
from rlhf.models.param_specs import ParamSpec
from rlhf.models.spec import ModelSpec
from rlhf.parallel.layout import ParallelLayout
from rlhf.reshard.planner import ReshardPlan, plan
from rlhf.reshard.sync import SyncStats, WeightSync


def adapter_param_name(layer: int, linear_name: str, which: str, target: str) -> str:
    """The megatron-side name of one adapter tensor (global layer index), as `named_parameters()` spells it."""
    return f"decoder.layers.{layer}.{linear_name}.lora.lora_{which}.{target}"


_ADAPTER_NAME = re.compile(r"decoder\.layers\.(\d+)\.(.+)\.lora\.lora_([ab])\.(\w+)")  # as adapter_param_name spells it


def peft_named(full_adapters: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Full (tp=1) adapter tensors under PEFT's names (`base_model.model.<HF module>.lora_A.weight`)."""
    named = {}
    for name, tensor in full_adapters.items():
        layer, linear_name, which, target = _ADAPTER_NAME.fullmatch(name).group(1, 2, 3, 4)
        named[f"base_model.model.{hf_module(int(layer), linear_name, target)}.lora_{which.upper()}.weight"] = tensor
    return named


def adapter_specs(hf_config: Any, lora: LoraConfig, layout: ParallelLayout) -> list[ParamSpec]:
    """Every adapter tensor of the model on `layout`, in layer order: A replicated and B split by rows on a
    column-parallel base; A split by columns (`row`) and B replicated on a row-parallel one. Pure."""
    spec = ModelSpec.from_hf(hf_config)
    per_stage, routed = spec.num_layers // layout.pp, spec.moe.moe_layers if spec.moe else None
    specs = []
    for layer in range(spec.num_layers):
        for linear_name, (owner, targets, column) in LINEARS.items():
            if owner == "mlp" and routed is not None and routed[layer]:
                continue  # a routed layer has no dense linear_fc1/fc2 to adapt
            geometry = geometry_of(spec, linear_name, 1)
            for target in (t for t in targets if t in lora.targets):
                shapes = {"a": (lora.rank, geometry.in_features), "b": (geometry.out_features[target], lora.rank)}
                cuts = {"a": (None, "replicated") if column else (1, "row"),
                        "b": (0, "rows") if column else (None, "replicated")}
                for which in ("a", "b"):
                    name = adapter_param_name(layer, linear_name, which, target)
                    specs.append(ParamSpec(name, (name,), shapes[which], cuts[which][0], cuts[which][1],
                                           layer // per_stage, layer))
    return specs


def _adapters_by_plan_name(model: torch.nn.Module | None) -> dict[str, torch.Tensor]:
    """A LoRA model's adapter tensors under their stage-local names (the plan's)."""
    if model is None:
        return {}
    return {name: param.detach() for name, param in model.named_parameters() if ".lora.lora_" in name}


class AdapterSync(WeightSync):
    """`WeightSync` over the adapter tensors only, after one push of the base (collective, like its parent).

    `check()` (comm.verify) verifies the adapter slices and then the engine's merged view against the trainer's
    merged weights, bitwise, through the base plan.
    """

    def __init__(self, src_model: torch.nn.Module | None, src_layout: ParallelLayout, dst_layout: ParallelLayout,
                 engine: Any | None, *, lora: LoraConfig, **kwargs: Any) -> None:
        self.lora = lora
        self.base = WeightSync(src_model, src_layout, dst_layout, engine, **(kwargs | {"verify": False}))
        kwargs.pop("dtype", None)  # the wire carries the adapters in their own dtype
        super().__init__(src_model, src_layout, dst_layout, engine, **kwargs)
        self.base_pushed = False

    def _make_plan(self, src_layout: ParallelLayout, dst_layout: ParallelLayout) -> ReshardPlan:
        vocab_size = ModelSpec.from_hf(self.hf_config).vocab_size
        return plan(src_layout, dst_layout, adapter_specs(self.hf_config, self.lora, src_layout),
                    adapter_specs(self.hf_config, self.lora, dst_layout), vocab_size=vocab_size)

    def _first_source(self) -> torch.Tensor | None:
        return next(iter(_adapters_by_plan_name(self.src_model).values()), None)

    def _sources(self) -> dict[str, torch.Tensor]:
        return _adapters_by_plan_name(self.src_model)

    def engine_weights(self) -> Mapping[str, torch.Tensor]:
        return _adapters_by_plan_name(None if self.engine is None else self.engine.model)

    def sync(self) -> SyncStats:
        """The base once (adapters off), then the adapters; stats of both on the first call."""
        first = None
        if not self.base_pushed:
            with adapters_disabled(self.src_model) if self.src_model is not None else contextlib.nullcontext():
                first = self.base.sync()
            self.base_pushed = True
            self.base.shm = None  # the base never travels again: drop its model-sized shared-memory buffers
        stats = super().sync()
        if first is None:
            return stats
        return SyncStats(seconds=first.seconds + stats.seconds, bytes_sent=first.bytes_sent + stats.bytes_sent,
                         bytes_received=first.bytes_received + stats.bytes_received,
                         num_messages=first.num_messages + stats.num_messages,
                         num_collectives=first.num_collectives + stats.num_collectives,
                         num_verified=stats.num_verified)

    def _deliver(self, shards: dict[str, torch.Tensor]) -> None:
        if self.hf_names:  # vLLM: the full adapters, as PEFT names them
            self.engine.load_adapter(peft_named(shards))
        else:
            super()._deliver(shards)

    def reported(self, stats: SyncStats) -> dict[str, float]:
        """The step's sync metrics (summed over ranks): bytes each rank received from others this sync."""
        return {"sync/bytes_received": stats.bytes_received}

    def check(self) -> int:
        return super().check() + self.base.check()
