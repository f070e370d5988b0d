"""Per-rank optimizer state for exact resume on the same layout, for megatron's plain and distributed optimizers.

The distributed optimizer keeps its parameter state (main params, Adam moments) outside `state_dict()`;
its per-rank shard is saved in megatron's "dp_reshardable" form, no gather needed.
"""

from __future__ import annotations

import torch
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer.optimizer import MegatronOptimizer


def _parts(optimizer: MegatronOptimizer) -> list[MegatronOptimizer]:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def optimizer_state(optimizer: MegatronOptimizer) -> list[dict]:
    """One dict per underlying megatron optimizer (a ChainedOptimizer has several)."""
    states = []
    for part in _parts(optimizer):
        state = {"common": part.state_dict()}
        if isinstance(part, DistributedOptimizer):
            state["param_state"] = _mark_unpadded(part.get_parameter_state_dp_reshardable())
        states.append(state)
    return states


def _mark_unpadded(param_state: dict) -> dict:
    """Add the `padding: False` flag megatron 0.16.1's dp_reshardable loader requires but its getter omits."""
    for key, per_dtype in param_state.items():
        if isinstance(key, int):
            for buckets in per_dtype.values():
                for bucket in buckets:
                    for entry in bucket:
                        entry["padding"] = False
    return param_state


def load_optimizer_state(optimizer: MegatronOptimizer, states: list[dict]) -> None:
    """Inverse of `optimizer_state` for an optimizer built the same way on the same layout."""
    parts = _parts(optimizer)
    assert len(parts) == len(states), f"optimizer has {len(parts)} parts, checkpoint {len(states)}"
    for part, state in zip(parts, states):
        part.load_state_dict(state["common"])
        if isinstance(part, DistributedOptimizer):
            with torch.no_grad():  # it copies into views of leaf params
                part.load_parameter_state_from_dp_reshardable(state["param_state"])
            _unshare_steps(part.optimizer)
        _own_storages(part.optimizer)


def _own_storages(inner: torch.optim.Optimizer) -> None:
    """State tensors adopted from `torch.load` live in fixed-size storages that offload cannot free in place
    (`UntypedStorage.resize_` refuses them): give each its own allocation."""
    for param_state in inner.state.values():
        for key, value in param_state.items():
            if isinstance(value, torch.Tensor) and not value.untyped_storage().resizable():
                param_state[key] = value.clone()


def _unshare_steps(inner: torch.optim.Optimizer) -> None:
    """megatron 0.16.1's distributed-optimizer load gives every param ONE shared `step` tensor; torch's AdamW
    then increments it once per param per step (wrong bias correction). Give each param its own copy."""
    for param_state in inner.state.values():
        if isinstance(param_state.get("step"), torch.Tensor):
            param_state["step"] = param_state["step"].clone()
