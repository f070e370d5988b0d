"""What a DP rank takes from the data side each step: prompt files read, tokenized, sharded and resumable.

Every rank reads and tokenizes the whole dataset (the same, deterministically), then takes its own slice of
each global batch through `PromptSampler`, so no collective is needed.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlhf.data.config import DataConfig
from rlhf.data.records import PromptRecord, read_records
from rlhf.data.sampler import PromptSampler
from rlhf.data.tokenize import TokenizedPrompts, tokenize_records
from rlhf.errors import ConfigError


@dataclass(kw_only=True)
class PromptStep:
    """One DP rank's prompts for one step, with their unpadded token ids (`left_pad` stacks them)."""

    records: list[PromptRecord]
    token_ids: list[list[int]]


def check_dataset_files(paths: Sequence[str], label: str) -> None:
    """`label` lists at least one file and every file exists (a ConfigError naming the key)."""
    if not paths:
        raise ConfigError(f"{label} is empty; list the .jsonl/.parquet prompt files (e.g. made by `rlhf data make`)")
    for path in paths:
        if not Path(path).is_file():
            where = "" if Path(path).is_absolute() else f" (relative to {os.getcwd()})"
            raise ConfigError(f"{label}: {path!r} is not a file{where}; point {label} at a .jsonl or .parquet "
                              "prompt file (e.g. one made by `rlhf data make`)")


def read_dataset(paths: Sequence[str], require_ground_truth: bool = True, label: str = "data.train_files") \
        -> list[PromptRecord]:
    """Concatenate the files in order; a record's `index` becomes its position in the concatenation."""
    check_dataset_files(paths, label)
    records: list[PromptRecord] = []
    for path in paths:
        offset = len(records)
        records.extend(dataclasses.replace(record, index=offset + record.index)
                       for record in read_records(path, require_ground_truth))
    return records


def load_prompts(paths: Sequence[str], tokenizer: Any, config: DataConfig, require_ground_truth: bool = True,
                 label: str = "data.train_files") -> TokenizedPrompts:
    """Read and tokenize prompt files under the config's length policy (used for train and validation sets)."""
    return tokenize_records(read_dataset(paths, require_ground_truth, label), tokenizer, config)


class PromptLoader:
    """The training prompts of one DP rank: `next_step()` each step, `state_dict()` in checkpoints; `batch_key`
    names the setting the prompts per step come from in errors."""

    def __init__(self, config: DataConfig, tokenizer: Any, *, dp_rank: int, dp_size: int,
                 require_ground_truth: bool = True, batch_key: str = "data.prompts_per_step") -> None:
        self.prompts = load_prompts(config.train_files, tokenizer, config, require_ground_truth)
        self.sampler = PromptSampler(num_samples=len(self.prompts.records), global_batch_size=config.prompts_per_step,
                                     dp_rank=dp_rank, dp_size=dp_size, seed=config.seed, shuffle=config.shuffle,
                                     batch_key=batch_key)

    def next_step(self) -> PromptStep:
        indices = self.sampler.next_indices()
        return PromptStep(records=[self.prompts.records[i] for i in indices],
                          token_ids=[self.prompts.token_ids[i] for i in indices])

    def state_dict(self) -> dict[str, Any]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state)
