"""Export a role's weights from a trainer checkpoint as an HF folder, in one CPU process whatever world size
trained it: the checkpoint holds full tensors under HF names, streamed one at a time into HF safetensors
shards (memory: one tensor). Written to `<out>.partial` and renamed at the end."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import torch
from transformers import AutoConfig

from rlhf.checkpoint import STEP_DIR, CorruptCheckpointError, read_manifest, tensor_folders
from rlhf.checkpoint.verify import file_problem, tensor_file_problem
from rlhf.errors import CheckpointError, ConfigError
from rlhf.models.hf_export import export_config, write_metadata
from rlhf.models.hf_load import HfFolder, check_folder, folder_head
from rlhf.models.param_specs import hf_shapes
from rlhf.models.spec import ModelSpec
from rlhf.run_dir import progress

_DTYPE_CODES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64"}


def export_checkpoint(step_dir: str | Path, out_dir: str, role: str = "actor", *, tokenizer_dir: str | None = None,
                      dtype: torch.dtype | None = None, max_shard_bytes: int = 2 << 30) -> None:
    """Write `role`'s weights from the checkpoint `step_dir` as an HF folder `out_dir` (cast to `dtype`,
    default the checkpoint's), with the tokenizer and generation config from `tokenizer_dir`."""
    if role not in ("actor", "critic"):
        raise ConfigError(f"export role={role!r} is not one of actor, critic")
    if os.path.exists(out_dir):
        raise ConfigError(f"export folder {out_dir} already exists; choose a new folder")
    path = Path(step_dir)
    if path.is_symlink() or not STEP_DIR.match(path.name):
        raise CheckpointError(f"{path} is not a checkpoint folder (a step_<N> folder, never read through a symlink)")
    manifest = read_manifest(path)
    if role not in manifest.get("hf_configs", {}):
        raise CheckpointError(f"checkpoint {path} holds no {role} (roles: {sorted(manifest.get('hf_configs', {}))})")
    folder = tensor_folders(path, manifest, role)("model")
    files = sorted(set(folder.file_of.values()))
    for file in progress(files, desc="export: verify", total=len(files)):
        problem = file_problem(path / file, manifest["files"].get(file)) or tensor_file_problem(path / file, "model")
        if problem:
            raise CorruptCheckpointError(problem)
    hf_config = AutoConfig.for_model(**manifest["hf_configs"][role])
    value_head = role == "critic"
    check_folder(folder, ModelSpec.from_hf(hf_config), value_head=value_head)
    names = list(hf_shapes(ModelSpec.from_hf(hf_config), head=folder_head(folder, value_head)))
    dtype = dtype or _dtype_of(folder, names[0])
    staging = out_dir.rstrip("/") + ".partial"
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging)
    weight_map = {}
    shards = _shards(folder, names, dtype, max_shard_bytes)
    for index, shard in progress(enumerate(shards), desc="export: write", total=len(shards)):
        file = f"model-{index + 1:05d}.safetensors"
        write_streamed(os.path.join(staging, file), {name: folder.shape(name) for name in shard}, dtype,
                       lambda name: folder.slice(name)[:])
        weight_map.update({name: file for name in shard})
    write_metadata(export_config(hf_config, value_head, dtype), staging, weight_map, tokenizer_dir)
    os.rename(staging, out_dir)


def _dtype_of(folder: HfFolder, name: str) -> torch.dtype:
    code = folder.slice(name).get_dtype()
    return next(dtype for dtype, known in _DTYPE_CODES.items() if known == code)


def _shards(folder: HfFolder, names: list[str], dtype: torch.dtype, max_bytes: int) -> list[list[str]]:
    """`names` in order, cut into shards of at most `max_bytes` (a larger tensor gets a shard of its own)."""
    shards, size, item = [[]], 0, torch.empty((), dtype=dtype).element_size()
    for name in names:
        nbytes = item * _numel(folder.shape(name))
        if shards[-1] and size + nbytes > max_bytes:
            shards, size = shards + [[]], 0
        shards[-1].append(name)
        size += nbytes
    return shards


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


def write_streamed(path: str, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype, read) -> None:
    """A safetensors file of the tensors `read(name)` (cast to `dtype`) for `shapes`' names, header first, then
    one tensor at a time: memory holds a single tensor."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    item = torch.empty((), dtype=dtype).element_size()
    for name, shape in shapes.items():
        nbytes = item * _numel(shape)
        header[name] = {"dtype": _DTYPE_CODES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)) + encoded)
        for name, shape in shapes.items():
            tensor = read(name).to(dtype).contiguous()
            assert tuple(tensor.shape) == tuple(shape), (name, tensor.shape, shape)
            f.write(tensor.view(torch.uint8).numpy().tobytes())
        f.flush()
        os.fsync(f.fileno())
