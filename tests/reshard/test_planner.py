"""The pure planner on up to 64 simulated ranks: exact coverage, minimal traffic, and values checked against the
models layer's own shard rules (`read_shard`) as the oracle."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig, MixtralConfig, Qwen2Config, Qwen3MoeConfig

from rlhf.parallel.layout import ParallelLayout
from rlhf.errors import ConfigError
from rlhf.models.param_specs import hf_shapes, param_specs
from rlhf.models.shard_rules import read_shard
from rlhf.models.spec import ModelSpec
from rlhf.reshard.apply import run_in_process
from rlhf.reshard.planner import min_received_numel, plan, plan_for_model, plan_rank
from rlhf.reshard.segments import shard_segments

MAX_RANKS = 64


def make_config(family: str, kv_heads: int, group: int, layers: int, vocab: int, tied: bool):
    values = dict(vocab_size=vocab, hidden_size=8 * kv_heads * group, intermediate_size=16 * kv_heads,
                  num_hidden_layers=layers, num_attention_heads=kv_heads * group, num_key_value_heads=kv_heads,
                  head_dim=4, max_position_embeddings=32, tie_word_embeddings=tied)
    return Qwen2Config(**values) if family == "qwen2" else LlamaConfig(**values)


def experts_per_rank(config, layout: ParallelLayout) -> int | None:
    moe = ModelSpec.from_hf(config).moe
    return None if moe is None else moe.num_experts // layout.ep


def holds(spec, config, layout: ParallelLayout, rank: int) -> bool:
    """Whether `rank` holds `spec` at all: its stage, and (an expert's weight) its expert-parallel rank."""
    per_rank = experts_per_rank(config, layout)
    return spec.pp_stage == layout.coords(rank).pp_rank and spec.ep_rank(per_rank or 1) in (None,
                                                                                          layout.ep_rank(rank))


def divisors(n: int) -> list[int]:
    return [d for d in (1, 2, 4, 8) if n % d == 0]


@st.composite
def cases(draw):
    family = draw(st.sampled_from(["llama", "qwen2"]))
    kv_heads, group = draw(st.sampled_from([1, 2, 4, 8])), draw(st.sampled_from([1, 2]))
    layers = draw(st.sampled_from([2, 4, 8]))
    config = make_config(family, kv_heads, group, layers, draw(st.integers(5, 70)), draw(st.booleans()))
    tp, pp = draw(st.sampled_from(divisors(kv_heads))), draw(st.sampled_from(divisors(layers)))
    dp = draw(st.integers(1, MAX_RANKS // (tp * pp)))
    src = ParallelLayout(tp=tp, pp=pp, dp=dp)
    split = draw(st.booleans())
    room = MAX_RANKS - src.world_size if split else src.world_size
    dst_tp = draw(st.sampled_from([t for t in divisors(kv_heads) if t <= room] or [1]))
    dst_pp = draw(st.sampled_from([p for p in divisors(layers) if p <= 2 and dst_tp * p <= room] or [1]))
    if split and room < dst_tp * dst_pp:
        split = False
        room = src.world_size
    dst_dp = draw(st.integers(1, max(1, room // (dst_tp * dst_pp))))
    dst = ParallelLayout(tp=dst_tp, pp=dst_pp, dp=dst_dp, first_rank=src.world_size if split else 0)
    return config, src, dst


def held_canon(spec, config, layout: ParallelLayout, rank: int, vocab: int) -> set[int]:
    """Canonical indices of `spec` that `rank` holds in `layout` (empty if it holds no shard of it)."""
    if not layout.contains(rank) or not holds(spec, config, layout, rank):
        return set()
    tp_rank = layout.coords(rank).tp_rank
    return {i for seg in shard_segments(spec, layout.tp, tp_rank, vocab) for i in range(seg.canon_start,
                                                                                           seg.canon_stop)}


def check_coverage_and_minimality(config, src: ParallelLayout, dst: ParallelLayout) -> None:
    vocab = config.vocab_size
    result = plan_for_model(config, src, dst)
    shards = {(s.rank, s.name): s for s in result.dst_shards}
    counts: dict = {key: None for key in shards}
    for t in result.transfers:
        shard = shards[(t.dst_rank, t.dst_name)]
        if counts[(t.dst_rank, t.dst_name)] is None:
            counts[(t.dst_rank, t.dst_name)] = [0] * shard.shape[t.dim]
        expected_shape = list(shard.shape)
        expected_shape[t.dim] = t.length
        assert list(t.shape) == expected_shape, t
        for i in range(t.dst_start, t.dst_start + t.length):
            counts[(t.dst_rank, t.dst_name)][i] += 1
    for key, shard in shards.items():
        cover = counts[key]
        real = shard.shape[0] - shard.padding_rows
        if real == 0:
            assert cover is None, key
            continue
        assert cover is not None, f"{key} receives nothing"
        if shard.padding_rows:
            assert cover == [1] * real + [0] * shard.padding_rows, key
        else:
            assert cover == [1] * len(cover), key
    src_specs = {s.name: s for s in param_specs(config, src) if not s.tied_copy}
    dst_specs = {s.name: s for s in param_specs(config, dst)}
    for rank in dst.ranks:
        needed_not_held = 0
        for shard in result.shards_of(rank):
            dspec = dst_specs[shard.param]
            sspec = src_specs["embedding.word_embeddings.weight" if dspec.tied_copy else shard.param]
            needed = held_canon(dspec, config, dst, rank, vocab)
            missing = needed - held_canon(sspec, config, src, rank, vocab)
            row = 1
            for d, size in enumerate(shard.shape):
                row *= 1 if d == (dspec.partition_dim or 0) else size
            needed_not_held += len(missing) * row
        assert result.received_numel(rank) == needed_not_held, rank
        assert min_received_numel(src, dst, param_specs(config, src), param_specs(config, dst), vocab_size=vocab,
                                  rank=rank) == needed_not_held, rank
    for rank in src.ranks:
        if not dst.contains(rank):
            assert result.received_numel(rank) == 0


def check_values(config, src: ParallelLayout, dst: ParallelLayout) -> None:
    spec = ModelSpec.from_hf(config)
    counter = 0
    hf = {}
    for name, shape in hf_shapes(spec, head="lm").items():
        numel = torch.Size(shape).numel()
        hf[name] = torch.arange(counter + 1, counter + 1 + numel, dtype=torch.float64).reshape(shape)
        counter += numel
    if spec.tie_embeddings:
        hf["lm_head.weight"] = hf["model.embed_tokens.weight"]
    result = plan_for_model(config, src, dst)

    def shards_for(layout: ParallelLayout) -> dict[int, dict[str, torch.Tensor]]:
        specs = param_specs(config, layout)
        per_stage, per_rank = spec.num_layers // layout.pp, experts_per_rank(config, layout)
        out = {}
        for rank in layout.ranks:
            tp_rank = layout.coords(rank).tp_rank
            out[rank] = {p.local_name(per_stage, per_rank): read_shard(p, hf.__getitem__, spec, tp_rank, layout.tp)
                         for p in specs if holds(p, config, layout, rank)}
        return out

    got = run_in_process(result, shards_for(src))
    want = shards_for(dst)
    for rank in dst.ranks:
        assert sorted(got[rank]) == sorted(want[rank])
        for name, tensor in want[rank].items():
            assert torch.equal(got[rank][name], tensor), (rank, name)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_every_destination_slice_covered_once_and_nothing_extra(case):
    check_coverage_and_minimality(*case)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_values_match_the_models_shard_rules(case):
    check_values(*case)


def check_rank_plans(config, src: ParallelLayout, dst: ParallelLayout) -> None:
    src_specs, dst_specs = param_specs(config, src), param_specs(config, dst)
    whole = plan(src, dst, src_specs, dst_specs, vocab_size=config.vocab_size)
    for rank in range(max(src.ranks[-1], dst.ranks[-1]) + 1):
        mine = plan_rank(src, dst, src_specs, dst_specs, vocab_size=config.vocab_size, rank=rank)
        assert list(mine.received) == [t for t in whole.transfers if t.dst_rank == rank]
        assert list(mine.sent) == [t for t in whole.transfers if t.src_rank == rank and not t.is_local]
        assert list(mine.dst_shards) == whole.shards_of(rank)
        assert mine.received_numel == whole.received_numel(rank) and mine.sent_numel == whole.sent_numel(rank)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_one_ranks_plan_is_its_part_of_the_global_plan(case):
    check_rank_plans(*case)


NAMED_PAIRS = {
    "tp2pp2_to_tp1dp4": (ParallelLayout(tp=2, pp=2), ParallelLayout(tp=1, dp=4)),
    "tp4_to_tp2dp2": (ParallelLayout(tp=4), ParallelLayout(tp=2, dp=2)),
    "tp1dp4_to_tp2dp2": (ParallelLayout(dp=4), ParallelLayout(tp=2, dp=2)),
    "split_2_2": (ParallelLayout(tp=2), ParallelLayout(tp=2, first_rank=2)),
    "tp8pp2dp4_to_tp4dp16": (ParallelLayout(tp=8, pp=2, dp=4), ParallelLayout(tp=4, dp=16)),
}


@pytest.mark.parametrize("pair", sorted(NAMED_PAIRS))
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_named_pairs(pair, family):
    config = make_config(family, 8, 2, 8, 101, tied=family == "qwen2")
    check_coverage_and_minimality(config, *NAMED_PAIRS[pair])
    check_values(config, *NAMED_PAIRS[pair])


EXPERT_PAIRS = {
    "dp4ep2_to_dp4": (ParallelLayout(dp=4, ep=2), ParallelLayout(dp=4)),
    "pp2dp2ep2_to_dp4": (ParallelLayout(pp=2, dp=2, ep=2), ParallelLayout(dp=4)),
    "dp4ep4_to_dp4ep2": (ParallelLayout(dp=4, ep=4), ParallelLayout(dp=4, ep=2)),
    "split_dp2ep2_to_dp2": (ParallelLayout(dp=2, ep=2), ParallelLayout(dp=2, first_rank=2)),
    "dp8ep8_to_dp16ep2": (ParallelLayout(dp=8, ep=8), ParallelLayout(dp=16, ep=2)),
    # ep carved out of cp x dp: an expert's holders include cp ranks other than 0
    "cp2ep2_to_dp2": (ParallelLayout(cp=2, ep=2), ParallelLayout(dp=2)),
    "cp2dp2ep4_to_dp4ep2": (ParallelLayout(cp=2, dp=2, ep=4), ParallelLayout(dp=4, ep=2)),
    "tp2cp2dp2ep2_to_tp2dp4": (ParallelLayout(tp=2, cp=2, dp=2, ep=2), ParallelLayout(tp=2, dp=4)),
}


def moe_config(family: str):
    common = dict(vocab_size=37, hidden_size=16, intermediate_size=24, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=4, max_position_embeddings=32, num_experts_per_tok=2)
    if family == "mixtral":
        return MixtralConfig(**common, num_local_experts=8, sliding_window=None)
    return Qwen3MoeConfig(**common, num_experts=8, moe_intermediate_size=12, mlp_only_layers=[2])


@pytest.mark.parametrize("pair", sorted(EXPERT_PAIRS))
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_expert_parallel_pairs(pair, family):
    """Each expert's weights come only from ranks of the expert-parallel rank holding it."""
    config, (src, dst) = moe_config(family), EXPERT_PAIRS[pair]
    check_coverage_and_minimality(config, src, dst)
    check_values(config, src, dst)
    check_rank_plans(config, src, dst)
    src_specs = {p.name: p for p in param_specs(config, src)}
    for transfer in plan_for_model(config, src, dst).transfers:
        expert = src_specs[transfer.param].expert
        if expert is not None:
            assert src.ep_rank(transfer.src_rank) == expert // (8 // src.ep), transfer
            assert f".local_experts.{expert % (8 // src.ep)}." in transfer.src_name


def test_same_layout_is_all_local_and_plan_is_deterministic():
    config = make_config("llama", 4, 2, 4, 37, tied=False)
    layout = ParallelLayout(tp=2, pp=2, dp=2)
    first, second = plan_for_model(config, layout, layout), plan_for_model(config, layout, layout)
    assert first == second
    assert all(t.is_local for t in first.transfers)


def test_dp_replicas_share_the_sending():
    """TP2 -> TP1 on the same 4 ranks (dp 2 -> 4): each of the 4 ranks needs the other tp half once."""
    config = make_config("llama", 4, 2, 4, 64, tied=False)
    result = plan_for_model(config, ParallelLayout(tp=2, dp=2), ParallelLayout(tp=1, dp=4))
    sent = [result.sent_numel(rank) for rank in range(4)]
    assert max(sent) == min(sent), sent


def test_mismatched_models_are_a_config_error():
    small = make_config("llama", 2, 1, 2, 20, tied=False)
    big = make_config("llama", 2, 1, 4, 20, tied=False)
    with pytest.raises(ConfigError, match="decoder.layers.2"):
        plan(ParallelLayout(), ParallelLayout(), param_specs(small, ParallelLayout()),
             param_specs(big, ParallelLayout()), vocab_size=20)


def test_mismatched_shapes_are_a_config_error():
    narrow = make_config("llama", 2, 1, 2, 20, tied=False)
    wide = make_config("llama", 2, 2, 2, 20, tied=False)
    with pytest.raises(ConfigError, match=r"^reshard: embedding.word_embeddings.weight is vocab \[20, 32\] in the "
                                          r"rollout model but vocab \[20, 16\] in the training model$"):
        plan(ParallelLayout(), ParallelLayout(), param_specs(narrow, ParallelLayout()),
             param_specs(wide, ParallelLayout()), vocab_size=20)
