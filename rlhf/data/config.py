"""The `data` config section: which prompt files, how long a prompt may be, and how steps draw prompts."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Literal

from rlhf.errors import ConfigError

Truncation = Literal["error", "filter", "left", "right"]
TRUNCATIONS: tuple[str, ...] = Truncation.__args__


@dataclass(kw_only=True)
class DataConfig:
    """Prompts over `max_prompt_length` tokens raise (`error`), are dropped (`filter`), or lose their `left`
    or `right` end. Each step draws `prompts_per_step` prompts over all DP ranks, from a `seed`ed order."""

    # training prompt files, JSONL or parquet in verl's schema (a path or a list)
    train_files: list[str] | str = field(default_factory=list)
    # held-out prompt files for validation (a path or a list); empty: no validation
    val_files: list[str] | str = field(default_factory=list)
    max_prompt_length: int = 512  # prompt token limit after the chat template
    truncation: Truncation = "error"  # what happens to a longer prompt: raise, drop it, or cut its left or right end
    prompts_per_step: int = 8  # prompts per RL step over all DP ranks (rollouts = this x sampling.n)
    seed: int = 0  # seed of the prompt order
    shuffle: bool = True  # shuffle the prompts each epoch

    def __post_init__(self) -> None:
        self.train_files = [os.path.expanduser(p) for p in _as_list(self.train_files)]
        self.val_files = [os.path.expanduser(p) for p in _as_list(self.val_files)]
        if self.max_prompt_length < 1:
            raise ConfigError(f"data.max_prompt_length={self.max_prompt_length} must be >= 1")
        if self.truncation not in TRUNCATIONS:
            raise ConfigError(f"data.truncation={self.truncation!r} is not one of {', '.join(TRUNCATIONS)}")
        if self.prompts_per_step < 1:
            raise ConfigError(f"data.prompts_per_step={self.prompts_per_step} must be >= 1")
        if self.seed < 0:
            raise ConfigError(f"data.seed={self.seed} must be >= 0")


def _as_list(paths: list[str] | str) -> list[str]:
    """One file may be given as a plain string (`data.train_files=gsm8k.parquet`)."""
    return [paths] if isinstance(paths, str) else list(paths)
