"""Test-only: this rank's ProcessGroupCollection for a layout (stand-in until rlhf.dist.meshes lands)."""

from __future__ import annotations

import torch.distributed as dist
from megatron.core.process_groups_config import ProcessGroupCollection

from rlhf.dist.layout import ParallelLayout


def _mine(groups: list[list[int]]):
    rank = dist.get_rank()
    mine = None
    for ranks in groups:
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = group
    return mine


def make_pg_collection(layout: ParallelLayout) -> ProcessGroupCollection:
    tp, pp, dp = _mine(layout.tp_groups()), _mine(layout.pp_groups()), _mine(layout.dp_groups())
    mp, embd = _mine(layout.mp_groups()), _mine(layout.embedding_groups())
    pos_embd = _mine([[g[0]] for g in layout.pp_groups()])
    cp = _mine([[r] for r in layout.ranks])
    return ProcessGroupCollection(tp=tp, pp=pp, dp=dp, dp_cp=dp, mp=mp, embd=embd, pos_embd=pos_embd, cp=cp,
                                  tp_cp=tp)
