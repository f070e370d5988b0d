"""A LoRA actor under TrainEngine: only the adapters get grads, optimizer state and updates (= PEFT + torch AdamW,
clipping included), the base stays bitwise the same, at tp2 and dp2 (one 2-rank world)."""

from __future__ import annotations

import copy
import os

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from rlhf.testing.distributed import run_distributed
from tests.models.tiny import VOCAB, hf_rl_loss_backward, llama_config, sample_tokens, save_hf_model

peft = pytest.importorskip("peft")

RANK, ALPHA, STEPS = 4, 8.0, 3
OPTIM = dict(lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8, clip_grad=0.05)
TOKENS = dict(batch=4, seq=10)


def _train(path: str, adapter_file: str, cache, tp: int) -> dict:
    import torch.distributed as dist

    from rlhf.models.config import LoraConfig
    from rlhf.models.lora import adapter_pairs, apply_lora, gathered_adapter_tensors, load_adapter_tensors
    from rlhf.train.config import OptimConfig
    from rlhf.train.engine import TrainEngine
    from tests.models import world

    model, groups = world.layout_model(path, tp, 1, cache)
    apply_lora(model, LoraConfig(enabled=True, rank=RANK, alpha=ALPHA))
    load_adapter_tensors(model, load_file(adapter_file))
    base = {name: p.detach().clone() for name, p in model.named_parameters() if ".lora." not in name}
    engine = TrainEngine(model, groups, OptimConfig(total_steps=STEPS, **OPTIM))
    tokens = sample_tokens(**TOKENS)
    # the two halves of the batch: one per DP rank at dp2, two micro-batches at dp1 (the losses sum either way)
    micro = [world.MicroBatch(tokens[k::2]) for k in range(2) if k % groups.dp.size() == groups.dp.rank()]
    loss_fn = world.rl_loss(groups, VOCAB)
    norms = [engine.train_step(micro, loss_fn).grad_norm for _ in range(STEPS)]
    trained = {id(p) for group in engine.optimizer.param_groups for p in group["params"]}
    adapters = {id(p) for _, p in adapter_pairs(model)}
    unchanged = all(torch.equal(p, base[name]) for name, p in model.named_parameters() if ".lora." not in name)
    entry = {"unchanged": unchanged, "optimizes_adapters_only": trained == adapters, "norms": norms,
             "adapter": {name: t.numpy() for name, t in gathered_adapter_tensors(model).items()}}
    return entry if dist.get_rank() == 0 else {}


def _world(path: str, adapter_file: str) -> dict:
    from rlhf.parallel.groups import GroupCache

    cache = GroupCache()
    return {tp: _train(path, adapter_file, cache, tp) for tp in (1, 2)}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_engine")
    path, adapter_dir = str(root / "llama"), str(root / "adapter")
    save_hf_model(llama_config(num_hidden_layers=2), path, seed=4)
    model = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(path),
                                peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules="all-linear"))
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    model.save_pretrained(adapter_dir)
    results = run_distributed(_world, 2, path, os.path.join(adapter_dir, "adapter_model.safetensors"),
                              timeout_s=900)[0]
    return model, results


def _peft_steps(model) -> tuple[list[float], dict[str, np.ndarray]]:
    """STEPS AdamW steps on the PEFT model, the loss summed over the two DP halves (rlhf's loss contract)."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=OPTIM["lr"], betas=OPTIM["betas"], eps=OPTIM["eps"],
                                  weight_decay=OPTIM["weight_decay"])
    tokens, norms = sample_tokens(**TOKENS), []
    for _ in range(STEPS):
        optimizer.zero_grad()
        for half in (tokens[0::2], tokens[1::2]):
            hf_rl_loss_backward(model(half).logits, half)
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, OPTIM["clip_grad"])))
        optimizer.step()
    return norms, {name.replace(".default", ""): p.detach().numpy() for name, p in model.named_parameters()
                   if p.requires_grad}


@pytest.mark.parametrize("tp", [1, 2])
def test_lora_steps_train_adapters_only_as_peft_with_adamw(trained, tp):
    model, results = trained
    got = results[tp]
    assert got["unchanged"] and got["optimizes_adapters_only"]
    norms, adapter = _peft_steps(copy.deepcopy(model))
    assert np.allclose(got["norms"], norms, rtol=1e-5, atol=0)
    assert sorted(got["adapter"]) == sorted(adapter)
    for name, tensor in adapter.items():
        assert np.abs(got["adapter"][name] - tensor).max() <= 1e-5, name  # Adam divides fp32 rounding by sqrt(v)
