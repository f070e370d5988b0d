"""Process groups built for a layout have exactly the members the layout math says, on every rank."""

import torch.distributed as dist

from rlhf.parallel.groups import GroupCache, build_layout_groups
from rlhf.parallel.layout import ParallelLayout
from rlhf.testing.distributed import run_distributed

LAYOUTS = [ParallelLayout(tp=2, pp=2, dp=1), ParallelLayout(tp=1, pp=2, dp=2), ParallelLayout(tp=4),
           ParallelLayout(tp=2, dp=1, first_rank=2), ParallelLayout(dp=4), ParallelLayout(dp=4, ep=2),
           ParallelLayout(pp=2, dp=2, ep=2), ParallelLayout(tp=2, dp=2, ep=2)]
EXPERT_GROUPS = {"ep": "ep_groups", "expt_dp": "expert_dp_groups", "tp_ep": "tp_ep_groups",
                 "tp_ep_pp": "tp_ep_pp_groups", "intra_expt_dp": "expert_dp_groups", "expt_tp": "tp_groups"}


def _members(layouts):
    cache = GroupCache()
    out = []
    for layout in layouts:
        pgs = build_layout_groups(layout, cache)
        if pgs is None:
            out.append(None)
            continue
        out.append({name: dist.get_process_group_ranks(getattr(pgs, name))
                    for name in ("tp", "pp", "dp", "mp", "embd", "cp", "tp_dp_cp", *EXPERT_GROUPS)})
    return out, cache.num_created


def test_groups_match_layout_math_on_4_ranks():
    results = run_distributed(_members, 4, LAYOUTS, timeout_s=120)
    creations = {num for _, num in results}
    assert len(creations) == 1, "every rank must create the same number of groups"
    for rank, (members, _) in enumerate(results):
        for layout, got in zip(LAYOUTS, members):
            if not layout.contains(rank):
                assert got is None
                continue
            assert got["tp"] == layout.group_of(layout.tp_groups(), rank)
            assert got["pp"] == layout.group_of(layout.pp_groups(), rank)
            assert got["dp"] == layout.group_of(layout.dp_groups(), rank)
            assert got["mp"] == layout.group_of(layout.mp_groups(), rank)
            assert got["embd"] == layout.group_of(layout.embedding_groups(), rank)
            assert got["cp"] == [rank]
            for name, family in EXPERT_GROUPS.items():
                assert got[name] == layout.group_of(getattr(layout, family)(), rank), (layout, name)
            pp_rank = layout.coords(rank).pp_rank
            assert got["tp_dp_cp"] == sorted(r for r in layout.ranks if layout.coords(r).pp_rank == pp_rank)
