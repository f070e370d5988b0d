"""Export a megatron model on any tp x pp layout back to an HF folder that `transformers` loads.

Collective over every rank of the model's layout. Parameters are gathered over tp one at a time; the
tp-rank-0 of each stage in dp replica 0 writes its own safetensors shards (with expert parallelism, each
expert's weights are written by the tp-rank-0 of the first expert-dp replica holding them), then stage 0
writes the index, config and tokenizer files. Everything goes to `<out>.partial` first and is renamed at the end, so a
failed export leaves no folder behind at `out`.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from rlhf.parallel.wire import all_gather_json
from rlhf.errors import ConfigError
from rlhf.models.hf_load import INDEX_FILE, experts_per_rank, param_specs_for, stage_params
from rlhf.models.lora import merged_weight
from rlhf.models.shard_rules import merge_shards
from rlhf.models.spec import CAUSAL_LM_ARCHS, SEQ_CLS_ARCHS

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "tokenizer.model", "added_tokens.json", "chat_template.jinja",
                   "chat_template.json", "generation_config.json")


class _ShardWriter:
    """Buffers HF tensors and writes a safetensors file each time the buffer passes `max_bytes`."""

    def __init__(self, folder: str, prefix: str, max_bytes: int) -> None:
        self.folder, self.prefix, self.max_bytes = folder, prefix, max_bytes
        self.buffer: dict[str, torch.Tensor] = {}
        self.weight_map: dict[str, str] = {}
        self.num_files = 0

    def add(self, tensors: dict[str, torch.Tensor]) -> None:
        self.buffer.update({name: t.detach().cpu().contiguous() for name, t in tensors.items()})
        if sum(t.numel() * t.element_size() for t in self.buffer.values()) >= self.max_bytes:
            self.flush()

    def flush(self) -> None:
        if not self.buffer:
            return
        name = f"{self.prefix}-{self.num_files:05d}.safetensors"
        save_file(self.buffer, os.path.join(self.folder, name), metadata={"format": "pt"})
        self.weight_map.update({tensor: name for tensor in self.buffer})
        self.buffer, self.num_files = {}, self.num_files + 1


def export_config(hf_config: Any, value_head: bool, dtype: torch.dtype) -> Any:
    """A copy of `hf_config` naming the HF class that loads the export (causal LM or scalar-score model)."""
    config = hf_config.__class__.from_dict(hf_config.to_dict())
    archs = SEQ_CLS_ARCHS if value_head else CAUSAL_LM_ARCHS
    config.architectures = [next(arch for arch, kind in archs.items() if kind == config.model_type)]
    if value_head:
        config.num_labels = 1
    config.dtype = dtype
    return config


def write_metadata(config: Any, folder: str, weight_map: dict[str, str], tokenizer_dir: str | None) -> None:
    """The index, config and tokenizer (+ generation config) files of an HF folder whose shards are written."""
    total = sum(os.path.getsize(os.path.join(folder, f)) for f in set(weight_map.values()))
    with open(os.path.join(folder, INDEX_FILE), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
    config.save_pretrained(folder)
    for name in TOKENIZER_FILES if tokenizer_dir else ():
        source = os.path.join(tokenizer_dir, name)
        if os.path.exists(source):
            shutil.copyfile(source, os.path.join(folder, name))


def export_hf(model: Any, out_dir: str, *, tokenizer_dir: str | None = None, dtype: torch.dtype | None = None,
              max_shard_bytes: int = 2 << 30) -> None:
    """Write `model` (this rank's part of it; call on every rank of its layout) as an HF folder `out_dir`.

    Tensors are cast to `dtype` (default: the model's own) as they are written; a LoRA model is written merged
    (W + (alpha / r) B A, PEFT's `merge_and_unload`).
    """
    if os.path.exists(out_dir):
        raise ConfigError(f"export folder {out_dir} already exists; choose a new folder")
    groups = model.pg_collection
    tp_group, pp_group = groups.tp, groups.pp
    dtype = dtype or next(model.parameters()).dtype
    is_writer = tp_group.rank() == 0 and groups.dp_cp.rank() == 0  # replicas: dp x cp
    is_expert_writer = tp_group.rank() == 0 and groups.expt_dp.rank() == 0
    staging = out_dir.rstrip("/") + ".partial"
    if is_writer and pp_group.rank() == 0 and os.path.exists(staging):
        shutil.rmtree(staging)
    dist.barrier(group=groups.mp)  # these two barriers: every rank of the layout has checked `out_dir`
    dist.barrier(group=groups.dp_cp)  # (and the stale staging folder is gone) before anyone writes
    ep_part = f"-ep{groups.ep.rank():03d}" if groups.ep.size() > 1 else ""
    writer = _ShardWriter(staging, f"model-stage{pp_group.rank():03d}{ep_part}", max_shard_bytes)
    if is_writer or is_expert_writer:
        os.makedirs(staging, exist_ok=True)
    per_stage = model.rlhf_spec.num_layers // pp_group.size()
    for param_spec, param in stage_params(model, param_specs_for(model)):
        if param_spec.tied_copy:
            continue
        param = merged_weight(model, param_spec.local_name(per_stage, experts_per_rank(model)), param)
        shards = [torch.empty_like(param) for _ in range(tp_group.size())]
        dist.all_gather(shards, param.detach().contiguous(), group=tp_group)
        if is_expert_writer if param_spec.expert is not None else is_writer:
            merged = merge_shards(param_spec, shards, model.rlhf_spec)
            writer.add({name: tensor.to(dtype) for name, tensor in merged.items()})
    writer.flush()
    # tp x ep x pp ranks of one expert-dp replica: every writer of replica 0 (just the pp group's ranks at ep=1)
    maps = all_gather_json(writer.weight_map, group=groups.tp_ep_pp)
    if is_writer and pp_group.rank() == 0:
        write_metadata(export_config(model.rlhf_hf_config, model.rlhf_value_head, dtype), staging,
                       {k: v for m in maps for k, v in m.items()}, tokenizer_dir)
        os.rename(staging, out_dir)
    dist.barrier(group=groups.mp)  # the folder is in place for every rank of the layout, other dp replicas too
    dist.barrier(group=groups.dp_cp)
