"""Process groups for one `ParallelLayout`, handed to megatron-core as an explicit `ProcessGroupCollection`.

`torch.distributed.new_group` is collective over the whole world, so every rank creates every group of every
layout, in one fixed order. A `GroupCache` shared by all layouts creates each distinct rank list once (colocated
roles with the same layout then share the very same group objects).
"""

from __future__ import annotations

from datetime import timedelta

from typing import TYPE_CHECKING

import torch.distributed as dist

from rlhf.parallel.layout import ParallelLayout
from rlhf.platform.compat import megatron as megatron_compat

if TYPE_CHECKING:
    from megatron.core.process_groups_config import ProcessGroupCollection


class GroupCache:
    """Creates each distinct rank list's group once; `get` must be called in the same order on all ranks."""

    def __init__(self, timeout_s: float | None = None) -> None:
        self._groups: dict[tuple[int, ...], dist.ProcessGroup | None] = {}
        self._timeout = timedelta(seconds=timeout_s) if timeout_s else None
        self.num_created = 0

    def get(self, ranks: list[int]) -> dist.ProcessGroup | None:
        """The group for `ranks` (None on ranks outside it, as torch returns a non-member sentinel)."""
        key = tuple(sorted(ranks))
        if key not in self._groups:
            group = dist.new_group(list(key), timeout=self._timeout)
            self._groups[key] = group if dist.get_rank() in key else None
            self.num_created += 1
        return self._groups[key]

    def family(self, groups: list[list[int]]) -> dist.ProcessGroup | None:
        """Create every group of a family (all ranks take part) and return the one holding this rank."""
        mine = None
        for ranks in groups:
            group = self.get(ranks)
            if group is not None:
                mine = group
        return mine


def build_layout_groups(layout: ParallelLayout, cache: GroupCache | None = None) -> "ProcessGroupCollection | None":
    """Create every group `layout` needs (collective: call on all ranks) and return this rank's collection.

    Returns None on ranks outside the layout. Context parallelism: the cp ranks of one dp rank split its
    sequences; weights are replicated over dp x cp, so gradients reduce over `dp_cp` (at cp=1 the cp groups are
    single ranks and dp_cp is dp). Expert groups follow `layout.ep` over a stage's cp x dp ranks (at ep=1 they
    are the dense ones); the experts' tensor-parallel group is tp. The one distributed-optimizer instance spans
    the whole layout: its grad norm sums every rank's shard (over dp alone, tp/pp ranks clipped differently).
    """
    cache = cache or GroupCache()
    rank = dist.get_rank()
    tp = cache.family(layout.tp_groups())
    dp = cache.family(layout.dp_groups())
    pp = cache.family(layout.pp_groups())
    mp = cache.family(layout.mp_groups())
    embd = cache.family(layout.embedding_groups())
    pos_embd = cache.family([[group[0]] for group in layout.pp_groups()])
    cp = cache.family(layout.cp_groups())
    tp_cp = cache.family(layout.tp_cp_groups())
    dp_cp = cache.family(layout.dp_cp_groups())
    tp_dp_cp = cache.family(layout.tp_dp_cp_groups())
    single = cache.family([[r] for r in layout.ranks])
    ep = cache.family(layout.ep_groups())
    expt_dp = cache.family(layout.expert_dp_groups())
    tp_ep = cache.family(layout.tp_ep_groups())
    tp_ep_pp = cache.family(layout.tp_ep_pp_groups())
    everyone = cache.get(list(layout.ranks))
    if not layout.contains(rank):
        return None
    return megatron_compat.process_groups(
        everyone, tp=tp, pp=pp, mp=mp, dp=dp, embd=embd, pos_embd=pos_embd, cp=cp, tp_cp=tp_cp, dp_cp=dp_cp,
        intra_dp_cp=dp_cp, tp_dp_cp=tp_dp_cp, ep=ep, expt_tp=tp, expt_dp=expt_dp, tp_ep=tp_ep, tp_ep_pp=tp_ep_pp,
        intra_expt_dp=expt_dp, inter_dist_opt=single, intra_dist_opt=everyone, hcp=[])
