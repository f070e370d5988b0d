"""The prefill split is the cheapest one (checked against brute force) and covers every prompt once."""

import itertools
import random

import pytest

from rlhf.rollout.native.prefill_plan import overhead_tokens, plan_chunks


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
        groups = plan_chunks(lengths, overhead)
        assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
        assert all(lengths[a] <= lengths[b] for g in groups for a, b in zip(g, g[1:]))
        assert abs(_cost(groups, lengths, overhead) - _brute_force(lengths, overhead)) < 1e-9, (lengths, overhead)


def test_extremes():
    lengths = [5, 30, 5, 12, 30]
    assert plan_chunks(lengths, 1e9) == [[0, 2, 3, 1, 4]]  # overhead dominates: one forward
    assert plan_chunks(lengths, 0.0) == [[0, 2], [3], [1, 4]]  # no overhead: one forward per distinct length
    assert plan_chunks([], 10.0) == []


def test_overhead_shrinks_with_model_size():
    assert overhead_tokens(37_000) > 100  # tiny test model: dispatch-bound, prefill in one forward
    assert overhead_tokens(3_500_000) < 12  # SmolLM2-135M layer: weight streaming dominates
    # bf16: the GEMMs per token are several times cheaper, the weight pass is not: fewer, wider forwards
    assert overhead_tokens(3_500_000, bf16=True) == pytest.approx(64 + 6e6 / 3_500_000)


def test_moe_overhead_counts_the_experts_a_prefill_calls():
    dense = overhead_tokens(3_500_000)
    assert overhead_tokens(3_500_000, num_experts=8) == pytest.approx(dense + 6e6 * (8 / 3) / 3_500_000)
    assert overhead_tokens(3_500_000, num_experts=128) > 5 * dense  # Qwen3-30B-A3B-style: many experts per layer
