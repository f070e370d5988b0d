"""DAPO dynamic sampling over global batches: keep the groups whose rewards differ, across generation rounds.

Every rank holds the same gathered rounds and decides with the same pure functions, so all ranks agree on the
kept set and on how many rounds (loader batches) a step consumes; the sampler position stays exact for resume.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from rlhf.algo.dapo import informative_rows
from rlhf.algo.groups import Groups
from rlhf.stages.batch import RolloutBatch
from rlhf.stages.exchange import concat_batches


@dataclass(kw_only=True)
class FilledBatch:
    batch: RolloutBatch  # exactly `target` groups, renumbered 0..target-1
    metrics: dict[str, float]


def _groups_of(batch: RolloutBatch, rows_b: torch.Tensor) -> RolloutBatch:
    """The rows `rows_b` (bool [B], whole groups), their group ids renumbered densely in order."""
    part = batch.select(rows_b)
    return dataclasses.replace(part, group_index_b=Groups.from_index(part.group_index_b).ids_b) if part.size else part


def count_groups(batch: RolloutBatch) -> int:
    return int(batch.group_index_b.unique().numel())


def informative_groups(rounds: list[RolloutBatch]) -> int:
    """Groups with differing rewards over all rounds so far."""
    return sum(count_groups(batch.select(informative_rows(batch.scores_b, batch.group_index_b)))
               for batch in rounds)


def fill_batch(rounds: list[RolloutBatch], target: int) -> FilledBatch:
    """The first `target` informative groups in round order; when the rounds ran out, the shortfall is filled
    with uninformative groups (zero GRPO advantage) so the batch keeps its size and shape."""
    kept, dropped = [], []
    for batch in rounds:
        rows_b = informative_rows(batch.scores_b, batch.group_index_b)
        kept.append(_groups_of(batch, rows_b))
        dropped.append(_groups_of(batch, ~rows_b))
    parts = [part for part in kept + dropped if part.size]
    merged = concat_batches(parts, [count_groups(part) for part in parts])
    num_kept = sum(count_groups(part) for part in kept if part.size)
    batch = merged.select(merged.group_index_b < target)
    total = sum(count_groups(batch) for batch in rounds)
    metrics = {"gen_rounds": float(len(rounds)), "kept_groups": float(min(num_kept, target)),
               "dropped_groups": float(total - num_kept), "filled_groups": float(max(target - num_kept, 0)),
               "kept_fraction": num_kept / max(total, 1)}
    return FilledBatch(batch=batch, metrics=metrics)
