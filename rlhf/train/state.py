"""A trained role's weights and Adam state in layout-free form: full tensors under HF names, for any tp/pp/dp.

Save (collective over the role's mesh): per parameter, a distributed optimizer's DP pieces of the flat state
are gathered, then the TP shards merged (`merge_shards`), so each tensor is whole; the tp-rank-0 DP ranks of a
stage take turns keeping them (each byte written once). Load: every rank reads only its own slices
(`read_shard`), whatever layout wrote them, and a distributed optimizer cuts out its DP range. Kinds: `model`,
`exp_avg`, `exp_avg_sq`, and `master` (fp32 main params) only when the weights are not fp32 themselves:
otherwise the master is the weight, stored once. A LoRA model stores its adapters only (`trained_pairs`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params, MegatronOptimizer

from rlhf.checkpoint.verify import state_kinds
from rlhf.models.hf_load import HfFolder, param_specs_for, stage_params
from rlhf.models.lora import lora_trained_pairs
from rlhf.models.param_specs import ParamSpec
from rlhf.models.shard_rules import merge_shards, read_shard
from rlhf.platform import current_device
from rlhf.platform.compat import megatron as megatron_compat

Tensors = dict[str, dict[str, torch.Tensor]]  # kind -> HF name -> full tensor


@dataclass
class _Slot:
    """Where one model parameter's optimizer state lives on this rank."""

    inner: torch.optim.Optimizer
    main: torch.Tensor  # the fp32 main param (this DP rank's flat piece under a distributed optimizer)
    piece: tuple[int, int] | None  # [start, end) of the flattened param held here; None: the whole param


def _parts(optimizer: MegatronOptimizer) -> list[MegatronOptimizer]:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _slots(optimizer: MegatronOptimizer) -> dict[int, _Slot]:
    """id(model param) -> its slot, over every part of a (chained) megatron optimizer."""
    slots = {}
    for part in _parts(optimizer):
        inner = part.optimizer
        if isinstance(part, DistributedOptimizer):
            for param, (group, order) in part.model_param_group_index_map.items():
                slots[id(param)] = _Slot(inner, inner.param_groups[group]["params"][order],
                                         megatron_compat.param_range(part, param))
        elif isinstance(part, Float16OptimizerWithFloat16Params):
            for models, mains in zip(part.float16_groups, part.fp32_from_float16_groups):
                slots.update({id(p): _Slot(inner, main, None) for p, main in zip(models, mains)})
            for group in part.fp32_from_fp32_groups:
                slots.update({id(p): _Slot(inner, p, None) for p in group})
        else:
            for group in inner.param_groups:
                slots.update({id(p): _Slot(inner, p, None) for p in group["params"]})
    return slots


def _local_state(slot: _Slot, kinds: tuple[str, ...]) -> torch.Tensor:
    """[kinds, piece] fp32: this rank's flat piece of each kind (zeros before the first step)."""
    state = slot.inner.state.get(slot.main, {})
    rows = [slot.main if kind == "master" else state.get(kind, torch.zeros_like(slot.main)) for kind in kinds]
    return torch.stack([row.detach().float().flatten() for row in rows])


def _dp_whole(local_kn: torch.Tensor, lengths: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """[kinds, numel]: every DP rank's piece, in DP-rank order (the distributed optimizer's flat layout)."""
    padded = torch.zeros(local_kn.shape[0], max(lengths), dtype=local_kn.dtype, device=local_kn.device)
    padded[:, :local_kn.shape[1]] = local_kn
    gathered = [torch.empty_like(padded) for _ in lengths]
    dist.all_gather(gathered, padded, group=group)
    return torch.cat([part[:, :n] for part, n in zip(gathered, lengths)], dim=1)


def _tp_shards(tensor: torch.Tensor, group: dist.ProcessGroup) -> list[torch.Tensor]:
    """Every tp rank's shard, on the host, never aliasing live state (a save may be written later)."""
    if group.size() == 1:
        return [tensor.detach().to("cpu", copy=True)]
    shards = [torch.empty_like(tensor) for _ in range(group.size())]
    dist.all_gather(shards, tensor.detach().contiguous(), group=group)
    return [shard.cpu() for shard in shards]


def _piece_lengths(pairs: list, slots: dict[int, _Slot], group: dist.ProcessGroup) -> list[list[int]]:
    """Per parameter, each DP rank's piece length under a distributed optimizer (one collective)."""
    local = torch.tensor([_length(slots, param) for _, param in pairs], dtype=torch.int64,
                         device=current_device())
    gathered = [torch.empty_like(local) for _ in range(group.size())]
    dist.all_gather(gathered, local, group=group)
    return torch.stack(gathered, dim=1).tolist()


def _length(slots: dict[int, _Slot], param: torch.Tensor) -> int:
    slot = slots.get(id(param))
    return 0 if slot is None else slot.piece[1] - slot.piece[0]


def _dp_group(groups: Any, spec: Any) -> dist.ProcessGroup:
    return groups.expt_dp if spec.expert is not None else groups.dp_cp  # the distributed optimizer's shards


def trained_pairs(model: torch.nn.Module) -> list[tuple[ParamSpec, torch.nn.Parameter]]:
    """What a checkpoint of `model` holds: its LoRA adapters (PEFT names) when it has them, else every base
    parameter (HF names)."""
    if getattr(model, "rlhf_lora", None) is not None:
        return lora_trained_pairs(model)
    return stage_params(model, param_specs_for(model))


def checkpoint_tensors(model: torch.nn.Module, optimizer: MegatronOptimizer) -> Tensors:
    """Collective over the role's mesh: the full tensors (kind -> HF name -> tensor) this rank writes."""
    groups, kinds = model.pg_collection, state_kinds(model)
    slots = _slots(optimizer)
    pairs = [(spec, param) for spec, param in trained_pairs(model) if not spec.tied_copy]
    sharded = any(isinstance(part, DistributedOptimizer) for part in _parts(optimizer))
    lengths = {}
    if sharded:
        lengths = {"dense": _piece_lengths(pairs, slots, groups.dp_cp)}
        if any(spec.expert is not None for spec, _ in pairs):
            lengths["expert"] = _piece_lengths(pairs, slots, groups.expt_dp)
    out: Tensors = {kind: {} for kind in ("model", *kinds)}
    for index, (spec, param) in enumerate(pairs):
        dp_group = _dp_group(groups, spec)
        if sharded:
            pieces = lengths["expert" if spec.expert is not None else "dense"][index]
            local_kn = (_local_state(slots[id(param)], kinds) if pieces[dp_group.rank()] else
                        torch.zeros(len(kinds), 0, device=param.device))
            state_kn = _dp_whole(local_kn, pieces, dp_group)
        else:
            state_kn = _local_state(slots[id(param)], kinds)
        local = {"model": param.detach(), **{kind: row.view(param.shape) for kind, row in zip(kinds, state_kn)}}
        writes = groups.tp.rank() == 0 and dp_group.rank() == index % dp_group.size()
        for kind, tensor in local.items():
            shards = _tp_shards(tensor, groups.tp)
            if writes:
                out[kind].update({name: t.contiguous() for name, t in
                                  merge_shards(spec, shards, model.rlhf_spec).items()})
    return out


def adam_step(optimizer: MegatronOptimizer) -> int:
    """The number of optimizer steps taken (one for every parameter: a skipped step skips them all)."""
    steps = {float(state["step"]) for part in _parts(optimizer) for state in part.optimizer.state.values()
             if "step" in state}
    assert len(steps) <= 1, f"parameters at different Adam steps: {sorted(steps)}"
    return int(steps.pop()) if steps else 0


@torch.no_grad()
def load_checkpoint_tensors(model: torch.nn.Module, optimizer: MegatronOptimizer,
                            folder_of: Callable[[str], HfFolder], step: int) -> None:
    """Set this rank's weights and optimizer state from full tensors (`folder_of(kind)`), on any layout."""
    groups, kinds, spec = model.pg_collection, state_kinds(model), model.rlhf_spec
    slots = _slots(optimizer)
    readers = {kind: folder_of(kind).slice for kind in ("model", *kinds)}
    for param_spec, param in trained_pairs(model):
        shard = {kind: read_shard(param_spec, read, spec, groups.tp.rank(), groups.tp.size())
                 for kind, read in readers.items()}
        param.copy_(shard["model"])
        slot = slots.get(id(param))
        if slot is None:  # a distributed optimizer holding no piece of this parameter here
            continue
        start, end = slot.piece if slot.piece is not None else (0, param.numel())
        state = slot.inner.state[slot.main]
        state["step"] = torch.tensor(float(step), dtype=torch.float32)
        for kind in kinds:
            piece = shard[kind].reshape(-1)[start:end].to(slot.main.device)
            if kind == "master":
                slot.main.copy_(piece.view_as(slot.main))
            else:
                state[kind] = piece.view_as(slot.main).to(torch.float32, copy=True)
