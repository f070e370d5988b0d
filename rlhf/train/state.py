"""Per-rank optimizer state for exact resume on the same layout, for megatron's plain and distributed optimizers.

The distributed optimizer keeps its parameter state (main params, Adam moments) outside `state_dict()`;
its per-rank shard is saved in megatron's "dp_reshardable" form, no gather needed.
"""

from __future__ import annotations

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
            state["param_state"] = part.get_parameter_state_dp_reshardable()
        states.append(state)
    return states


def load_optimizer_state(optimizer: MegatronOptimizer, states: list[dict]) -> None:
    """Inverse of `optimizer_state` for an optimizer built the same way on the same layout."""
    parts = _parts(optimizer)
    assert len(parts) == len(states), f"optimizer has {len(parts)} parts, checkpoint {len(states)}"
    for part, state in zip(parts, states):
        part.load_state_dict(state["common"])
        if isinstance(part, DistributedOptimizer):
            part.load_parameter_state_from_dp_reshardable(state["param_state"])
