"""Checkpoint integrity: per-file size + sha256, the manifest schema, tensor kinds, dtypes and values, the fit of a
checkpoint's tensors to the model, rank-agreed verdicts, and the replica check (dense parameters over DP, experts
over expert-DP) with rlhf's one raw-bit checksum.

Verdicts travel as JSON in uint8 tensors (`parallel.wire`, never pickled objects), and every rank takes the same
decision, so a corrupt shard on one rank stops every rank with the same one-line error instead of a partial resume.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from rlhf.errors import CheckpointError
from rlhf.models.hf_load import HfFolder, check_folder, open_safetensors
from rlhf.models.lora import lora_trained_pairs
from rlhf.parallel.wire import all_gather_json

# Bits of a parameter as integers of the same width: a checksum that any flipped bit changes.
_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_READ_BYTES = 1 << 24


def file_entry(data: bytes) -> dict[str, Any]:
    """The manifest record of one file's bytes."""
    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def entry_problem(name: str, data: bytes, entry: dict[str, Any] | None) -> str | None:
    """Why `data` (read from file `name`) does not match its manifest `entry`, or None when it does."""
    if entry is None:
        return f"{name} is not listed in the manifest"
    if len(data) != entry.get("size"):
        return f"{name} has {len(data)} bytes, the manifest says {entry.get('size')} (truncated or replaced)"
    if hashlib.sha256(data).hexdigest() != entry.get("sha256"):
        return f"{name} does not match its sha256 in the manifest (corrupted)"
    return None


def disk_entry(path: Path) -> dict[str, Any]:
    """`file_entry` of a file on disk, hashed in chunks (tensor files can be larger than memory allows)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(_READ_BYTES), b""):
            digest.update(block)
    return {"size": path.stat().st_size, "sha256": digest.hexdigest()}


def file_problem(path: Path, entry: dict[str, Any] | None) -> str | None:
    """`entry_problem` for a file on disk, read in chunks."""
    if entry is None:
        return f"{path} is not listed in the manifest"
    try:
        actual = disk_entry(path)
    except OSError as error:
        return f"{path} is unreadable ({error.strerror})"
    if actual["size"] != entry.get("size"):
        return f"{path} has {actual['size']} bytes, the manifest says {entry.get('size')} (truncated or replaced)"
    if actual["sha256"] != entry.get("sha256"):
        return f"{path} does not match its sha256 in the manifest (corrupted)"
    return None


_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_DTYPES = {"model": ("F32", "BF16", "F16")}  # weights in the run's dtype; masters and Adam moments fp32


def _count(value: Any) -> bool:
    return type(value) is int and value >= 0


def _files_problem(files: Any) -> str | None:
    if not isinstance(files, dict):
        return "has no files table"
    for name, entry in files.items():
        if "/" in name or name.startswith(".") or not name:
            return f"lists a file {name[:80]!r} outside its folder"
        if not (isinstance(entry, dict) and _count(entry.get("size")) and isinstance(entry.get("sha256"), str)
                and _SHA256.match(entry["sha256"])):
            return f"has a malformed entry for {name!r} (needs an integer size >= 0 and a sha256 hex digest)"
    return None


def _tensors_problem(tensors: Any, files: dict) -> str | None:
    if not isinstance(tensors, dict):
        return "has a malformed tensor index (role -> kind -> HF name -> file)"
    for role, kinds in tensors.items():
        if not isinstance(kinds, dict) or not all(isinstance(named, dict) for named in kinds.values()):
            return f"has a malformed tensor index for {role!r} (role -> kind -> HF name -> file)"
        for kind, named in kinds.items():
            missing = next((file for file in named.values() if not isinstance(file, str) or file not in files), None)
            if missing is not None or not all(isinstance(name, str) for name in named):
                return f"indexes {role} {kind} tensors in {str(missing)[:80]!r}, a file it does not list"
    return None


def manifest_problem(manifest: dict, step: int | None) -> str | None:
    """Why a parsed manifest breaks the schema (step >= 1 and the folder's, world size, file entries, tensor
    index), or None; `step` is the folder name's."""
    found = manifest.get("step")
    if not _count(found) or found < 1 or (step is not None and found != step):
        return f"has step={str(found)[:40]}, but its folder is step_{step} (a step is an integer >= 1)"
    if not _count(manifest.get("world_size")) or manifest["world_size"] < 1:
        return f"has world_size={str(manifest.get('world_size'))[:40]} (an integer >= 1)"
    for key in ("layouts", "models", "hf_configs"):
        if key in manifest and not isinstance(manifest[key], dict):
            return f"has a malformed {key!r} (a JSON object)"
    return _files_problem(manifest.get("files")) or _tensors_problem(manifest.get("tensors", {}), manifest["files"])


def tensor_file_problem(path: Path, kind: str) -> str | None:
    """Why the tensors of one `kind` in a checkpoint file are unfit to load, naming the tensor: a dtype the kind
    never has (e.g. I32 over a weight's bytes), NaN or inf, a negative Adam second moment; None when fit.
    A file safetensors cannot open is a CheckpointError."""
    allowed = _DTYPES.get(kind, ("F32",))
    with open_safetensors(str(path)) as handle:
        for name in handle.keys():
            dtype = handle.get_slice(name).get_dtype()
            if dtype not in allowed:
                return f"{path}: tensor {name!r} is {dtype}, but a {kind} tensor is {' or '.join(allowed)}"
            tensor = handle.get_tensor(name)
            if not bool(torch.isfinite(tensor).all()):
                return f"{path}: tensor {name!r} ({kind}) holds NaN or inf"
            if kind == "exp_avg_sq" and bool((tensor < 0).any()):
                return f"{path}: tensor {name!r} holds negative Adam second moments (exp_avg_sq is never < 0)"
    return None


MOMENTS = ("exp_avg", "exp_avg_sq")  # Adam's, stored beside the weights


def state_kinds(model: torch.nn.Module) -> tuple[str, ...]:
    """The optimizer kinds stored for `model`: the moments, plus fp32 masters unless the weights are fp32."""
    return MOMENTS if model.config.params_dtype == torch.float32 else (*MOMENTS, "master")


def check_trained_folder(folder: HfFolder, model: torch.nn.Module) -> None:
    """CheckpointError unless `folder` holds what a checkpoint of `model` holds: every base tensor (`check_folder`)
    or, for a LoRA model, this stage's adapter tensors (and a critic's value head) at their full shapes."""
    if getattr(model, "rlhf_lora", None) is None:
        check_folder(folder, model.rlhf_spec, value_head=model.rlhf_value_head)
        return
    for spec, _ in lora_trained_pairs(model):
        name = spec.hf_names[0]
        if name not in folder.file_of:
            raise CheckpointError(f"{folder.path} has no LoRA tensor {name!r} (a checkpoint of full fine-tuning, "
                                  "or of other lora.targets?)")
        if folder.shape(name) != spec.full_shape:
            raise CheckpointError(f"LoRA tensor {name!r} in {folder.path} has shape {list(folder.shape(name))}, "
                                  f"lora.rank={model.rlhf_lora.rank} expects {list(spec.full_shape)}")


def checkpoint_problem(model: torch.nn.Module, folder_of: Callable[[str], HfFolder]) -> str | None:
    """Why a checkpoint's full tensors do not fit `model`: a kind it lacks, or a missing, unexpected or wrongly
    shaped tensor of any kind (the bytes were checked against the manifest; the shapes against the model here)."""
    for kind in ("model", *state_kinds(model)):
        try:
            check_trained_folder(folder_of(kind), model)
        except CheckpointError as error:
            return f"{error} ({kind} tensors)"
    return None


def agree(problem: str | None) -> str | None:
    """Collective over the world: the first rank's problem (or None when every rank had none)."""
    return next((p for p in all_gather_json(problem) if p is not None), None)


_CHUNK = 1 << 24  # elements per checksum chunk: bounds the int64 temporaries


@torch.no_grad()
def bits_checksum(param: torch.Tensor) -> torch.Tensor:
    """Sum and position-weighted sum of a tensor's raw bits as int64 (wrapping): any flipped bit or moved element
    changes them. rlhf's one raw-bit checksum (replica checks, weight-sync verification)."""
    bits = param.detach().contiguous().view(_INT_OF_WIDTH[param.element_size()]).flatten()
    total = torch.zeros(2, dtype=torch.int64, device=bits.device)
    for start in range(0, bits.numel(), _CHUNK):
        chunk = bits[start:start + _CHUNK].to(torch.int64)
        weights = torch.arange(start, start + chunk.numel(), device=bits.device, dtype=torch.int64) % 8191 + 1
        total += torch.stack([chunk.sum(), (chunk * weights).sum()])
    return total


def param_checksums(params: list[tuple[str, torch.Tensor]]) -> tuple[list[str], torch.Tensor]:
    """Names and a `[num_params, 2]` int64 bit checksum per parameter."""
    names = [name.removeprefix("module.") for name, _ in params]
    rows = [bits_checksum(param) for _, param in params]
    return names, torch.stack(rows) if rows else torch.zeros(0, 2, dtype=torch.int64)


def _differing(role: str, params: list, group: dist.ProcessGroup | None, replicas: str) -> str | None:
    """Collective over `group`: the first parameter whose copies differ between its ranks, or None."""
    if group is None or dist.get_world_size(group) == 1:
        return None
    names, sums = param_checksums(params)
    gathered = [torch.empty_like(sums) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, sums, group=group)
    ranks = dist.get_process_group_ranks(group)
    for other_rank, other in zip(ranks[1:], gathered[1:]):
        differing = (other != gathered[0]).any(dim=1).nonzero()
        if differing.numel():
            return (f"the {role}'s {replicas} differ after loading the checkpoint: rank {ranks[0]} and rank "
                    f"{other_rank} hold different {names[int(differing[0])]} (a corrupted or mixed checkpoint)")
    return None


def replica_problem(role: str, model: torch.nn.Module | None, dp_group: dist.ProcessGroup | None,
                    expert_dp_group: dist.ProcessGroup | None = None) -> str | None:
    """On a role's members: its dense parameters must be bitwise equal over `dp_group`, its expert parameters
    (megatron marks them `allreduce=False` at ep>1: each ep rank holds other experts) over `expert_dp_group`."""
    if model is None:
        return None
    named = list(model.named_parameters())
    dense = [(name, param) for name, param in named if getattr(param, "allreduce", True)]
    experts = [(name, param) for name, param in named if not getattr(param, "allreduce", True)]
    problems = [_differing(role, dense, dp_group, "DP replicas")]
    if experts:
        problems.append(_differing(role, experts, expert_dp_group, "expert-DP replicas"))
    return next((p for p in problems if p), None)


def check_replicas(roles: dict[str, tuple[torch.nn.Module | None, Any]]) -> None:
    """Collective over the world: CheckpointError (on every rank) if any role's replicas differ; `roles` maps
    a role to its model and process groups (`dp_cp`, `expt_dp`), both None on ranks outside its mesh."""
    problems = [replica_problem(role, model, pgs.dp_cp, pgs.expt_dp) if pgs is not None else None
                for role, (model, pgs) in roles.items()]  # every role: its checks are collectives
    problem = agree(next((p for p in problems if p), None))
    if problem:
        raise CheckpointError(problem)
