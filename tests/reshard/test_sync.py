"""WeightSync on 4 gloo ranks with real megatron models: after a sync every rollout rank's weights are bitwise
the slices of the HF reference weights, verify mode passes (and catches a corrupted weight), and greedy
generation (also after a sleep that released the weights) equals a freshly loaded rollout model's.
One launched world covers every layout pair."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from rlhf.parallel.layout import ParallelLayout
from rlhf.testing.distributed import run_distributed
from rlhf.testing.tiny_models import FAMILIES, tiny_hf_model

PAIRS = {
    "tp2pp2_to_tp1dp4": (ParallelLayout(tp=2, pp=2), ParallelLayout(dp=4)),
    "tp4_to_tp2dp2": (ParallelLayout(tp=4), ParallelLayout(tp=2, dp=2)),
    "tp1dp4_to_tp2dp2": (ParallelLayout(dp=4), ParallelLayout(tp=2, dp=2)),
    "split_pp2_to_tp2": (ParallelLayout(pp=2), ParallelLayout(tp=2, first_rank=2)),
}
# expert-parallel training layouts to ep=1 rollouts, for the MoE family (its layer 1 is dense)
MOE_PAIRS = {
    "dp4ep2_to_dp4": (ParallelLayout(dp=4, ep=2), ParallelLayout(dp=4)),
    "pp2dp2ep2_to_dp2": (ParallelLayout(pp=2, dp=2, ep=2), ParallelLayout(dp=2, first_rank=2)),
}
MOE_FAMILY = "qwen3_moe"
PROMPTS = [[5, 17, 33, 8, 90, 4, 61], [9, 40], [71, 3, 3, 12, 60, 11]]


def _models(path, src, dst, cache):
    from transformers import AutoConfig

    from rlhf.parallel.groups import build_layout_groups
    from rlhf.models.builder import build_gpt
    from rlhf.models.hf_load import load_hf_weights
    from rlhf.rollout.factory import engine_layout
    from rlhf.rollout.native import NativeEngine, NativeEngineConfig

    config = AutoConfig.from_pretrained(path)
    src_pgs, dst_pgs = build_layout_groups(src, cache), build_layout_groups(dst, cache)
    src_model = None
    if src_pgs is not None:
        src_model = build_gpt(config, src_pgs)
        load_hf_weights(src_model, path)

    def engine(load: bool):
        if dst_pgs is None:
            return None
        model = build_gpt(config, dst_pgs, seed=99)
        if load:
            load_hf_weights(model, path)
        return NativeEngine(model, vocab_size=config.vocab_size, layout=engine_layout(dst_pgs), tp_group=dst_pgs.tp,
                            config=NativeEngineConfig(max_batch_size=4, max_seq_len=32))

    return config, src_model, engine


def _reference_shards(path, config, dst):
    """The rollout rank's shards cut straight from the HF tensors by the models layer's shard rules."""
    from safetensors.torch import load_file

    from rlhf.models.param_specs import param_specs
    from rlhf.models.shard_rules import read_shard
    from rlhf.models.spec import ModelSpec

    hf = load_file(f"{path}/model.safetensors")
    spec = ModelSpec.from_hf(config)
    tp_rank = dst.coords(dist.get_rank()).tp_rank
    return {p.name: read_shard(p, hf.__getitem__, spec, tp_rank, dst.tp) for p in param_specs(config, dst)}


def _greedy(engine):
    from rlhf.rollout.sampling_params import SamplingParams
    from rlhf.rollout.types import PromptBatch

    out = engine.generate(PromptBatch.from_token_lists(PROMPTS), SamplingParams(max_new_tokens=8, temperature=0.0))
    return out.response_tokens_rt


def _dense_fc2(family: str) -> str:
    return f"decoder.layers.{1 if family == MOE_FAMILY else 0}.mlp.linear_fc2.weight"


def _check_pair(path, src, dst, cache, fc2_name="decoder.layers.0.mlp.linear_fc2.weight"):
    from rlhf.reshard.sync import WeightSync
    from rlhf.errors import WeightSyncError

    config, src_model, make_engine = _models(path, src, dst, cache)
    rank, stats = dist.get_rank(), {}
    for method, dtype in (("p2p", None), ("all_to_all", None), ("shm", None), ("auto", torch.bfloat16)):
        engine = make_engine(load=False)
        sync = WeightSync(src_model, src, dst, engine, method=method, dtype=dtype, verify=True)
        result = sync.sync()
        stats[(method, str(dtype))] = (result.bytes_received, sync.plan.received_numel(rank), result.num_verified)
        if engine is None:
            continue
        weights = dict(engine.model.named_parameters())
        for name, want in _reference_shards(path, config, dst).items():
            want = want if dtype is None else want.to(dtype).to(torch.float32)
            assert torch.equal(weights[name].detach(), want), (method, dtype, name)
    engine = make_engine(load=False)  # comm.strategy=plain: one message per tensor slice, still bitwise
    plain = WeightSync(src_model, src, dst, engine, method="p2p", coalesce=False, verify=True).sync()
    stats["plain_messages"] = (plain.num_messages, sum(not t.is_local and rank in (t.src_rank, t.dst_rank)
                                                       for t in sync.plan.transfers), plain.num_verified)
    engine = make_engine(load=False)
    sync = WeightSync(src_model, src, dst, engine, verify=True, max_bucket_mb=0.001)
    if engine is not None:  # weights released while asleep come back through the sync
        engine.sleep(release_weights=True)
    sync.sync()
    if engine is not None:
        engine.wake()
    fresh = make_engine(load=True)
    greedy = None if engine is None else _greedy(engine)
    if engine is not None:
        assert torch.equal(greedy, _greedy(fresh))
    if src_model is not None:  # a training step: the same WeightSync must carry the new values
        with torch.no_grad():
            for param in src_model.parameters():
                param.mul_(2.0)
    assert sync.sync().num_verified == (len(sync.plan.shards_of(rank)) and sum(
        t.dst_rank == rank for t in sync.plan.transfers))
    if engine is not None:
        fc2 = dict(engine.model.named_parameters())[fc2_name]
        assert torch.equal(fc2.detach(), 2.0 * dict(fresh.model.named_parameters())[fc2_name].detach())
        with torch.no_grad():  # corrupt one element: verify must name the parameter
            fc2[0, 0] += 1.0
    caught = None
    try:
        sync.check()
    except WeightSyncError as error:
        caught = str(error)
    has_remote = any(not t.is_local for t in sync.plan.transfers)
    stats["num_rounds_small_buckets"] = (len(sync.schedule.rounds), has_remote)
    return stats, greedy, caught


class RecordingEngine:
    """Stands in for vLLM's loader: keeps the HF-named tensors it is given."""

    def __init__(self) -> None:
        self.loaded: dict[str, torch.Tensor] = {}

    def load_weights(self, weights) -> None:
        self.loaded.update((name, tensor.clone()) for name, tensor in weights)


def _check_hf_names(path, src, dst, cache):
    """Engines fed HF names get every HF tensor of the folder, full and bitwise, on every rollout rank."""
    from safetensors.torch import load_file

    from rlhf.reshard.sync import WeightSync

    config, src_model, _ = _models(path, src, dst, cache)
    engine = RecordingEngine() if dst.contains(dist.get_rank()) else None
    WeightSync(src_model, src, dst, engine, hf_config=config, hf_names=True).sync()
    if engine is not None:
        hf = load_file(f"{path}/model.safetensors")
        assert sorted(engine.loaded) == sorted(hf)
        assert all(torch.equal(engine.loaded[name], hf[name]) for name in hf)


def _check_config_errors(path):
    from transformers import AutoConfig

    from rlhf.errors import ConfigError
    from rlhf.reshard.sync import WeightSync

    config, rank = AutoConfig.from_pretrained(path), dist.get_rank()
    src, dst = ParallelLayout(dp=4), ParallelLayout(tp=2, first_rank=2)
    engine = RecordingEngine() if rank >= 2 else None
    with pytest.raises(ConfigError, match="engine must be given exactly on the rollout ranks \\[2, 3\\]"):
        WeightSync(None, src, dst, None if engine else RecordingEngine(), hf_config=config)
    with pytest.raises(ConfigError, match="method='bogus' is not one of auto, shm, p2p, all_to_all"):
        WeightSync(None, src, dst, engine, hf_config=config, method="bogus")
    with pytest.raises(ConfigError, match="verify=True needs an engine with megatron-named weights"):
        WeightSync(None, src, dst, engine, hf_config=config, hf_names=True, verify=True)


def _world(paths, pairs: tuple[str, ...], moe_pairs: tuple[str, ...]):
    from rlhf.parallel.groups import GroupCache

    _check_config_errors(paths["llama"])
    cache = GroupCache()
    for family in FAMILIES:
        _check_hf_names(paths[family], ParallelLayout(tp=2, pp=2), ParallelLayout(tp=2, dp=2), cache)
    results = {(family, pair): _check_pair(paths[family], *PAIRS[pair], cache)
               for family in FAMILIES for pair in pairs}
    results.update({(MOE_FAMILY, pair): _check_pair(paths[MOE_FAMILY], *MOE_PAIRS[pair], cache,
                                                    _dense_fc2(MOE_FAMILY)) for pair in moe_pairs})
    return results


@pytest.fixture(scope="module")
def hf_paths(tmp_path_factory):
    paths = {}
    for family in FAMILIES + (MOE_FAMILY,):
        path = str(tmp_path_factory.mktemp(family))
        tiny_hf_model(family, seed=5, num_kv_heads=4).save_pretrained(path)
        paths[family] = path
    return paths


# The default suite syncs across pipeline stages, DP and onto a split mesh, and MoE experts across pp x ep; the
# other pairs (tp regrouping) run in the slow suite. Each selection is one launched world.
QUICK = (("tp2pp2_to_tp1dp4", "split_pp2_to_tp2"), ("pp2dp2ep2_to_dp2",))
REST = (tuple(sorted(set(PAIRS) - set(QUICK[0]))), tuple(sorted(set(MOE_PAIRS) - set(QUICK[1]))))


@pytest.mark.parametrize("pairs, moe_pairs", [QUICK, pytest.param(*REST, marks=pytest.mark.slow)],
                         ids=["quick", "rest"])
def test_sync_is_bitwise_for_every_layout_pair(hf_paths, pairs, moe_pairs):
    results = run_distributed(_world, 4, hf_paths, pairs, moe_pairs, timeout_s=600)
    assert {pair for _, pair in results[0]} == set(pairs) | set(moe_pairs)
    for (family, pair), _ in results[0].items():
        src, dst = {**PAIRS, **MOE_PAIRS}[pair]
        greedy_outputs = []
        for rank, per_rank in enumerate(results):
            stats, greedy, caught = per_rank[(family, pair)]
            for key, value in stats.items():
                if key == "num_rounds_small_buckets":
                    num_rounds, has_remote = value
                    assert (num_rounds > 1) == has_remote, (family, pair)
                    continue
                if key == "plain_messages":
                    num_messages, num_remote_slices, num_verified = value
                    assert num_messages == num_remote_slices, (family, pair, rank)
                    assert (num_verified > 0) == dst.contains(rank), (family, pair, rank)
                    continue
                bytes_received, min_numel, num_verified = value
                itemsize = 2 if "bfloat16" in key[1] else 4
                assert bytes_received == min_numel * itemsize, (family, pair, rank, key)
                assert (num_verified > 0) == dst.contains(rank), (family, pair, rank, key)
            if dst.contains(rank):
                assert greedy is not None
                greedy_outputs.append(greedy)
                assert caught is not None and _dense_fc2(family) in caught, caught
            else:
                assert caught is None
        assert all(torch.equal(g, greedy_outputs[0]) for g in greedy_outputs)
