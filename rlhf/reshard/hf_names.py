"""Hand-off to engines that load HF-named *full* tensors and shard them themselves (vLLM's `load_weights`).

Such an engine needs the whole model on each of its ranks, so the plan targets tp=1 over the rollout ranks;
the received megatron tensors are then split back into HF tensors by the models layer's `merge_shards`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

from rlhf.parallel.layout import ParallelLayout
from rlhf.models.param_specs import param_specs
from rlhf.models.shard_rules import merge_shards
from rlhf.models.spec import ModelSpec


def full_model_layout(dst_layout: ParallelLayout) -> ParallelLayout:
    """The layout to plan for: every rollout rank holds the full (tp=1, pp=1) model."""
    return ParallelLayout(tp=1, pp=1, dp=dst_layout.world_size, first_rank=dst_layout.first_rank)


def hf_named(hf_config: Any, full_shards: Mapping[str, torch.Tensor], *, value_head: bool = False
             ) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) for every tensor of the model, from its tp=1 megatron parameters (vocab unpadded)."""
    spec = ModelSpec.from_hf(hf_config)
    for param in param_specs(hf_config, ParallelLayout(), value_head=value_head):
        yield from merge_shards(param, [full_shards[param.name]], spec).items()
