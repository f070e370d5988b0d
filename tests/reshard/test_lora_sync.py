"""The adapter-only plan (`lora.sync: adapter`): its specs are PEFT's adapter tensors of the model, cut as the
adapted linears are, and a plan moves exactly the adapter slices a rollout rank lacks (no torch.distributed)."""

from __future__ import annotations

import pytest

from rlhf.models.config import LoraConfig
from rlhf.parallel.layout import ParallelLayout
from rlhf.reshard.apply import run_in_process
from rlhf.reshard.lora_sync import adapter_specs
from rlhf.reshard.planner import min_received_numel, plan, plan_for_model
from tests.models.tiny import llama_config

LORA = LoraConfig(enabled=True, rank=4, alpha=8.0)


def _numel(shape) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def test_adapter_specs_are_peft_adapter_tensors_with_their_shapes():
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    config = llama_config()
    hf = peft.get_peft_model(AutoModelForCausalLM.from_config(config), peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                           "down_proj"]))
    want = {name: tuple(p.shape) for name, p in hf.named_parameters() if "lora_" in name}
    specs = adapter_specs(config, LORA, ParallelLayout(tp=2, pp=2))
    got = {}
    for spec in specs:
        layer, rest = spec.name.removeprefix("decoder.layers.").split(".", 1)
        linear, _, which, target = rest.rsplit(".", 3)
        owner = "self_attn" if linear.startswith("self_attention") else "mlp"
        got[f"base_model.model.model.layers.{layer}.{owner}.{target}_proj.lora_{which[-1].upper()}.default.weight"] \
            = spec.full_shape
        assert spec.pp_stage == int(layer) // 2
    assert got == want
    cut = {spec.name.split(".", 3)[-1]: (spec.kind, spec.partition_dim) for spec in specs if ".layers.0." in spec.name}
    assert cut["self_attention.linear_qkv.lora.lora_a.q"] == ("replicated", None)
    assert cut["self_attention.linear_qkv.lora.lora_b.k"] == ("rows", 0)
    assert cut["mlp.linear_fc2.lora.lora_a.down"] == ("row", 1)
    assert cut["mlp.linear_fc2.lora.lora_b.down"] == ("replicated", None)


@pytest.mark.parametrize("src,dst", [(ParallelLayout(tp=2), ParallelLayout(tp=1, dp=2)),
                                     (ParallelLayout(tp=2, pp=2), ParallelLayout(tp=1, dp=2, first_rank=4)),
                                     (ParallelLayout(tp=1, dp=2), ParallelLayout(tp=2))])
def test_an_adapter_plan_rebuilds_every_rollout_shard_and_moves_only_what_a_rank_lacks(src, dst):
    import torch

    config = llama_config()
    src_specs, dst_specs = adapter_specs(config, LORA, src), adapter_specs(config, LORA, dst)
    adapter_plan = plan(src, dst, src_specs, dst_specs, vocab_size=config.vocab_size)
    full = {spec.name: torch.randn(spec.full_shape) for spec in src_specs}

    def shard(spec, tp, tp_rank):
        tensor = full[spec.name]
        return tensor if spec.partition_dim is None else tensor.chunk(tp, dim=spec.partition_dim)[tp_rank]

    per_stage = config.num_hidden_layers // src.pp
    sources = {}
    for rank in src.ranks:
        tp_rank, _, pp_rank, _ = src.coords(rank)
        sources[rank] = {spec.local_name(per_stage): shard(spec, src.tp, tp_rank) for spec in src_specs
                         if spec.pp_stage == pp_rank}
    results = run_in_process(adapter_plan, sources)
    for rank in dst.ranks:
        tp_rank = dst.coords(rank)[0]
        assert {s.local_name(config.num_hidden_layers): shard(s, dst.tp, tp_rank) for s in dst_specs}.keys() \
            == results[rank].keys()
        for spec in dst_specs:
            assert torch.equal(results[rank][spec.local_name(config.num_hidden_layers)], shard(spec, dst.tp, tp_rank))
    adapter_numel = sum(_numel(spec.full_shape) for spec in src_specs)
    moved = sum(adapter_plan.received_numel(rank) for rank in dst.ranks)
    full_moved = sum(plan_for_model(config, src, dst).received_numel(rank) for rank in dst.ranks)
    least = sum(min_received_numel(src, dst, src_specs, dst_specs, vocab_size=config.vocab_size, rank=rank)
                for rank in dst.ranks)
    assert moved == least, "a rank receives exactly the adapter slices it does not hold"
    if not set(src.ranks) & set(dst.ranks):
        assert moved == adapter_numel * dst.dp, "split placement: each rollout replica receives one whole adapter"
    assert moved * 5 <= full_moved, "rank 4 on the tiny model: about a tenth of the merged weights move"
