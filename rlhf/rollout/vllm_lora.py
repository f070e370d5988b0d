"""`lora.sync: adapter` into vLLM: the engine holds the base once and takes each policy version's adapter
through vLLM's public LoRA support (`LLM(enable_lora=True, ...)`, one `LoRARequest` per version).

vLLM 0.32 loads a LoRA adapter from a PEFT folder only (no public in-memory route), so the engine's N-th adapter
push writes `<run>/lora_sync/v<N>/` (`adapter_config.json` + `adapter_model.safetensors`, the exporter's format)
on the rollout world's first rank, and every rank of the engine registers it under the id N (never reused: vLLM
keeps what it holds under a known id). The engine keeps `slots` = trainer.max_staleness + 1 adapters (vLLM's
`max_loras`), so a request finishes under the adapter it started with; a folder is removed once it falls out of
the slots, and the whole tree at `close()`.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rlhf.errors import ConfigError
from rlhf.models.config import LoraConfig

# the adapter ranks vLLM 0.32 builds buffers for (`LoRAConfig.max_lora_rank`); a rank between two takes the next
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
ADAPTER_FOLDER = "lora_sync"  # under the run folder


@dataclass(frozen=True)
class VllmLoraSpec:
    """What a vLLM engine needs to take adapters: their shape (`lora`), the base they sit on (`base_path`, named
    in each adapter's config), the run's folder for the adapters and how many of them stay loaded."""

    lora: LoraConfig
    base_path: str
    folder: str  # <run>/lora_sync
    slots: int  # trainer.max_staleness + 1

    def __post_init__(self) -> None:
        if self.lora.rank > VLLM_LORA_RANKS[-1]:
            raise ConfigError(f"lora.rank={self.lora.rank} exceeds vLLM's largest LoRA rank {VLLM_LORA_RANKS[-1]}; "
                              "lower lora.rank or use lora.sync=merged")
        if self.slots < 1:
            raise ConfigError(f"vLLM LoRA slots={self.slots} must be >= 1 (trainer.max_staleness + 1)")

    def llm_options(self) -> dict[str, Any]:
        """vLLM's LoRA engine arguments: `slots` adapters resident, buffers of the smallest rank that holds ours."""
        max_rank = next(rank for rank in VLLM_LORA_RANKS if rank >= self.lora.rank)
        return {"enable_lora": True, "max_loras": self.slots, "max_cpu_loras": self.slots,
                "max_lora_rank": max_rank}


class AdapterFolders:
    """The PEFT folder of each adapter push under `spec.folder`, written by `is_writer` (one rank of the
    engine's world; the others read it after the engine's barrier), the newest `spec.slots` kept."""

    def __init__(self, spec: VllmLoraSpec, is_writer: bool) -> None:
        self.spec, self.is_writer = spec, is_writer
        self.numbers: list[int] = []

    def path(self, number: int) -> Path:
        return Path(self.spec.folder) / f"v{number}"

    def write(self, number: int, tensors: Mapping[str, torch.Tensor]) -> Path:
        """Write push `number`'s adapter (full PEFT-named tensors) and drop the folders no slot holds."""
        from safetensors.torch import save_file

        path = self.path(number)
        if self.is_writer:
            staging = path.with_name(path.name + ".partial")
            shutil.rmtree(staging, ignore_errors=True)
            shutil.rmtree(path, ignore_errors=True)  # a crashed run's leftover of the same number
            staging.mkdir(parents=True)
            save_file({name: t.detach().cpu().contiguous() for name, t in tensors.items()},
                      str(staging / "adapter_model.safetensors"), metadata={"format": "pt"})
            (staging / "adapter_config.json").write_text(json.dumps(self.spec.lora.peft_config(self.spec.base_path),
                                                                    indent=2))
            os.rename(staging, path)
        self.numbers.append(number)
        for old in self.numbers[:-self.spec.slots]:
            if self.is_writer:
                shutil.rmtree(self.path(old), ignore_errors=True)
        self.numbers = self.numbers[-self.spec.slots:]
        return path

    def remove_all(self) -> None:
        """At engine close: no request can use any adapter any more."""
        if self.is_writer:
            shutil.rmtree(self.spec.folder, ignore_errors=True)
        self.numbers = []
