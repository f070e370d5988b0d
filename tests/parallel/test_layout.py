"""ParallelLayout math for every tp x cp x pp x dp factorisation of 1..8 ranks (and offset meshes), checked
against the rank formula and megatron-core's own rank generator."""

import itertools

import pytest

from rlhf.parallel.layout import ParallelLayout
from rlhf.errors import ConfigError


def _layouts(max_world=8):
    for world in range(1, max_world + 1):
        for tp, pp in itertools.product(range(1, world + 1), repeat=2):
            if world % (tp * pp) == 0:
                for first in (0, 3):
                    yield ParallelLayout.for_world(world, tp=tp, pp=pp, first_rank=first)


@pytest.mark.parametrize("layout", list(_layouts()), ids=str)
def test_groups_follow_the_rank_formula(layout):
    ranks = list(layout.ranks)
    for rank in ranks:
        t, d, p, c = layout.coords(rank)
        assert c == 0
        assert rank == layout.first_rank + t + layout.tp * (d + layout.dp * p)
        assert layout.rank_of(t, d, p) == rank
        tp_group = layout.group_of(layout.tp_groups(), rank)
        assert tp_group == [layout.rank_of(i, d, p) for i in range(layout.tp)]
        assert layout.group_of(layout.dp_groups(), rank) == [layout.rank_of(t, i, p) for i in range(layout.dp)]
        assert layout.group_of(layout.pp_groups(), rank) == [layout.rank_of(t, d, i) for i in range(layout.pp)]
        mp = layout.group_of(layout.mp_groups(), rank)
        assert all(layout.coords(r).dp_rank == d for r in mp) and len(mp) == layout.tp * layout.pp
    for family in (layout.tp_groups(), layout.dp_groups(), layout.pp_groups(), layout.mp_groups()):
        assert sorted(r for group in family for r in group) == ranks, "a family must partition the mesh"


def test_tp_is_fastest_then_dp_then_pp():
    layout = ParallelLayout(tp=2, dp=2, pp=2)
    assert [tuple(layout.coords(r))[:3] for r in range(8)] == [
        (0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 1, 0), (0, 0, 1), (1, 0, 1), (0, 1, 1), (1, 1, 1)]
    assert layout.tp_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.dp_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.pp_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.embedding_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_bad_layouts_name_the_numbers():
    with pytest.raises(ConfigError, match=r"^layout: 6 ranks are not divisible by tp\*pp = 4\*1 = 4"):
        ParallelLayout.for_world(6, tp=4)
    with pytest.raises(ConfigError, match=r"^layout tp=0 must be a positive integer$"):
        ParallelLayout(tp=0)
    with pytest.raises(ValueError, match="rank 9 is outside"):
        ParallelLayout(tp=2, dp=2).coords(9)


def _context_layouts(max_world=8):
    for world in range(2, max_world + 1):
        for tp, cp, pp in itertools.product(range(1, world + 1), range(2, world + 1), range(1, world + 1)):
            if world % (tp * cp * pp) == 0:
                for ep in range(1, world // (tp * pp) + 1):
                    if (world // (tp * pp)) % ep == 0:
                        yield ParallelLayout.for_world(world, tp=tp, cp=cp, pp=pp, ep=ep)


@pytest.mark.parametrize("layout", list(_context_layouts()), ids=lambda layout: layout.describe())
def test_context_parallel_groups_are_megatrons(layout):
    """Every dense and expert group at cp > 1 equals megatron-core's (order tp-cp-ep-dp-pp; the experts' ranks
    tp-ep-dp-pp over a stage's cp x dp ranks), and the coordinates invert the rank formula."""
    from megatron.core.parallel_state import RankGenerator

    dense = RankGenerator(tp=layout.tp, ep=1, dp=layout.dp, pp=layout.pp, cp=layout.cp, order="tp-cp-ep-dp-pp")
    experts = RankGenerator(tp=layout.tp, ep=layout.ep, dp=layout.expert_dp, pp=layout.pp, cp=1,
                            order="tp-cp-ep-dp-pp")
    for ours, generator, token in (
            (layout.tp_groups(), dense, "tp"), (layout.cp_groups(), dense, "cp"), (layout.dp_groups(), dense, "dp"),
            (layout.pp_groups(), dense, "pp"), (layout.tp_cp_groups(), dense, "tp-cp"),
            (layout.dp_cp_groups(), dense, "dp-cp"), (layout.tp_dp_cp_groups(), dense, "tp-dp-cp"),
            (layout.mp_groups(), dense, "tp-pp"), (layout.ep_groups(), experts, "ep"),
            (layout.expert_dp_groups(), experts, "dp"), (layout.tp_ep_groups(), experts, "tp-ep"),
            (layout.tp_ep_pp_groups(), experts, "tp-ep-pp")):
        assert sorted(map(sorted, ours)) == sorted(map(sorted, generator.get_ranks(token))), token
    for rank in layout.ranks:
        t, d, p, c = layout.coords(rank)
        assert rank == layout.tp * (c + layout.cp * (d + layout.dp * p)) + t == layout.rank_of(t, d, p, c)
        assert layout.group_of(layout.ep_groups(), rank)[layout.ep_rank(rank)] == rank


def test_bad_context_layouts_name_the_numbers():
    with pytest.raises(ConfigError, match=r"^mesh\.actor: 8 ranks are not divisible by tp\*cp\*pp = 2\*3\*1 = 6; "
                                          r"choose tp, cp and pp whose product divides 8$"):
        ParallelLayout.for_world(8, tp=2, cp=3, what="mesh.actor")
    with pytest.raises(ConfigError, match=r"^layout ep=3 does not divide cp\*dp = 2\*2 = 4: experts are split "
                                          r"inside a stage's cp x dp ranks; choose ep among the divisors of 4$"):
        ParallelLayout(cp=2, dp=2, ep=3)
    with pytest.raises(ConfigError, match=r"^layout cp=0 must be a positive integer$"):
        ParallelLayout(cp=0)
    assert ParallelLayout.for_world(8, tp=2, cp=2, ep=2).describe() == "tp2 x cp2 x dp2 (ep2) x pp1 on ranks 0..7"


def _expert_layouts(max_world=8):
    for layout in _layouts(max_world):
        for ep in range(2, layout.dp + 1) if layout.first_rank == 0 else ():
            if layout.dp % ep == 0:
                yield ParallelLayout(tp=layout.tp, pp=layout.pp, dp=layout.dp, ep=ep)


@pytest.mark.parametrize("layout", list(_expert_layouts()), ids=str)
def test_expert_groups_are_megatrons(layout):
    """Same groups as megatron-core's own expert rank generator (order tp-ep-dp-pp, expert tp = tp)."""
    from megatron.core.parallel_state import RankGenerator

    megatron = RankGenerator(tp=layout.tp, ep=layout.ep, dp=layout.expert_dp, pp=layout.pp, cp=1,
                             order="tp-cp-ep-dp-pp")
    for ours, token in ((layout.ep_groups(), "ep"), (layout.expert_dp_groups(), "dp"),
                        (layout.tp_ep_groups(), "tp-ep"), (layout.tp_ep_pp_groups(), "tp-ep-pp"),
                        (layout.tp_groups(), "tp"), (layout.pp_groups(), "pp")):
        assert sorted(map(sorted, ours)) == sorted(map(sorted, megatron.get_ranks(token))), token
    for rank in layout.ranks:
        assert layout.group_of(layout.ep_groups(), rank)[layout.ep_rank(rank)] == rank


def test_bad_expert_layouts_name_the_numbers():
    with pytest.raises(ConfigError, match=r"^layout ep=3 does not divide dp=4: experts are split inside the data-"
                                          r"parallel ranks; choose ep among the divisors of 4$"):
        ParallelLayout(dp=4, ep=3)
    with pytest.raises(ConfigError, match=r"^layout: 4 ranks are not divisible by tp\*ep\*pp = 2\*4\*1 = 8; "
                                          r"choose ep among the divisors of dp = 2$"):
        ParallelLayout.for_world(4, tp=2, ep=4)
    assert ParallelLayout.for_world(8, tp=2, pp=2, ep=2).describe() == "tp2 x dp2 (ep2) x pp2 on ranks 0..7"
