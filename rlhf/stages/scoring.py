"""Rule/remote rewards for rollouts: decode each response once and score it against its prompt's record."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from rlhf.data.records import PromptRecord
from rlhf.rewards.registry import RewardConfig, build_reward
from rlhf.rollout.types import Rollouts


class Scorer:
    """`score(records, rollouts) -> rewards_r` (float32, one per rollout); errors name the sample."""

    def __init__(self, config: RewardConfig, tokenizer: Any) -> None:
        self.reward = build_reward(config)
        self.tokenizer = tokenizer

    def check_sources(self, records: Sequence[PromptRecord]) -> None:
        """Fail at start-up (not at step 37) when a data_source has no reward function."""
        if hasattr(self.reward, "check_sources"):
            self.reward.check_sources(r.data_source for r in records)

    def decode(self, rollouts: Rollouts) -> list[str]:
        return [self.tokenizer.decode(rollouts.response(i), skip_special_tokens=True)
                for i in range(rollouts.num_rollouts)]

    def score(self, records: Sequence[PromptRecord], rollouts: Rollouts) -> torch.Tensor:
        samples = [records[int(i)] for i in rollouts.prompt_index_r]
        return self.reward.score(samples, self.decode(rollouts))

    def score_components(self, records: Sequence[PromptRecord], rollouts: Rollouts,
                         keys: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """(`rewards_r`, `components_rk`): the rewards and the named components of each (GDPO; rule rewards only,
        which preflight checks)."""
        samples = [records[int(i)] for i in rollouts.prompt_index_r]
        return self.reward.score_components(samples, self.decode(rollouts), keys)

    def score_texts(self, samples: Sequence[PromptRecord], texts: list[str]) -> torch.Tensor:
        """One reward per (sample, decoded response) pair (multi-turn: each trajectory's final turn)."""
        return self.reward.score(list(samples), texts)
