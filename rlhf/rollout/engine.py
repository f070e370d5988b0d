"""The `RolloutEngine` protocol every engine (native, hf, vllm) implements (docs/design.md §1)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from rlhf.rollout.sampling_params import SamplingParams
from rlhf.rollout.types import PromptBatch, Rollouts


@dataclass(frozen=True)
class EngineLayout:
    """The rollout layout one engine replica runs in: tp ranks share a model, dp replicas differ in seed."""

    tp: int = 1
    dp: int = 1
    tp_rank: int = 0
    dp_rank: int = 0


@runtime_checkable
class RolloutEngine(Protocol):
    """Generate responses for prompts; take new weights; release and re-acquire memory around training."""

    layout: EngineLayout
    policy_version: int  # how many weight syncs the engine has taken; stamped on every Rollouts (checkpointed)

    def generate(self, prompts: PromptBatch, params: SamplingParams) -> Rollouts:
        """All TP ranks of a replica call this with the same prompts and get the same rollouts."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy weights in (names and sharding are the engine's own: megatron for native, HF for vllm/hf)."""

    def sleep(self, release_weights: bool = False) -> None:
        """Free the KV cache (and the weights when asked) so training can use the memory."""

    def wake(self, kv_cache: bool = True) -> None:
        """Re-acquire what `sleep` released; weights released by sleep must be re-loaded before generating.

        `kv_cache=False` re-acquires weight memory only (before a weight push, while training state is resident).
        """
