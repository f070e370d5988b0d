"""LoRA adapters on the megatron model = PEFT's on the HF model: forward, adapter grads, merged weights, the base
with adapters off, and the PEFT init, at tp1 / tp2 / pp2; under TrainEngine only the adapters train, as PEFT with
torch's AdamW, the base bitwise unchanged, at tp1 x dp2 and tp2; a bf16 base with fp32 adapters. One 2-rank
world for everything."""

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

LAYOUTS = ((1, 1), (2, 1), (1, 2))
RANK, ALPHA, STEPS = 4, 8.0, 3
OPTIM = dict(lr=5e-3, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-4, clip_grad=0.05)
TOKENS = dict(batch=4, seq=10)
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
TARGET_LIST = ["q", "k", "v", "o", "gate", "up", "down"]


def _gather(tensor, dim, group):
    import torch.distributed as dist

    if dim is None:
        return tensor.detach().clone()
    shards = [torch.empty_like(tensor) for _ in range(group.size())]
    dist.all_gather(shards, tensor.detach().contiguous(), group=group)
    return torch.cat(shards, dim=dim)


def _merged_hf(model, groups) -> dict[str, np.ndarray]:
    """Every base weight with its adapter merged in, gathered over tp and named like HF."""
    from rlhf.models.hf_load import param_specs_for, stage_params
    from rlhf.models.lora import merged_weight
    from rlhf.models.shard_rules import merge_shards

    per_stage = model.rlhf_spec.num_layers // groups.pp.size()
    out = {}
    for spec, param in stage_params(model, param_specs_for(model)):
        merged = merged_weight(model, spec.local_name(per_stage), param)
        shards = [torch.empty_like(merged) for _ in range(groups.tp.size())]
        torch.distributed.all_gather(shards, merged.detach().contiguous(), group=groups.tp)
        out.update({name: t.numpy() for name, t in merge_shards(spec, shards, model.rlhf_spec).items()})
    return out


def _layout(path: str, adapter_file: str, cache, tp: int, pp: int) -> dict:
    from rlhf.models.config import LoraConfig
    from rlhf.models.forward import forward_backward
    from rlhf.models.lora import adapter_pairs, adapters_disabled, apply_lora
    from rlhf.models.lora_peft import load_peft_folder
    from tests.models import world

    model, groups = world.layout_model(path, tp, pp, cache)
    apply_lora(model, LoraConfig(enabled=True, rank=RANK, alpha=ALPHA, seed=3))
    entry = {"init": {spec.hf_names[0]: _gather(p, spec.partition_dim, groups.tp).numpy()
                     for spec, p in adapter_pairs(model)}}
    load_peft_folder(model, os.path.dirname(adapter_file))
    tokens = sample_tokens(2, 12)
    loss_fn = world.rl_loss(groups, VOCAB)
    reports = forward_backward(model, [world.MicroBatch(tokens)], loss_fn, groups)
    entry["grads"] = {spec.hf_names[0]: _gather(p.grad, spec.partition_dim, groups.tp).numpy()
                      for spec, p in adapter_pairs(model)}
    entry["frozen"] = all(p.grad is None and not p.requires_grad for name, p in model.named_parameters()
                          if ".lora." not in name)
    entry["merged"] = _merged_hf(model, groups)
    with adapters_disabled(model):
        base = forward_backward(model, [world.MicroBatch(tokens)], loss_fn, groups, forward_only=True)
    if world.is_reporter(groups):
        entry.update(logits=reports[0]["logits"].numpy(), base_logits=base[0]["logits"].numpy())
    return entry if groups.tp.rank() == 0 and groups.dp.rank() == 0 else {}


def _world(path: str, adapter_file: str) -> dict:
    from rlhf.parallel.groups import GroupCache

    cache = GroupCache()
    results = {(tp, pp): _layout(path, adapter_file, cache, tp, pp) for tp, pp in LAYOUTS}
    results["errors"] = {"errors": _load_errors(path, os.path.dirname(adapter_file), cache)}
    results.update({("trained", tp): _train(path, adapter_file, cache, tp) for tp in (1, 2)})
    results["bf16"] = _bf16(path, adapter_file, cache)
    results["qv"] = _qv_logits(path, os.path.join(os.path.dirname(os.path.dirname(adapter_file)), "adapter_qv"),
                               cache)
    return results


def _bf16(path: str, adapter_file: str, cache) -> dict:
    """A bf16 base with fp32 adapters (lora.dtype=fp32) at tp2: its logits, and one TrainEngine step."""
    import torch.distributed as dist

    from rlhf.models.config import LoraConfig
    from rlhf.models.forward import forward_backward
    from rlhf.models.lora import adapter_dtype, adapter_pairs, adapters_disabled, apply_lora
    from rlhf.models.lora_peft import load_peft_folder
    from rlhf.train.config import OptimConfig
    from rlhf.train.engine import TrainEngine
    from tests.models import world

    lora = LoraConfig(enabled=True, rank=RANK, alpha=ALPHA)
    model, groups = world.layout_model(path, 2, 1, cache, params_dtype=torch.bfloat16)
    apply_lora(model, lora, dtype=adapter_dtype(lora))
    load_peft_folder(model, os.path.dirname(adapter_file))
    tokens = sample_tokens(2, 12)
    loss_fn = world.rl_loss(groups, VOCAB)
    logits = forward_backward(model, [world.MicroBatch(tokens)], loss_fn, groups, forward_only=True)[0]["logits"]
    with adapters_disabled(model):
        base_logits = forward_backward(model, [world.MicroBatch(tokens)], loss_fn, groups,
                                       forward_only=True)[0]["logits"]
    base = {name: p.detach().clone() for name, p in model.named_parameters() if ".lora." not in name}
    adapters = {name: p.detach().clone() for name, p in model.named_parameters() if ".lora." in name}
    engine = TrainEngine(model, groups, OptimConfig(total_steps=1, **OPTIM))
    engine.train_step([world.MicroBatch(tokens)], loss_fn)
    entry = {"logits": logits.float().numpy(), "base_logits": base_logits.float().numpy(),
             "dtypes": sorted({str(p.dtype) for _, p in adapter_pairs(model)}),
             "base_dtypes": sorted({str(p.dtype) for name, p in model.named_parameters() if ".lora." not in name}),
             "optimized": sorted({str(p.dtype) for g in engine.optimizer.param_groups for p in g["params"]}),
             "unchanged": all(torch.equal(p, base[name]) for name, p in model.named_parameters() if name in base),
             "moved": all(not torch.equal(p, adapters[name]) for name, p in model.named_parameters()
                          if name in adapters and ".lora_a." in name)}
    return entry if dist.get_rank() == 0 else {}


def _qv_logits(path: str, folder: str, cache) -> dict:
    """tp1 logits with adapters on q and v only: fused qkv rows of k get no adapter (2 query groups interleave)."""
    from rlhf.models.config import LoraConfig
    from rlhf.models.forward import forward_backward
    from rlhf.models.lora import apply_lora
    from rlhf.models.lora_peft import load_peft_folder
    from tests.models import world

    model, groups = world.layout_model(path, 1, 1, cache)
    apply_lora(model, LoraConfig(enabled=True, rank=RANK, alpha=ALPHA, targets=("q", "v")))
    load_peft_folder(model, folder)
    reports = forward_backward(model, [world.MicroBatch(sample_tokens(2, 12))], world.rl_loss(groups, VOCAB),
                               groups, forward_only=True)
    return {"logits": reports[0]["logits"].numpy()} if world.is_reporter(groups) else {}


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


def _load_errors(path: str, folder: str, cache) -> list[str]:
    """The ConfigErrors of loading an adapter of another rank, one missing a tensor, a PEFT folder of another
    rank."""
    from rlhf.errors import ConfigError
    from rlhf.models.config import LoraConfig
    from rlhf.models.lora import apply_lora, load_adapter_tensors
    from rlhf.models.lora_peft import load_peft_folder
    from tests.models import world

    tensors = load_file(os.path.join(folder, "adapter_model.safetensors"))
    missing = {name: t for name, t in tensors.items() if "layers.1.mlp.up_proj.lora_B" not in name}
    errors = []
    root = os.path.dirname(folder)
    cases = ((2 * RANK, tensors), (RANK, missing), (2 * RANK, folder), (RANK, os.path.join(root, "adapter_deep")),
             (RANK, os.path.join(root, "adapter_wide")))
    for rank, bad in cases:
        model, _ = world.layout_model(path, 1, 1, cache)
        apply_lora(model, LoraConfig(enabled=True, rank=rank, alpha=ALPHA))
        try:
            load_adapter_tensors(model, bad) if isinstance(bad, dict) else load_peft_folder(model, bad)
        except ConfigError as error:
            errors.append(str(error))
    return errors


def _peft_model(path: str, targets: tuple[str, ...] = TARGETS):
    """The HF model with PEFT adapters on `targets`, A and B random (B zero would hide every mistake)."""
    base = AutoModelForCausalLM.from_pretrained(path)
    model = peft.get_peft_model(base, peft.LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0,
                                                      target_modules=list(targets)))
    generator = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
    return model


@pytest.fixture(scope="module")
def lora_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    path, adapter_dir = str(root / "llama"), str(root / "adapter")
    save_hf_model(llama_config(), path, seed=2)
    model = _peft_model(path)
    model.save_pretrained(adapter_dir)
    _peft_model(path, ("q_proj", "v_proj")).save_pretrained(str(root / "adapter_qv"))
    for name, other in (("deep", llama_config(num_hidden_layers=6)), ("wide", llama_config(hidden_size=32))):
        save_hf_model(other, str(root / name), seed=2)  # PEFT folders of other bases (same rank and targets)
        _peft_model(str(root / name)).save_pretrained(str(root / f"adapter_{name}"))
    results: dict = {}
    for rank_result in run_distributed(_world, 2, path, os.path.join(adapter_dir, "adapter_model.safetensors"),
                                       timeout_s=900):
        for key, entry in rank_result.items():
            target = results.setdefault(key, {})
            for field, value in entry.items():
                target[field] = {**target.get(field, {}), **value} if isinstance(value, dict) else value
    return path, model, results


@pytest.mark.parametrize("tp,pp", LAYOUTS)
def test_forward_and_adapter_grads_match_peft(lora_runs, tp, pp):
    path, model, results = lora_runs
    got = results[(tp, pp)]
    tokens = sample_tokens(2, 12)
    model.zero_grad()
    logits = model(tokens).logits
    hf_rl_loss_backward(logits, tokens)
    assert np.abs(got["logits"] - logits.detach().numpy()).max() <= 1e-5
    peft_grads = {name.replace(".default", ""): p.grad.numpy() for name, p in model.named_parameters()
                  if p.requires_grad}
    assert sorted(got["grads"]) == sorted(peft_grads) and len(peft_grads) == 4 * 7 * 2
    for name, grad in peft_grads.items():
        assert np.abs(got["grads"][name] - grad).max() <= 1e-5, name
    assert got["frozen"]


@pytest.mark.parametrize("tp,pp", LAYOUTS)
def test_adapters_off_is_the_base_model_and_merged_weights_are_peft_merge(lora_runs, tp, pp):
    path, model, results = lora_runs
    got = results[(tp, pp)]
    tokens = sample_tokens(2, 12)
    with torch.no_grad():
        base_logits = AutoModelForCausalLM.from_pretrained(path)(tokens).logits
        merged = {name: t.numpy() for name, t in _peft_model(path).merge_and_unload().state_dict().items()}
    assert np.abs(got["base_logits"] - base_logits.numpy()).max() <= 1e-5
    assert sorted(got["merged"]) == sorted(merged)
    for name, weight in merged.items():
        assert np.abs(got["merged"][name] - weight).max() <= 1e-6, name


def test_init_is_peft_kaiming_uniform_a_and_zero_b_on_every_layout(lora_runs):
    _, _, results = lora_runs
    reference = results[(1, 1)]["init"]
    for tp, pp in LAYOUTS:
        init = results[(tp, pp)]["init"]
        assert sorted(init) == sorted(reference)
        for name, tensor in init.items():
            assert np.array_equal(tensor, reference[name]), (tp, pp, name)
    for name, tensor in reference.items():
        if "lora_B" in name:
            assert not tensor.any(), name
        else:
            bound = 1.0 / np.sqrt(tensor.shape[1])
            largest = np.abs(tensor).max()
            assert bound >= largest > 0.9 * bound and tensor.std() > 0.5 * bound, name


def test_an_adapter_of_another_rank_or_base_is_a_one_line_error(lora_runs):
    path, _, results = lora_runs
    root = os.path.dirname(path)
    folder = os.path.join(root, "adapter")
    assert results["errors"]["errors"] == [
        "adapter tensor 'base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight' has shape [4, 64], this "
        "model's lora.rank and base need [8, 64] (another base or lora.rank?)",
        "the adapter has no tensor 'base_model.model.model.layers.1.mlp.up_proj.lora_B.weight'; was it "
        "trained for another base model or other lora.targets?",
        f"lora.adapter_path={folder} holds an adapter with {{'r': 4, 'lora_alpha': 8.0, 'targets': {TARGET_LIST}}}, "
        f"the lora section asks for {{'r': 8, 'lora_alpha': 8.0, 'targets': {TARGET_LIST}}}; set lora.rank=4 "
        "lora.alpha=8.0 lora.targets=[q,k,v,o,gate,up,down]",
        f"lora.adapter_path={root}/adapter_deep holds 84 adapter tensors, the 4-layer base (model.path) takes 56 "
        "(first difference 'base_model.model.model.layers.4.mlp.down_proj.lora_A.weight'): it adapts another base "
        f"({root + '/deep'!r})",
        f"lora.adapter_path={root}/adapter_wide: 'base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight' "
        f"has shape [4, 32], the base (model.path) needs [4, 64]: it adapts another base ({root + '/wide'!r})"]


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


@pytest.fixture(scope="module")
def peft_trained(lora_runs):
    return _peft_steps(copy.deepcopy(lora_runs[1]))


@pytest.mark.parametrize("tp", [1, 2])
def test_lora_steps_train_adapters_only_as_peft_with_adamw(lora_runs, peft_trained, tp):
    _, _, results = lora_runs
    got = results[("trained", tp)]
    assert got["unchanged"] and got["optimizes_adapters_only"]
    norms, adapter = peft_trained
    assert np.allclose(got["norms"], norms, rtol=1e-4, atol=0)  # fp32 rounding grows over the steps
    assert sorted(got["adapter"]) == sorted(adapter)
    for name, tensor in adapter.items():
        assert np.abs(got["adapter"][name] - tensor).max() <= 1e-5, name  # Adam divides fp32 rounding by sqrt(v)


def test_adapters_on_some_targets_match_peft(lora_runs):
    path, _, results = lora_runs
    tokens = sample_tokens(2, 12)
    with torch.no_grad():
        logits = _peft_model(path, ("q_proj", "v_proj"))(tokens).logits
    assert np.abs(results["qv"]["logits"] - logits.numpy()).max() <= 1e-5


def test_a_bf16_base_with_fp32_adapters_is_peft_within_bf16_rounding_and_trains_fp32_adapters(lora_runs):
    path, _, results = lora_runs
    got = results["bf16"]
    assert got["dtypes"] == ["torch.float32"] and got["base_dtypes"] == ["torch.bfloat16"]
    assert got["optimized"] == ["torch.float32"], "adapters and their Adam state are fp32"
    assert got["unchanged"] and got["moved"]
    folder = os.path.join(os.path.dirname(path), "adapter")
    tokens = sample_tokens(2, 12)
    with torch.no_grad():
        hf_bf16 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
        base_reference = hf_bf16(tokens).logits.float().numpy()
        bf16 = peft.PeftModel.from_pretrained(hf_bf16, folder)
        assert {p.dtype for n, p in bf16.named_parameters() if "lora_" in n} == {torch.float32}
        reference = bf16(tokens).logits.float().numpy()
        exact = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path), folder)(tokens).logits
    # rlhf's bf16 forward is as far from the fp32 one as PEFT's own bf16 forward is (bf16 rounding, not a bug)
    exact = exact.numpy()
    peft_error = np.abs(reference - exact).max()
    assert np.abs(got["logits"] - exact).max() <= 1.5 * peft_error
    assert np.abs(got["logits"] - reference).max() <= 2 * peft_error
    base_gap = np.abs(got["base_logits"] - base_reference).max()
    assert np.abs(got["logits"] - got["base_logits"]).max() > 10 * base_gap, "the fp32 adapters act"
