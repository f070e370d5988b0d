"""The tp shard rules of `param_specs` kinds, both ways: HF tensors -> rank's shard, all shards -> HF tensors.

`read_shard` takes slice readers (safetensors `get_slice` objects or tensors) so a rank reads only the rows
or columns it owns; `merge_shards` rebuilds the HF tensors from every tp rank's shard.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from rlhf.models.param_specs import ParamSpec
from rlhf.models.spec import ModelSpec

SliceReader = Callable[[str], Any]  # hf name -> object supporting [a:b] and [:, a:b] (tensor or safetensors slice)


def _rows(source: Any, start: int, stop: int) -> torch.Tensor:
    return source[start:stop]


def _qkv_shard(param: ParamSpec, read: SliceReader, spec: ModelSpec, tp_rank: int, tp: int) -> torch.Tensor:
    d, per_group = spec.head_dim, spec.num_heads // spec.num_kv_heads
    groups = spec.num_kv_heads // tp
    first = tp_rank * groups
    q_name, k_name, v_name = param.hf_names
    q = _rows(read(q_name), first * per_group * d, (first + groups) * per_group * d)
    k = _rows(read(k_name), first * d, (first + groups) * d)
    v = _rows(read(v_name), first * d, (first + groups) * d)
    tail = q.shape[1:]
    parts = (q.reshape(groups, per_group * d, *tail), k.reshape(groups, d, *tail), v.reshape(groups, d, *tail))
    return torch.cat(parts, dim=1).reshape(-1, *tail)


def _vocab_shard(param: ParamSpec, read: SliceReader, vocab_size: int, tp_rank: int, tp: int) -> torch.Tensor:
    source = read(param.hf_names[0])
    rows = param.full_shape[0] // tp
    start = tp_rank * rows
    stop = min(start + rows, vocab_size)
    if stop <= start:  # this rank holds padding only
        return torch.zeros(rows, *param.full_shape[1:], dtype=_rows(source, 0, 1).dtype)
    real = _rows(source, start, stop)
    padding = real.new_zeros(rows - (stop - start), *real.shape[1:])
    return torch.cat([real, padding], dim=0)


def read_shard(param: ParamSpec, read: SliceReader, spec: ModelSpec, tp_rank: int, tp: int) -> torch.Tensor:
    """This tp rank's shard of `param`, reading only the needed slices through `read`."""
    if param.kind == "replicated":
        return read(param.hf_names[0])[:]
    if param.kind == "row":
        columns = param.full_shape[1] // tp
        return read(param.hf_names[0])[:, tp_rank * columns:(tp_rank + 1) * columns]
    if param.kind == "rows":
        rows = param.full_shape[0] // tp
        return _rows(read(param.hf_names[0]), tp_rank * rows, (tp_rank + 1) * rows)
    if param.kind == "vocab":
        return _vocab_shard(param, read, spec.vocab_size, tp_rank, tp)
    if param.kind == "qkv":
        return _qkv_shard(param, read, spec, tp_rank, tp)
    assert param.kind == "gate_up", param.kind
    rows = param.full_shape[0] // 2 // tp
    gate, up = (read(name)[tp_rank * rows:(tp_rank + 1) * rows] for name in param.hf_names)
    return torch.cat([gate, up], dim=0)


def merge_shards(param: ParamSpec, shards: list[torch.Tensor], spec: ModelSpec) -> dict[str, torch.Tensor]:
    """The HF tensors of `param` rebuilt from every tp rank's shard (in tp rank order)."""
    if param.kind == "replicated":
        return {param.hf_names[0]: shards[0]}
    if param.kind == "row":
        return {param.hf_names[0]: torch.cat(shards, dim=1)}
    if param.kind == "rows":
        return {param.hf_names[0]: torch.cat(shards, dim=0)}
    if param.kind == "vocab":
        return {param.hf_names[0]: torch.cat(shards, dim=0)[: spec.vocab_size]}
    if param.kind == "gate_up":
        halves = [shard.chunk(2, dim=0) for shard in shards]
        gate_name, up_name = param.hf_names
        return {gate_name: torch.cat([g for g, _ in halves]), up_name: torch.cat([u for _, u in halves])}
    assert param.kind == "qkv", param.kind
    d, per_group = spec.head_dim, spec.num_heads // spec.num_kv_heads
    q_parts, k_parts, v_parts = [], [], []
    for shard in shards:
        tail = shard.shape[1:]
        grouped = shard.reshape(-1, (per_group + 2) * d, *tail)
        q, k, v = grouped.split([per_group * d, d, d], dim=1)
        q_parts.append(q.reshape(-1, *tail))
        k_parts.append(k.reshape(-1, *tail))
        v_parts.append(v.reshape(-1, *tail))
    q_name, k_name, v_name = param.hf_names
    return {q_name: torch.cat(q_parts), k_name: torch.cat(k_parts), v_name: torch.cat(v_parts)}
