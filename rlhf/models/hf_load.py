"""Stream an HF safetensors folder into one rank's megatron model: each rank reads only its own slices.

The folder is checked against the config before any weight is touched: a missing, unexpected or
wrongly-shaped tensor is a one-line CheckpointError naming it.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from rlhf.parallel.layout import ParallelLayout
from rlhf.errors import CheckpointError
from rlhf.models.lora import is_adapter_param
from rlhf.models.param_specs import ParamSpec, hf_shapes, param_specs
from rlhf.models.shard_rules import read_shard
from rlhf.models.spec import ModelSpec

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def open_safetensors(path: str) -> Any:
    """`safe_open(path)`; a missing, truncated or malformed file is a one-line CheckpointError naming it."""
    try:
        return safe_open(path, framework="pt")
    except (SafetensorError, OSError) as error:
        raise CheckpointError(f"{path} is not a readable safetensors file ({error}); re-download or re-export "
                              "the model") from None


class HfFolder:
    """Lazy view of an HF folder's safetensors: names, shapes, and slices read on demand."""

    def __init__(self, path: str) -> None:
        self.path = path
        index_path, single_path = os.path.join(path, INDEX_FILE), os.path.join(path, SINGLE_FILE)
        if os.path.exists(index_path):
            with open(index_path) as f:
                self.file_of = dict(json.load(f)["weight_map"])
        elif os.path.exists(single_path):
            with open_safetensors(single_path) as handle:
                self.file_of = {name: SINGLE_FILE for name in handle.keys()}
        else:
            raise CheckpointError(f"{path} has neither {SINGLE_FILE} nor {INDEX_FILE}")
        self._handles: dict[str, Any] = {}

    @classmethod
    def of_files(cls, path: str, file_of: dict[str, str]) -> HfFolder:
        """A view of tensors named in `file_of` (name -> file under `path`), e.g. a training checkpoint's."""
        folder = cls.__new__(cls)
        folder.path, folder.file_of, folder._handles = path, dict(file_of), {}
        return folder

    def _handle(self, name: str) -> Any:
        file = self.file_of[name]
        if file not in self._handles:
            self._handles[file] = open_safetensors(os.path.join(self.path, file))
        return self._handles[file]

    def slice(self, name: str) -> Any:
        """A lazy slice of tensor `name`: indexing it reads only the selected rows/columns from disk."""
        return self._handle(name).get_slice(name)

    def shape(self, name: str) -> tuple[int, ...]:
        """From the file header; reads no tensor data."""
        return tuple(self._handle(name).get_slice(name).get_shape())


def folder_head(folder: HfFolder, value_head: bool) -> str:
    """Which head the folder provides for this model: "lm", "score", or "none" (value head starts fresh)."""
    if not value_head:
        return "lm"
    return "score" if "score.weight" in folder.file_of else "none"


def check_folder(folder: HfFolder, spec: ModelSpec, *, value_head: bool = False) -> None:
    """CheckpointError naming the first missing, unexpected or wrongly shaped tensor."""
    head = folder_head(folder, value_head)
    expected = hf_shapes(spec, head=head)
    optional = {"lm_head.weight"} if spec.tie_embeddings or head != "lm" else set()
    for name, shape in expected.items():
        if name not in folder.file_of:
            raise CheckpointError(f"{folder.path} is missing tensor {name!r} (config expects shape {list(shape)})")
        if folder.shape(name) != shape:
            raise CheckpointError(f"tensor {name!r} in {folder.path} has shape {list(folder.shape(name))}, "
                                  f"config expects {list(shape)}")
    for name in sorted(folder.file_of):
        if name not in expected and name not in optional:
            raise CheckpointError(f"{folder.path} has unexpected tensor {name!r} (not in a "
                                  f"{spec.model_type} model with {spec.num_layers} layers)")


def model_layout(model: Any) -> tuple[ParallelLayout, int, int]:
    """(tp x cp x dp x pp layout with its ep, tp rank, pp rank) of a model built by `build_gpt`, read from its
    groups."""
    groups = model.pg_collection
    layout = ParallelLayout(tp=groups.tp.size(), pp=groups.pp.size(), dp=groups.dp.size(), ep=groups.ep.size(),
                            cp=groups.cp.size())
    return layout, groups.tp.rank(), groups.pp.rank()


# The Transformer-Engine spec fuses the pre-attention/pre-MLP norms into the following linear layer.
TE_NORM_NAMES = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
                 "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}


def _module_name(params: dict, local_name: str) -> str:
    if local_name in params:
        return local_name
    for local_suffix, te_suffix in TE_NORM_NAMES.items():
        if local_name.endswith(local_suffix):
            return local_name[: -len(local_suffix)] + te_suffix
    return local_name


def experts_per_rank(model: Any) -> int | None:
    """How many experts each expert-parallel rank of `model` holds (None for a dense model)."""
    moe = model.rlhf_spec.moe
    return None if moe is None else moe.num_experts // model.pg_collection.ep.size()


def stage_params(model: Any, specs: list[ParamSpec]) -> list[tuple[ParamSpec, torch.nn.Parameter]]:
    """This rank's (spec, parameter) pairs; asserts the model has exactly the base parameters the specs list
    (LoRA adapters are not base parameters: `rlhf.models.lora`)."""
    layout, _, pp_rank = model_layout(model)
    per_stage = model.rlhf_spec.num_layers // layout.pp
    per_ep_rank, ep_rank = experts_per_rank(model), model.pg_collection.ep.rank()
    params = {name: param for name, param in model.named_parameters() if not is_adapter_param(name)}
    mine = [(p, params[_module_name(params, p.local_name(per_stage, per_ep_rank))]) for p in specs
            if p.pp_stage == pp_rank and p.ep_rank(per_ep_rank or 1) in (None, ep_rank)]
    assert len(mine) == len(params), (sorted(params), [p.name for p, _ in mine])
    return mine


@torch.no_grad()
def load_hf_weights(model: Any, path: str) -> None:
    """Copy the HF folder at `path` into `model` (this rank's stage and tp shard only)."""
    folder = HfFolder(path)
    spec: ModelSpec = model.rlhf_spec
    value_head = model.rlhf_value_head
    check_folder(folder, spec, value_head=value_head)
    layout, tp_rank, _ = model_layout(model)
    fresh_head = value_head and folder_head(folder, value_head) == "none"
    for param_spec, param in stage_params(model, param_specs_for(model)):
        if fresh_head and param_spec.name == "output_layer.weight":
            continue
        shard = read_shard(param_spec, folder.slice, spec, tp_rank, layout.tp)
        assert tuple(shard.shape) == tuple(param.shape), (param_spec.name, shard.shape, param.shape)
        if not torch.isfinite(shard).all():  # safetensors has no checksum: flipped exponent bits show up here
            raise CheckpointError(f"{param_spec.name} read from {path} holds NaN/inf values (a corrupted "
                                  "safetensors file?); re-download or re-export the model")
        param.copy_(shard)


def param_specs_for(model: Any) -> list[ParamSpec]:
    """`param_specs` of a model built by `build_gpt` on its own layout."""
    layout, _, _ = model_layout(model)
    return param_specs(model.rlhf_hf_config, layout, value_head=model.rlhf_value_head)
