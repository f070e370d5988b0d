"""Split a prefill into forwards: each forward pads its prompts to its longest, and each costs a fixed overhead.

Cost of one forward, in token-equivalents: `overhead_tokens + prompts x longest`. One forward wastes padding;
one per prompt pays the overhead every time. Sorting by length and cutting where the lengths change, the
cheapest split is found exactly by dynamic programming over the distinct lengths.
"""

from __future__ import annotations

# Fixed cost of one prefill forward, calibrated on a 2-core AVX-512 host (rollout bench prompts, 32 x 16-32
# tokens): every forward streams all weights once (~8 tokens' worth of compute for SmolLM2-135M) and pays a
# per-op dispatch cost (~2e-4 s per layer; against ~3e7 FLOP/s-equivalents per weight element: the second term).
STREAM_OVERHEAD_TOKENS = 8.0
# In bf16 a token's GEMMs run several times faster (AMX / AVX512-BF16) while a weight pass still streams from
# memory, so the pass is worth far more tokens: on an AMX host (SmolLM2-135M, the same 32 prompts) one forward per
# ~64 tokens of padding saved was fastest (2 forwards: 271 ms CPU; 4 at overhead 8-24: 320-338 ms; 1: 292 ms).
BF16_STREAM_OVERHEAD_TOKENS = 64.0
DISPATCH_OVERHEAD_PARAMS = 6e6
# A routed layer runs a few more ops per expert it calls (gather, two GEMMs, scale, index-add): each expert adds
# about a third of a dense layer's dispatch cost (an estimate from the op counts, not a calibration).
EXPERT_DISPATCH_SHARE = 1 / 3


def overhead_tokens(params_per_layer: int, num_experts: int = 0, bf16: bool = False) -> float:
    """A forward's fixed cost in tokens: large for tiny models (dispatch-bound), ~10 for 100M+ models in fp32,
    ~64 in bf16 (`bf16`: the weights and activations are bf16).

    `params_per_layer` counts the weights one token meets (MoE: router + top-k experts); a MoE model's
    `num_experts` experts per layer each add dispatch cost, since a long prefill calls them all.
    """
    dispatch = DISPATCH_OVERHEAD_PARAMS * (1 + EXPERT_DISPATCH_SHARE * num_experts)
    stream = BF16_STREAM_OVERHEAD_TOKENS if bf16 else STREAM_OVERHEAD_TOKENS
    return stream + dispatch / max(1, params_per_layer)


def plan_chunks(lengths: list[int], overhead: float) -> list[list[int]]:
    """Indices of `lengths` grouped into forwards (each group's prompts sorted by length) at minimal cost."""
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    if not order:
        return []
    # Candidate cut points: after the last prompt of each distinct length.
    ends = [i + 1 for i in range(len(order)) if i + 1 == len(order) or lengths[order[i]] != lengths[order[i + 1]]]
    best = [0.0] + [float("inf")] * len(ends)
    cut_from = [0] * (len(ends) + 1)
    for j, end in enumerate(ends, start=1):
        longest = lengths[order[end - 1]]
        for i in range(j):
            start = ends[i - 1] if i else 0
            cost = best[i] + overhead + (end - start) * longest
            if cost < best[j]:
                best[j], cut_from[j] = cost, i
    groups, j = [], len(ends)
    while j:
        i = cut_from[j]
        groups.append(order[ends[i - 1] if i else 0:ends[j - 1]])
        j = i
    return groups[::-1]
