"""Parity of rlhf's megatron models with `transformers` (fp32) on every layout 4 gloo ranks can hold, plus
bitwise HF -> rlhf -> HF round trips and value-head models. One launched world runs all layouts.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from rlhf.testing.distributed import run_distributed
from rlhf.models.spec import ModelSpec
from tests.models.tiny import (VOCAB, hf_rl_loss_backward, llama_config, mistral_config, mixtral_config, qwen2_config,
                               qwen3_config, qwen3_moe_config, sample_tokens, save_hf_model)

LAYOUTS = ((1, 1), (2, 1), (1, 2), (2, 2))
# (model, tp, pp, recompute, micro-batches): Llama GQA untied and Qwen2 qkv-bias tied on every layout (1F1B
# with 2 micro-batches at pp=2); MQA with activation recompute; Qwen3 (q/k norms, head_dim != hidden/heads) on
# every layout; the MoE models (Qwen3-MoE with a dense layer, Mixtral) on every layout, at tp=2 each expert split
# over tp (rlhf.models.moe_tp), including 3 experts with dense layers from decoder_sparse_step=2.
CASES = [(name, tp, pp, False, pp, 1) for name in ("llama", "qwen2", "qwen3") for tp, pp in LAYOUTS] + [
    ("mqa", 1, 1, False, 1, 1), ("mqa", 1, 2, True, 2, 1), ("mistral", 1, 1, False, 1, 1),
    ("mistral", 2, 1, False, 1, 1), ("qwen3_moe", 1, 1, False, 1, 1), ("qwen3_moe", 1, 2, False, 2, 1),
    ("mixtral", 1, 1, False, 1, 1), ("mixtral", 1, 2, True, 2, 1),
    # expert parallelism (the experts split over the dp ranks): ep2 of dp4, ep2 x pp2, ep4
    ("qwen3_moe", 1, 1, False, 1, 2), ("qwen3_moe", 1, 2, False, 2, 2), ("mixtral", 1, 1, False, 1, 4),
    ("mixtral", 1, 2, True, 2, 2),
    # tensor parallelism: tp2 (dp2), tp2 x pp2, tp2 x ep2 (dp2, all-to-all dispatcher), 3 experts at tp2 x pp2
    ("qwen3_moe", 2, 1, False, 1, 1), ("qwen3_moe", 2, 2, False, 2, 1), ("mixtral", 2, 1, False, 1, 2),
    ("moe3", 1, 1, False, 1, 1), ("moe3", 2, 2, True, 2, 1)]
CASE_IDS = [case[:3] + case[5:] for case in CASES]
VALUE_CASES = [("llama", 2, 2), ("qwen3", 2, 2), ("qwen3_moe", 1, 2)]
TOKENS = dict(batch=2, seq=12)
ROUTER_LOSSES = {"aux_loss_coeff": 0.1, "z_loss_coeff": 0.01}
ROUTER_LOSS_LAYOUTS = [(1, 1, {}), (1, 1, ROUTER_LOSSES), (2, 1, ROUTER_LOSSES), (2, 2, ROUTER_LOSSES)]


def _world(paths: dict[str, str], out_root: str, cases, skip_value_head: bool = False) -> dict:
    import torch.distributed as dist

    from rlhf.parallel.groups import GroupCache
    from rlhf.models.forward import forward_backward
    from rlhf.models.hf_export import export_hf
    from tests.models import world

    cache, results = GroupCache(), {}
    tokens = sample_tokens(TOKENS["batch"], TOKENS["seq"])
    read_names = world.record_hf_reads()
    for name, tp, pp, recompute, num_micro_batches, ep in cases:
        dispatcher = "alltoall" if (name, tp, ep) == ("mixtral", 2, 2) else "allgather"
        model, groups = world.layout_model(paths[name], tp, pp, cache, ep=ep, recompute=recompute,
                                           moe_kwargs={"token_dispatcher": dispatcher})
        micro_batches = [world.MicroBatch(part) for part in tokens.chunk(num_micro_batches)]
        loss_fn = world.rl_loss(groups, VOCAB, scale=1.0 / num_micro_batches)
        reports = forward_backward(model, micro_batches, loss_fn, groups)
        grads = world.hf_grads(model, groups)
        export_hf(model, os.path.join(out_root, f"{name}-tp{tp}-pp{pp}-ep{ep}"), tokenizer_dir=paths[name],
                  max_shard_bytes=64 << 10)  # several files per stage: exercises the index
        entry = results.setdefault((name, tp, pp, ep), {"grads": {}})
        entry["grads"].update(grads)
        entry[("read", dist.get_rank())] = sorted(read_names)
        read_names.clear()
        if world.is_reporter(groups):
            entry.update(world.numpy_report(reports))
    if not skip_value_head:
        for name, tp, pp in VALUE_CASES:
            results[f"value-{name}"] = world.value_head_round_trip(paths[name], out_root, cache, tokens,
                                                                   f"value-{name}", tp, pp)
        results["padded"] = world.padded_logits(paths["llama"], cache, *_padded_batch())
        for tp, ep, losses in ROUTER_LOSS_LAYOUTS:
            grads = world.router_loss_step_grads(paths["qwen3_moe"], cache, tp, ep, losses)
            results[("router_losses", tp, ep, bool(losses))] = {"grads": grads}
    return results


def _padded_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Row 0: 2 left pads, 7 tokens, 3 right pads; row 1: 12 tokens."""
    tokens = sample_tokens(2, 12, seed=4)
    valid = torch.ones(2, 12, dtype=torch.bool)
    valid[0, :2] = valid[0, 9:] = False
    return tokens.masked_fill(~valid, 0), valid


def _merge(rank_results: list[dict]) -> dict:
    merged: dict = {}
    for result in rank_results:
        for key, entry in result.items():
            target = merged.setdefault(key, {"grads": {}})
            for name, grad in entry.pop("grads", {}).items():
                target["grads"][name] = target["grads"].get(name, 0) + grad
            target.update(entry)
    return merged


def _hf_reference(model, tokens):
    logits = model(tokens).logits
    token_lp, entropy = hf_rl_loss_backward(logits, tokens)
    grads = _per_expert({name: p.grad.numpy() for name, p in model.named_parameters()}, model.config)
    if model.config.tie_word_embeddings:
        grads.pop("lm_head.weight", None)
    return logits.detach(), token_lp.detach(), entropy.detach(), grads


def _per_expert(grads: dict, hf_config) -> dict:
    """transformers keeps each layer's experts fused ([experts, 2 * ffn, h] gate+up, [experts, h, ffn] down); the
    checkpoint (and rlhf) name them one expert at a time, under the model's own sparse-block name."""
    moe = ModelSpec.from_hf(hf_config).moe
    if moe is None:
        return grads
    out = {}
    gate, up, down = moe.hf_expert_names
    for name, grad in grads.items():
        layer_prefix, _, rest = name.partition(".mlp.")
        block = f"{layer_prefix}.{moe.hf_prefix}."
        if rest == "gate.weight":
            out[block + rest] = grad
        elif rest == "experts.gate_up_proj":
            for expert, fused in enumerate(grad):
                out[f"{block}experts.{expert}.{gate}.weight"], out[f"{block}experts.{expert}.{up}.weight"] = \
                    np.split(fused, 2)
        elif rest == "experts.down_proj":
            out.update({f"{block}experts.{expert}.{down}.weight": g for expert, g in enumerate(grad)})
        else:
            out[name] = grad
    return out


def _tensors(folder: str) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(f for f in os.listdir(folder) if f.endswith(".safetensors")):
        with safe_open(os.path.join(folder, file), framework="pt") as handle:
            out.update({name: handle.get_tensor(name) for name in handle.keys()})
    return out


@pytest.fixture(scope="module")
def parity(tmp_path_factory):
    root = tmp_path_factory.mktemp("parity")
    configs = {"llama": llama_config(), "qwen2": qwen2_config(), "mqa": llama_config(num_key_value_heads=1),
               "mistral": mistral_config(),
               "qwen3": qwen3_config(), "qwen3_moe": qwen3_moe_config(), "mixtral": mixtral_config(),
               "moe3": qwen3_moe_config(num_experts=3, mlp_only_layers=[], decoder_sparse_step=2)}
    paths = {name: str(root / name) for name in configs}
    hf_models = {name: save_hf_model(config, paths[name], seed=seed)
                 for seed, (name, config) in enumerate(configs.items())}
    results = _merge(run_distributed(_world, 4, paths, str(root / "out"), CASES, timeout_s=900))
    return root, paths, hf_models, results


@pytest.mark.parametrize("name,tp,pp,ep", CASE_IDS)
def test_logits_logprobs_entropy_and_grads_match_transformers(parity, name, tp, pp, ep):
    _, _, hf_models, results = parity
    tokens = sample_tokens(TOKENS["batch"], TOKENS["seq"])
    hf_models[name].zero_grad()
    logits, logprobs, entropy, hf_grads = _hf_reference(hf_models[name], tokens)
    got = results[(name, tp, pp, ep)]
    assert np.abs(got["logits"] - logits.numpy()).max() <= 1e-5
    assert np.abs(got["logprobs"] - logprobs.numpy()).max() <= 1e-5
    assert np.abs(got["entropy"] - entropy.numpy()).max() <= 1e-5
    hot = torch.log_softmax(logits / 2.0, -1)
    assert np.abs(got["logprobs_t2"] - hot.gather(-1, tokens.unsqueeze(-1)).squeeze(-1).numpy()).max() <= 1e-5
    assert np.abs(got["entropy_t2"] - (-(hot.exp() * hot).sum(-1)).numpy()).max() <= 1e-5
    assert sorted(got["grads"]) == sorted(hf_grads)
    for grad_name, grad in hf_grads.items():
        assert np.abs(got["grads"][grad_name] - grad).max() <= 1e-5, grad_name
    reference = results[(name, 1, 1, 1)]["grads"]  # grads at any tp x pp x ep equal tp1 x pp1 x ep1's
    for grad_name, grad in got["grads"].items():
        assert np.abs(grad - reference[grad_name]).max() <= 1e-6, grad_name


@pytest.mark.parametrize("name,tp,pp,ep", CASE_IDS)
def test_export_is_bitwise_round_trip_and_loads_in_transformers(parity, name, tp, pp, ep):
    root, paths, _, _ = parity
    exported = str(root / "out" / f"{name}-tp{tp}-pp{pp}-ep{ep}")
    source, result = _tensors(paths[name]), _tensors(exported)
    assert sorted(result) == sorted(source)
    for tensor_name, tensor in source.items():
        assert result[tensor_name].dtype == tensor.dtype and torch.equal(result[tensor_name], tensor), tensor_name
    assert not os.path.exists(exported + ".partial")
    with open(os.path.join(exported, "tokenizer_config.json")) as f:
        assert json.load(f) == {"model_max_length": 64}
    reloaded = AutoModelForCausalLM.from_pretrained(exported)
    original = AutoModelForCausalLM.from_pretrained(paths[name])
    tokens = sample_tokens(2, 8, seed=3)
    with torch.no_grad():
        assert torch.equal(reloaded(tokens).logits, original(tokens).logits)


@pytest.mark.parametrize("name", [case[0] for case in VALUE_CASES])
def test_value_head_from_causal_lm_exports_as_sequence_classifier(parity, name):
    root, paths, _, results = parity
    got = results[f"value-{name}"]
    exported = str(root / "out" / f"value-{name}")
    classifier = AutoModelForSequenceClassification.from_pretrained(exported)
    assert classifier.config.num_labels == 1
    tokens = sample_tokens(TOKENS["batch"], TOKENS["seq"])
    with torch.no_grad():
        values = classifier.score(classifier.model(tokens).last_hidden_state)
    assert np.abs(got["values"] - values.numpy()).max() <= 1e-5
    assert np.array_equal(got["values"], got["reloaded_values"])  # score.weight came back in
    source, result = _tensors(paths[name]), _tensors(exported)
    assert sorted(result) == sorted(set(source) - {"lm_head.weight"} | {"score.weight"})
    for tensor_name in set(source) - {"lm_head.weight"}:
        assert torch.equal(result[tensor_name], source[tensor_name]), tensor_name


def test_padded_batch_matches_each_sequence_run_alone(parity):
    _, _, hf_models, results = parity
    tokens, valid = _padded_batch()
    got = results["padded"]["logits"]
    with torch.no_grad():
        for row in range(2):
            alone = hf_models["llama"](tokens[row][valid[row]].unsqueeze(0)).logits[0]
            assert np.abs(got[row][valid[row].numpy()] - alone.numpy()).max() <= 1e-5


def test_each_pipeline_stage_reads_only_its_own_tensors(parity):
    _, _, _, results = parity
    reads = results[("llama", 2, 2, 1)]
    stage0 = set(reads[("read", 0)]) | set(reads[("read", 1)])
    stage1 = set(reads[("read", 2)]) | set(reads[("read", 3)])
    assert "model.embed_tokens.weight" in stage0 and "lm_head.weight" in stage1
    assert not any(n.startswith(("model.layers.2.", "model.layers.3.", "lm_head", "model.norm")) for n in stage0)
    assert not any(n.startswith(("model.layers.0.", "model.layers.1.", "model.embed")) for n in stage1)


def test_each_expert_parallel_rank_reads_only_its_own_experts(parity):
    _, _, _, results = parity
    reads = results[("mixtral", 1, 1, 4)]  # ep4 over dp4: rank r holds expert r of every layer
    for rank in range(4):
        experts = {int(n.split(".experts.")[1].split(".")[0]) for n in reads[("read", rank)] if ".experts." in n}
        assert experts == {rank}, (rank, experts)
        assert "model.layers.0.block_sparse_moe.gate.weight" in reads[("read", rank)]


def test_router_loss_grads_at_tp2_and_tp2_ep2_equal_tp1(parity):
    """One TrainEngine step with the aux and z router losses on, on a padded batch whose token count tp does not
    divide: every grad (router weights included) at tp2 (dp2) and tp2 x ep2 (dp2) equals tp1's (dp4) within 1e-6
    (relative to the tensor's largest grad where that exceeds 1);
    the router losses do move the router grads."""
    results = parity[3]
    reference = results[("router_losses", 1, 1, True)]["grads"]
    without = results[("router_losses", 1, 1, False)]["grads"]
    router = [name for name in reference if name.endswith("mlp.gate.weight")]
    assert router and max(np.abs(reference[name] - without[name]).max() for name in router) > 1e-4
    for tp, ep in ((2, 1), (2, 2)):
        got = results[("router_losses", tp, ep, True)]["grads"]
        assert sorted(got) == sorted(reference)
        for name, grad in reference.items():
            assert np.abs(got[name] - grad).max() <= 1e-6 * max(1.0, np.abs(grad).max()), (tp, ep, name)
