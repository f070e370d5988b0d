"""A PEFT LoRA adapter folder (`adapter_config.json` + `adapter_model.safetensors`: what `peft` saves and
`rlhf export` writes) as the start of a LoRA run (`lora.adapter_path`). It is checked against the base model and
the `lora` section before anything is built (preflight, `rlhf convert peft-check`), from its config and its
safetensors header alone, then copied into the model's shards (`load_peft_folder`)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from rlhf.errors import ConfigError
from rlhf.models.config import LORA_TARGETS, LoraConfig
from rlhf.models.lora import LINEARS, geometry_of, hf_module, load_adapter_tensors
from rlhf.models.spec import ModelSpec

HF_TARGETS = {f"{target}_proj": target for target in LORA_TARGETS}  # PEFT's module names -> rlhf's targets
# PEFT settings that change what an adapter computes, which rlhf's adapters do not implement: their plain value
PLAIN = {"use_rslora": False, "use_dora": False, "bias": "none", "fan_in_fan_out": False, "modules_to_save": None,
         "layers_to_transform": None, "rank_pattern": {}, "alpha_pattern": {}, "lora_bias": False}


@dataclass(frozen=True)
class PeftAdapter:
    """What a PEFT folder holds: its LoRA settings (as rlhf's targets), the base it names, its tensors' shapes."""

    folder: str
    rank: int
    alpha: float
    targets: tuple[str, ...]
    base: str  # base_model_name_or_path
    shapes: dict[str, tuple[int, ...]]

    def overrides(self) -> list[str]:
        """The settings that continue training this adapter."""
        return ["lora.enabled=true", f"lora.rank={self.rank}", f"lora.alpha={self.alpha}",
                f"lora.targets=[{','.join(self.targets)}]", f"lora.adapter_path={self.folder}"]


def read_peft_folder(folder: str) -> PeftAdapter:
    """The adapter in `folder` (config and safetensors header; no tensor is read); a ConfigError, one line, for
    anything rlhf's LoRA cannot continue from."""
    config_path, tensors_path = (os.path.join(folder, name) for name in ("adapter_config.json",
                                                                         "adapter_model.safetensors"))
    for path in (config_path, tensors_path):
        if not os.path.isfile(path):
            raise ConfigError(f"lora.adapter_path={folder} has no {os.path.basename(path)}; point it at a PEFT "
                              "adapter folder (what peft's save_pretrained or `rlhf export` writes)")
    with open(config_path) as f:
        saved = json.load(f)
    if saved.get("peft_type", "LORA") != "LORA":
        raise ConfigError(f"lora.adapter_path={folder} holds a {saved['peft_type']} adapter; rlhf continues LoRA "
                          "adapters only")
    for key, plain in PLAIN.items():
        if saved.get(key) not in (plain, None, {}, [], False):
            raise ConfigError(f"lora.adapter_path={folder} sets {key}={saved[key]!r}, which rlhf's LoRA does not "
                              f"implement; use a plain LoRA adapter ({key}={plain!r})")
    return PeftAdapter(folder=folder, rank=int(saved.get("r", 0)), alpha=float(saved.get("lora_alpha", 0)),
                       targets=_targets(saved.get("target_modules"), folder),
                       base=str(saved.get("base_model_name_or_path") or ""), shapes=_header_shapes(tensors_path))


def _targets(modules: Any, folder: str) -> tuple[str, ...]:
    if modules == "all-linear":  # PEFT's shorthand: every linear but the output head
        return LORA_TARGETS
    if not isinstance(modules, (list, tuple)) or not modules:
        raise ConfigError(f"lora.adapter_path={folder} has target_modules={modules!r}; rlhf reads a list of module "
                          f"names ({', '.join(HF_TARGETS)})")
    unknown = sorted(set(modules) - set(HF_TARGETS))
    if unknown:
        raise ConfigError(f"lora.adapter_path={folder} adapts {', '.join(unknown)}, which rlhf's LoRA cannot adapt "
                          f"(it adapts {', '.join(HF_TARGETS)}); use an adapter of those modules only")
    return tuple(target for target in LORA_TARGETS if f"{target}_proj" in modules)


def _header_shapes(path: str) -> dict[str, tuple[int, ...]]:
    with open(path, "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    return {name: tuple(entry["shape"]) for name, entry in header.items() if name != "__metadata__"}


def expected_shapes(hf_config: Any, rank: int, targets: tuple[str, ...]) -> dict[str, tuple[int, ...]]:
    """PEFT name -> full shape of every adapter tensor of `targets` at `rank` on the HF model of `hf_config`."""
    spec = ModelSpec.from_hf(hf_config)
    routed = spec.moe.moe_layers if spec.moe else (False,) * spec.num_layers
    shapes = {}
    for layer in range(spec.num_layers):
        for linear_name, (owner, linear_targets, _) in LINEARS.items():
            if owner == "mlp" and routed[layer]:
                continue  # a routed layer has no dense MLP to adapt
            geometry = geometry_of(spec, linear_name, 1)
            for target in (t for t in linear_targets if t in targets):
                prefix = f"base_model.model.{hf_module(layer, linear_name, target)}"
                shapes[f"{prefix}.lora_A.weight"] = (rank, geometry.in_features)
                shapes[f"{prefix}.lora_B.weight"] = (geometry.out_features[target], rank)
    return shapes


def check_peft_adapter(adapter: PeftAdapter, hf_config: Any, lora: LoraConfig) -> None:
    """ConfigError when `adapter` is not one the `lora` section can continue on the base model of `hf_config`."""
    found = {"r": adapter.rank, "lora_alpha": adapter.alpha, "targets": list(adapter.targets)}
    wanted = {"r": lora.rank, "lora_alpha": lora.alpha, "targets": [t for t in LORA_TARGETS if t in lora.targets]}
    if found != wanted:
        raise ConfigError(f"lora.adapter_path={adapter.folder} holds an adapter with {found}, the lora section asks "
                          f"for {wanted}; set {' '.join(adapter.overrides()[1:4])}")
    expected = expected_shapes(hf_config, adapter.rank, adapter.targets)
    names = sorted(set(expected) ^ set(adapter.shapes))
    if names:
        raise ConfigError(f"lora.adapter_path={adapter.folder} holds {len(adapter.shapes)} adapter tensors, the "
                          f"{ModelSpec.from_hf(hf_config).num_layers}-layer base (model.path) takes {len(expected)} "
                          f"(first difference {names[0]!r}): it adapts another base ({adapter.base!r})")
    for name, shape in expected.items():
        if adapter.shapes[name] != shape:
            raise ConfigError(f"lora.adapter_path={adapter.folder}: {name!r} has shape {list(adapter.shapes[name])}, "
                              f"the base (model.path) needs {list(shape)}: it adapts another base ({adapter.base!r})")


def load_peft_folder(model: Any, folder: str) -> None:
    """Start `model`'s adapters (`apply_lora` done) from a PEFT adapter folder, checked first."""
    from safetensors.torch import load_file

    check_peft_adapter(read_peft_folder(folder), model.rlhf_hf_config, model.rlhf_lora)
    load_adapter_tensors(model, load_file(os.path.join(folder, "adapter_model.safetensors")))
