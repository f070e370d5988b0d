"""Megatron's MoE layer at tensor parallel > 1 while the rest of the model stays tensor-parallel without
sequence parallelism (attention, dense MLPs, embedding and the fused head are unchanged).

megatron-core 0.16.1's token dispatchers expect each tp rank to hold its own share of the tokens (they gather
over tp x ep and reduce-scatter back), and its MoELayer refuses to train at tp > 1 otherwise. Here only the
experts run sequence-parallel, as an island: the router runs on every token on every tp rank, exactly as at
tp = 1 (so its losses, routing replay and the routing metrics are tp = 1's, and its weight gradient is
complete on each rank like any replicated parameter's); then the tokens, routing probabilities and map are
padded to a multiple of tp, each rank keeps its contiguous share for dispatch, experts and combine, and the
outputs are all-gathered back. Each expert is split over tp (megatron's expert-tensor-parallel size = tp).
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.mappings import (gather_from_sequence_parallel_region,
                                                    scatter_to_sequence_parallel_region)
from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
from megatron.core.transformer.spec_utils import ModuleSpec

from rlhf.platform.compat import megatron as megatron_compat


def _replicated_router(router_class: Any, *, config: Any, pg_collection: ProcessGroupCollection) -> Any:
    """The router on groups without tp: it sees every token of this cp rank, so nothing of it is reduced over
    tp (its load-balancing counts are over cp alone)."""
    single = pg_collection.inter_dist_opt  # this rank alone (`rlhf.parallel.groups`)
    assert single.size() == 1
    cp = pg_collection.cp
    groups = ProcessGroupCollection(tp=single, cp=cp, tp_cp=cp, tp_dp_cp=pg_collection.dp_cp)
    return router_class(config=config, pg_collection=groups)


class TensorParallelMoELayer(MoELayer):
    """MoELayer whose dispatch, experts and combine run on this tp rank's share of the tokens (module
    docstring); built from the spec `tensor_parallel_moe_spec` makes."""

    def __init__(self, config: Any, submodules: MoESubmodules, layer_number: int | None = None,
                 pg_collection: ProcessGroupCollection | None = None) -> None:
        assert not (config.moe_shared_expert_intermediate_size or config.moe_latent_size)
        submodules = dataclasses.replace(submodules, router=partial(_replicated_router, submodules.router))
        super().__init__(config, submodules, layer_number=layer_number, pg_collection=pg_collection)

    def forward(self, hidden_states: torch.Tensor, intermediate_tensors: Any = None,
                padding_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, None]:
        """[s, b, h] -> ([s, b, h], None) like MoELayer; `padding_mask` [b, s] is True on padding."""
        assert intermediate_tensors is None
        if padding_mask is not None:
            padding_mask = padding_mask.transpose(0, 1).bool()
        probs_ne, routing_map_ne = self.route(hidden_states, padding_mask)
        num_tokens, tp = probs_ne.shape[0], self.tp_group.size()
        pad = -num_tokens % tp
        tokens_nh = F.pad(hidden_states.reshape(num_tokens, -1), (0, 0, 0, pad))
        local_nh = scatter_to_sequence_parallel_region(tokens_nh, group=self.tp_group)
        local_probs = scatter_to_sequence_parallel_region(F.pad(probs_ne, (0, 0, 0, pad)), group=self.tp_group)
        share = local_nh.shape[0]
        local_map = F.pad(routing_map_ne, (0, 0, 0, pad))[self.tp_group.rank() * share:][:share]
        local_nh, local_probs = self.preprocess(local_nh.unsqueeze(1), local_probs, local_map)
        dispatched, dispatched_probs = self.dispatch(local_nh, local_probs)
        output, _ = self.routed_experts_compute(dispatched, dispatched_probs)
        output = self.postprocess(self.combine(output), None)
        gathered = gather_from_sequence_parallel_region(output.reshape(share, -1), tensor_parallel_output_grad=False,
                                                        group=self.tp_group)
        return gathered[:num_tokens].view_as(hidden_states), None


megatron_compat.silence_unknown_mlp_warning()  # megatron warns about MLP classes it does not list, as this one


def tensor_parallel_moe_spec(block_spec: Any, pg_collection: ProcessGroupCollection) -> Any:
    """`block_spec` (megatron's decoder block spec) with each MoELayer made a `TensorParallelMoELayer` on the
    groups `pg_collection` (megatron's TransformerLayer hands groups only to the MoE classes it knows)."""
    layers = []
    for layer in block_spec.layer_specs:
        mlp = layer.submodules.mlp
        if isinstance(mlp, ModuleSpec) and mlp.module is MoELayer:
            mlp = dataclasses.replace(mlp, module=TensorParallelMoELayer,
                                      params={**mlp.params, "pg_collection": pg_collection})
            layer = dataclasses.replace(layer, submodules=dataclasses.replace(layer.submodules, mlp=mlp))
        layers.append(layer)
    return dataclasses.replace(block_spec, layer_specs=layers)
