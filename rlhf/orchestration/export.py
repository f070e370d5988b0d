"""Export a role's weights from a trainer checkpoint as an HF folder, in one CPU process whatever world size
trained it: the checkpoint holds full tensors under HF names, streamed one at a time into HF safetensors
shards (memory: one tensor). Written to `<out>.partial` and renamed at the end. A LoRA actor's checkpoint
(adapters only) exports as a PEFT adapter folder or merged into its base."""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig

from rlhf.checkpoint import STEP_DIR, CorruptCheckpointError, read_manifest, tensor_folders
from rlhf.checkpoint.verify import file_problem, tensor_file_problem
from rlhf.errors import CheckpointError, ConfigError
from rlhf.models.hf_export import export_config, write_metadata
from rlhf.models.config import LoraConfig
from rlhf.models.hf_load import HfFolder, check_folder, folder_head
from rlhf.models.param_specs import hf_shapes
from rlhf.models.spec import ModelSpec
from rlhf.run_dir import progress

_DTYPE_CODES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64"}


def _verified_folder(step_dir: str | Path, out_dir: str, role: str) -> tuple[HfFolder, Any]:
    """`role`'s model tensors in checkpoint `step_dir`, every file checked against the manifest, and its HF config."""
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
    return folder, AutoConfig.for_model(**manifest["hf_configs"][role])


def export_checkpoint(step_dir: str | Path, out_dir: str, role: str = "actor", *, tokenizer_dir: str | None = None,
                      dtype: torch.dtype | None = None, max_shard_bytes: int = 2 << 30) -> None:
    """Write `role`'s weights from the checkpoint `step_dir` as an HF folder `out_dir` (cast to `dtype`,
    default the checkpoint's), with the tokenizer and generation config from `tokenizer_dir`."""
    folder, hf_config = _verified_folder(step_dir, out_dir, role)
    value_head = role == "critic"
    check_folder(folder, ModelSpec.from_hf(hf_config), value_head=value_head)
    names = list(hf_shapes(ModelSpec.from_hf(hf_config), head=folder_head(folder, value_head)))
    _write_hf(folder, names, out_dir, hf_config, value_head, dtype or _dtype_of(folder, names[0]), tokenizer_dir,
              max_shard_bytes, lambda name: folder.slice(name)[:])


def _write_hf(folder: HfFolder, names: list[str], out_dir: str, hf_config: Any, value_head: bool,
              dtype: torch.dtype, tokenizer_dir: str | None, max_shard_bytes: int,
              read: Callable[[str], torch.Tensor]) -> None:
    """An HF folder of `names` (shapes from `folder`, values from `read`), staged in `<out>.partial`."""
    staging = out_dir.rstrip("/") + ".partial"
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging)
    weight_map = {}
    shards = _shards(folder, names, dtype, max_shard_bytes)
    for index, shard in progress(enumerate(shards), desc="export: write", total=len(shards)):
        file = f"model-{index + 1:05d}.safetensors"
        write_streamed(os.path.join(staging, file), {name: folder.shape(name) for name in shard}, dtype, read)
        weight_map.update({name: file for name in shard})
    write_metadata(export_config(hf_config, value_head, dtype), staging, weight_map, tokenizer_dir)
    os.rename(staging, out_dir)


def export_lora_checkpoint(step_dir: str | Path, out_dir: str, lora: LoraConfig, base_path: str, *,
                           merged: bool = False, tokenizer_dir: str | None = None, dtype: torch.dtype | None = None,
                           max_shard_bytes: int = 2 << 30) -> None:
    """A LoRA actor's checkpoint as a PEFT adapter folder (`adapter_config.json` + `adapter_model.safetensors`,
    for `peft.PeftModel.from_pretrained` on `base_path`) or, `merged`, as the HF model W + (B A) alpha / r (what
    PEFT's `merge_and_unload` gives)."""
    adapter, hf_config = _verified_folder(step_dir, out_dir, "actor")
    if not merged:
        names = sorted(adapter.file_of)
        staging = out_dir.rstrip("/") + ".partial"
        shutil.rmtree(staging, ignore_errors=True)
        os.makedirs(staging)
        write_streamed(os.path.join(staging, "adapter_model.safetensors"), {n: adapter.shape(n) for n in names},
                       dtype or _dtype_of(adapter, names[0]), lambda name: adapter.slice(name)[:])
        with open(os.path.join(staging, "adapter_config.json"), "w") as f:
            json.dump(lora.peft_config(base_path), f, indent=2)
        os.rename(staging, out_dir)
        return
    base = HfFolder(base_path)
    check_folder(base, ModelSpec.from_hf(hf_config))
    names = list(hf_shapes(ModelSpec.from_hf(hf_config), head="lm"))

    def read(name: str) -> torch.Tensor:
        weight = base.slice(name)[:]
        a_name = f"base_model.model.{name.removesuffix('.weight')}.lora_A.weight"
        if a_name not in adapter.file_of:
            return weight
        b = adapter.slice(a_name.replace(".lora_A.", ".lora_B."))[:].float()
        return (weight.float() + (b @ adapter.slice(a_name)[:].float()) * lora.scaling).to(weight.dtype)

    _write_hf(base, names, out_dir, hf_config, False, dtype or _dtype_of(base, names[0]), tokenizer_dir,
              max_shard_bytes, read)


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
