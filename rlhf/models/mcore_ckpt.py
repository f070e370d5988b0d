"""A sharded model-weights folder for one tp x pp layout: what `rlhf convert hf-to-ckpt` writes.

`<folder>/rlhf_model.json` records the HF config, layout and head; `model_tp{t}_pp{p}.safetensors` holds
rank (t, p)'s shards under megatron's global parameter names. Written by dp replica 0 into
`<folder>.partial` and renamed at the end, so a failure leaves nothing at `folder`.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import torch
import torch.distributed as dist
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from rlhf.errors import CheckpointError, ConfigError
from rlhf.models.hf_load import param_specs_for, stage_params

META_FILE = "rlhf_model.json"


def _shard_file(tp_rank: int, pp_rank: int) -> str:
    return f"model_tp{tp_rank}_pp{pp_rank}.safetensors"


def read_meta(folder: str) -> dict:
    path = os.path.join(folder, META_FILE)
    if not os.path.exists(path):
        raise CheckpointError(f"{folder} is not an rlhf model checkpoint (no {META_FILE})")
    with open(path) as f:
        return json.load(f)


def save_model_shards(model: Any, folder: str) -> None:
    """Write this rank's shards (collective over the model's layout; only dp replica 0 writes)."""
    if os.path.exists(folder):
        raise ConfigError(f"checkpoint folder {folder} already exists; choose a new folder")
    groups = model.pg_collection
    staging = folder.rstrip("/") + ".partial"
    first = groups.tp.rank() == 0 and groups.pp.rank() == 0 and groups.dp.rank() == 0
    if first and os.path.exists(staging):
        shutil.rmtree(staging)
    dist.barrier(group=groups.mp)  # every rank has checked `folder` and the staging folder is fresh
    dist.barrier(group=groups.dp)
    if groups.dp.rank() == 0:
        os.makedirs(staging, exist_ok=True)
        tensors = {spec.name: param.detach().cpu().contiguous()
                   for spec, param in stage_params(model, param_specs_for(model))}
        save_file(tensors, os.path.join(staging, _shard_file(groups.tp.rank(), groups.pp.rank())))
    dist.barrier(group=groups.mp)
    if first:
        meta = {"hf_config": model.rlhf_hf_config.to_dict(), "tp": groups.tp.size(), "pp": groups.pp.size(),
                "value_head": model.rlhf_value_head}
        with open(os.path.join(staging, META_FILE), "w") as f:
            json.dump(meta, f, indent=2)
        os.rename(staging, folder)
    dist.barrier(group=groups.mp)
    dist.barrier(group=groups.dp)


@torch.no_grad()
def load_model_shards(model: Any, folder: str) -> None:
    """Copy this rank's shards from `folder` into `model`; the layouts must match (ConfigError otherwise)."""
    meta = read_meta(folder)
    groups = model.pg_collection
    if (meta["tp"], meta["pp"]) != (groups.tp.size(), groups.pp.size()):
        raise ConfigError(f"checkpoint {folder} is tp={meta['tp']} pp={meta['pp']}, the model is "
                          f"tp={groups.tp.size()} pp={groups.pp.size()}; run with the checkpoint's layout")
    shard_path = os.path.join(folder, _shard_file(groups.tp.rank(), groups.pp.rank()))
    try:
        tensors = load_file(shard_path)
    except (SafetensorError, OSError) as error:
        raise CheckpointError(f"{shard_path} is not a readable safetensors file ({error})") from None
    for spec, param in stage_params(model, param_specs_for(model)):
        if spec.name not in tensors:
            raise CheckpointError(f"{folder} is missing parameter {spec.name!r} for tp rank "
                                  f"{groups.tp.rank()} pp rank {groups.pp.rank()}")
        if tuple(tensors[spec.name].shape) != tuple(param.shape):
            raise CheckpointError(f"parameter {spec.name!r} in {folder} has shape "
                                  f"{list(tensors[spec.name].shape)}, the model expects {list(param.shape)}")
        param.copy_(tensors[spec.name])
