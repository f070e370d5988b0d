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
from tests.models.tiny import VOCAB, llama_config, qwen2_config, sample_tokens, save_hf_model

LAYOUTS = ((1, 1), (2, 1), (1, 2), (2, 2))
TOKENS = dict(batch=2, seq=12)


def _world(paths: dict[str, str], out_root: str, layouts) -> dict:
    from rlhf.dist.groups import GroupCache
    from rlhf.models.forward import forward_backward
    from rlhf.models.hf_export import export_hf
    from tests.models import world

    cache, results = GroupCache(), {}
    tokens = sample_tokens(TOKENS["batch"], TOKENS["seq"])
    for name, path in paths.items():
        for tp, pp in layouts:
            model, groups = world.layout_model(path, tp, pp, cache)
            reports = forward_backward(model, [world.MicroBatch(tokens)], world.rl_loss(groups, VOCAB), groups)
            grads = world.hf_grads(model, groups)
            export_hf(model, os.path.join(out_root, f"{name}-tp{tp}-pp{pp}"), tokenizer_dir=path)
            entry = results.setdefault((name, tp, pp), {"grads": {}})
            entry["grads"].update(grads)
            if world.is_reporter(groups):
                entry.update(world.numpy_report(reports))
    return results


def _merge(rank_results: list[dict]) -> dict:
    merged: dict = {}
    for result in rank_results:
        for key, entry in result.items():
            target = merged.setdefault(key, {"grads": {}})
            for name, grad in entry.pop("grads").items():
                target["grads"][name] = target["grads"].get(name, 0) + grad
            target.update(entry)
    return merged


def _hf_reference(model, tokens):
    logits = model(tokens).logits
    logprobs = torch.log_softmax(logits, -1)
    token_lp = logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    entropy = -(logprobs.exp() * logprobs).sum(-1)
    (-token_lp.mean() - 0.1 * entropy.mean()).backward()
    grads = {name: p.grad.numpy() for name, p in model.named_parameters()}
    if model.config.tie_word_embeddings:
        grads.pop("lm_head.weight", None)
    return logits.detach(), token_lp.detach(), entropy.detach(), grads


def _tensors(folder: str) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(f for f in os.listdir(folder) if f.endswith(".safetensors")):
        with safe_open(os.path.join(folder, file), framework="pt") as handle:
            out.update({name: handle.get_tensor(name) for name in handle.keys()})
    return out


@pytest.fixture(scope="module")
def parity(tmp_path_factory):
    root = tmp_path_factory.mktemp("parity")
    paths = {"llama": str(root / "llama"), "qwen2": str(root / "qwen2")}
    hf_models = {"llama": save_hf_model(llama_config(), paths["llama"], seed=1),
                 "qwen2": save_hf_model(qwen2_config(), paths["qwen2"], seed=2)}
    results = _merge(run_distributed(_world, 4, paths, str(root / "out"), LAYOUTS, timeout_s=400))
    return root, paths, hf_models, results


@pytest.mark.parametrize("name", ["llama", "qwen2"])
@pytest.mark.parametrize("tp,pp", LAYOUTS)
def test_logits_logprobs_entropy_and_grads_match_transformers(parity, name, tp, pp):
    _, _, hf_models, results = parity
    tokens = sample_tokens(TOKENS["batch"], TOKENS["seq"])
    hf_models[name].zero_grad()
    logits, logprobs, entropy, hf_grads = _hf_reference(hf_models[name], tokens)
    got = results[(name, tp, pp)]
    assert np.abs(got["logits"] - logits.numpy()).max() <= 1e-5
    assert np.abs(got["logprobs"] - logprobs.numpy()).max() <= 1e-5
    assert np.abs(got["entropy"] - entropy.numpy()).max() <= 1e-5
    assert sorted(got["grads"]) == sorted(hf_grads)
    for grad_name, grad in hf_grads.items():
        assert np.abs(got["grads"][grad_name] - grad).max() <= 1e-5, grad_name
    reference = results[(name, 1, 1)]["grads"]
    for grad_name, grad in got["grads"].items():
        assert np.abs(grad - reference[grad_name]).max() <= 1e-6, grad_name


@pytest.mark.parametrize("name", ["llama", "qwen2"])
@pytest.mark.parametrize("tp,pp", LAYOUTS)
def test_export_is_bitwise_round_trip_and_loads_in_transformers(parity, name, tp, pp):
    root, paths, _, _ = parity
    exported = str(root / "out" / f"{name}-tp{tp}-pp{pp}")
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
