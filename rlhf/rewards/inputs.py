"""The per-sample fields every reward (rule or remote) reads, in batch order."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rlhf.data.records import Prompt, PromptRecord


@dataclass(kw_only=True)
class RewardInputs:
    """The per-sample fields a reward needs, in batch order (one entry per response)."""

    data_sources: list[str]
    ground_truths: list[str | None]
    extra_infos: list[dict[str, Any]]
    indices: list[int]
    prompts: list[Prompt] | None = None

    @classmethod
    def from_records(cls, records: Sequence[PromptRecord]) -> RewardInputs:
        return cls(data_sources=[r.data_source for r in records], ground_truths=[r.ground_truth for r in records],
                   extra_infos=[r.extra_info for r in records], indices=[r.index for r in records],
                   prompts=[r.prompt for r in records])
