"""The prefill plan: packed forwards within the token budget covering every prompt once, each prompt's tokens
in order; attention groups that round-trip the packed layout and are the cheapest split (against brute force)."""

import itertools
import random

import torch

from rlhf.rollout.native.prefill_plan import plan_groups, plan_prefill


def _cost(groups, lengths, overhead):
    return sum(overhead + len(g) * max(lengths[i] for i in g) for g in groups)


def _brute_force(lengths, overhead):
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    best = float("inf")
    for cuts in itertools.product([False, True], repeat=len(order) - 1):
        groups, start = [], 0
        for i, cut in enumerate(cuts, start=1):
            if cut:
                groups.append(order[start:i])
                start = i
        groups.append(order[start:])
        best = min(best, _cost(groups, lengths, overhead))
    return best


def test_plan_is_optimal_and_covers_every_prompt():
    rng = random.Random(0)
    for _ in range(200):
        lengths = [rng.randint(1, 40) for _ in range(rng.randint(1, 9))]
        overhead = rng.choice([0.0, 3.0, 10.0, 50.0, 1e6])
        groups = plan_groups(lengths, overhead)
        assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
        assert all(lengths[a] <= lengths[b] for g in groups for a, b in zip(g, g[1:]))
        assert abs(_cost(groups, lengths, overhead) - _brute_force(lengths, overhead)) < 1e-9, (lengths, overhead)


def test_extremes():
    lengths = [5, 30, 5, 12, 30]
    assert plan_groups(lengths, 1e9) == [[0, 2, 3, 1, 4]]  # overhead dominates: one forward
    assert plan_groups(lengths, 0.0) == [[0, 2], [3], [1, 4]]  # no overhead: one forward per distinct length
    assert plan_groups([], 10.0) == []


def _left_aligned(prompts):
    width = max(len(p) for p in prompts)
    return torch.tensor([p + [0] * (width - len(p)) for p in prompts])


def test_forwards_pack_every_prompt_once_within_the_budget():
    prompts = [[1, 2, 3], [4], [5, 6, 7, 8, 9, 10, 16], [11, 12], [13, 14, 15]]
    lengths, slots = [len(p) for p in prompts], [4, 0, 1, 2, 3]
    forwards = plan_prefill(_left_aligned(prompts), lengths, slots, max_tokens=6)
    # shortest first; a forward closes before it would pass 6 tokens; the 7-token prompt gets one of its own
    assert [f.prompts for f in forwards] == [(1, 3, 0), (4,), (2,)]
    for forward in forwards:
        assert forward.tokens_t.tolist() == [t for p in forward.prompts for t in prompts[p]]
        assert forward.lengths == tuple(lengths[p] for p in forward.prompts)
        assert forward.tokens_t[forward.last_rows].tolist() == [prompts[p][-1] for p in forward.prompts]
    one = plan_prefill(_left_aligned(prompts), lengths, slots, max_tokens=8192)
    assert len(one) == 1 and one[0].num_tokens == sum(lengths)


def test_attention_groups_round_trip_the_packed_layout():
    rng = random.Random(1)
    for overhead in (0.0, 5.0, 1e9):
        prompts = [[rng.randint(1, 99) for _ in range(rng.randint(1, 9))] for _ in range(7)]
        lengths = [len(p) for p in prompts]
        (forward,) = plan_prefill(_left_aligned(prompts), lengths, list(range(7)), 8192, overhead)
        assert forward.groups[0].start == 0 and forward.groups[-1].end == forward.num_tokens
        hidden_t = torch.randn(forward.num_tokens, 3)
        for group, following in zip(forward.groups, forward.groups[1:] + (None,)):
            assert following is None or (following.first, following.start) == (group.stop, group.end)
            padded = group.padded(hidden_t)
            assert padded.shape == (group.num_prompts, group.width, 3)
            for row, prompt in enumerate(forward.prompts[group.first:group.stop]):
                assert padded[row, lengths[prompt]:].abs().sum() == 0  # padding is zeros
            assert torch.equal(group.packed(padded), hidden_t[group.start:group.end])
            tokens = group.padded(forward.tokens_t[:, None])[..., 0]
            assert [tokens[r, :lengths[p]].tolist() for r, p in enumerate(forward.prompts[group.first:group.stop])
                    ] == [prompts[p] for p in forward.prompts[group.first:group.stop]]
        assert (len(forward.groups) == 1) == (overhead == 1e9)


def test_equal_lengths_need_no_padding_and_consecutive_slots_write_through_a_slice():
    prompts = [[1, 2], [3, 4], [5, 6]]
    (forward,) = plan_prefill(_left_aligned(prompts), [2, 2, 2], [5, 6, 7], 8192)
    (group,) = forward.groups
    assert group.pad_rows is None and group.cache_rows == slice(5, 8)
    assert group.padded(forward.tokens_t).data_ptr() == forward.tokens_t.data_ptr()  # a view
    (forward,) = plan_prefill(_left_aligned(prompts), [2, 2, 2], [5, 7, 6], 8192)
    assert forward.groups[0].cache_rows.tolist() == [5, 7, 6] == forward.groups[0].slots_p.tolist()
