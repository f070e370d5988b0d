"""What `lora.sync: adapter` hands a vLLM engine, without vLLM: the PEFT names of the planned adapter tensors, the
adapter folders a run writes (PEFT loads them; only the loaded versions stay) and vLLM's LoRA arguments."""

import importlib.util
from pathlib import Path

import pytest
import torch

from rlhf.errors import ConfigError
from rlhf.models.config import LoraConfig
from rlhf.parallel.layout import ParallelLayout
from rlhf.reshard.lora_sync import adapter_specs, peft_named
from rlhf.rollout.vllm_lora import AdapterFolders, VllmLoraSpec
from rlhf.testing.distributed import run_distributed
from rlhf.testing.tiny_models import tiny_hf_config, tiny_hf_model

peft = pytest.importorskip("peft")
LORA = LoraConfig(enabled=True, rank=4, alpha=8.0, targets=("q", "v", "o", "gate", "down"))


def _peft_model():
    model = peft.get_peft_model(tiny_hf_model("llama"), peft.LoraConfig(
        r=4, lora_alpha=8.0, target_modules=["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"]))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.normal_(generator=torch.Generator().manual_seed(len(name)))
    return model


def test_planned_adapter_tensors_carry_peft_names_and_shapes():
    specs = adapter_specs(tiny_hf_config("llama"), LORA, ParallelLayout(tp=1))
    named = peft_named({spec.name: torch.zeros(spec.full_shape) for spec in specs})
    want = {name.replace(".default", ""): tuple(p.shape) for name, p in _peft_model().named_parameters()
            if "lora_" in name}
    assert {name: tuple(t.shape) for name, t in named.items()} == want


def test_adapter_folders_load_in_peft_and_keep_the_loaded_versions_only(tmp_path):
    model = _peft_model()
    tensors = {name.replace(".default", ""): p.detach() for name, p in model.named_parameters() if "lora_" in name}
    spec = VllmLoraSpec(lora=LORA, base_path="/models/base", folder=str(tmp_path / "lora_sync"), slots=2)
    folders, reader = AdapterFolders(spec, is_writer=True), AdapterFolders(spec, is_writer=False)
    for version in (2, 3, 4):
        path = folders.write(version, {n: t * version for n, t in tensors.items()})
        assert reader.write(version, {}) == path  # another rank names the same folder and writes nothing
    assert sorted(p.name for p in (tmp_path / "lora_sync").iterdir()) == ["v3", "v4"]
    loaded = peft.PeftModel.from_pretrained(tiny_hf_model("llama"), str(tmp_path / "lora_sync/v4"))
    assert loaded.peft_config["default"].base_model_name_or_path == "/models/base"
    for name, param in loaded.named_parameters():
        if "lora_" in name:
            assert torch.equal(param, tensors[name.replace(".default", "")] * 4), name
    folders.remove_all()
    assert not (tmp_path / "lora_sync").exists()


def test_vllm_lora_arguments():
    spec = VllmLoraSpec(lora=LORA, base_path="b", folder="f", slots=3)
    assert spec.llm_options() == {"enable_lora": True, "max_loras": 3, "max_cpu_loras": 3, "max_lora_rank": 8}
    assert VllmLoraSpec(lora=LoraConfig(rank=16), base_path="b", folder="f", slots=1).llm_options()[
        "max_lora_rank"] == 16
    with pytest.raises(ConfigError, match=r"^lora.rank=1024 exceeds vLLM's largest LoRA rank 512; lower lora.rank "
                                          r"or use lora.sync=merged$"):
        VllmLoraSpec(lora=LoraConfig(rank=1024), base_path="b", folder="f", slots=1)


# -- real vLLM ---------------------------------------------------------------------------------------------
DIMS = dict(hidden_size=128, num_heads=4, num_kv_heads=2, intermediate_size=256)  # vLLM's CPU attention: head_dim 32
PROMPTS = [[5, 17, 33, 8, 90, 4, 61], [9, 40], [71, 3, 3, 3, 12, 60, 11, 23, 54, 7, 99]]


def _peft_logprobs(model, prompt, response, temperature):
    tokens = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(tokens).logits[0, len(prompt) - 1:-1].double() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None])[:, 0]


def _engine_world(path, root):
    """One vLLM engine at tp = world size: the base pushed, two adapter versions, each generating as PEFT does."""
    import torch.distributed as dist

    from rlhf.parallel.groups import build_layout_groups
    from rlhf.rollout.factory import RolloutConfig, build_engine, close_engine
    from rlhf.rollout.sampling_params import SamplingParams
    from rlhf.rollout.types import PromptBatch
    from rlhf.rollout.vllm_engine import VllmEngineConfig
    from rlhf.rollout.vllm_weights import checkpoint_weights

    pgs = build_layout_groups(ParallelLayout(tp=dist.get_world_size()))
    config = RolloutConfig(engine="vllm", vllm=VllmEngineConfig(enforce_eager=True, kv_cache_gb=0.25))
    engine = build_engine(config, path, pgs, lora=LORA, adapter_folder=f"{root}/lora_sync", adapter_slots=2)
    batch, params = PromptBatch.from_token_lists(PROMPTS), SamplingParams(max_new_tokens=8, temperature=0.8, seed=5,
                                                                          ignore_eos=True)
    engine.load_weights(checkpoint_weights(path))
    with pytest.raises(RuntimeError, match="before an adapter push"):
        engine.generate(batch, params)
    model = _peft_model_on(path)
    worst, responses = [], []
    for scale in (1.0, 3.0):
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.mul_(scale)
        engine.load_adapter({n.replace(".default", ""): p.detach().clone() for n, p in model.named_parameters()
                             if "lora_" in n})
        out = engine.generate(batch, params)
        responses.append(out.response_tokens_rt.tolist())
        worst.append(max(float((out.response_scaled_logprobs_rt[row, :8].double() - _peft_logprobs(
            model, PROMPTS[int(out.prompt_index_r[row])], out.response(row), 0.8)).abs().max())
            for row in range(out.num_rollouts)))
    folders = sorted(p.name for p in (Path(root) / "lora_sync").iterdir())
    version = engine.policy_version
    close_engine(engine)
    return worst, responses, folders, version, (Path(root) / "lora_sync").exists()


def _peft_model_on(path):
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    model = peft.get_peft_model(base, peft.LoraConfig(
        r=4, lora_alpha=8.0, target_modules=["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"]))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.3, generator=torch.Generator().manual_seed(len(name)))
    return model.eval()


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM: make install-vllm")
@pytest.mark.parametrize("tp", [2])
def test_vllm_generates_with_each_pushed_adapter_as_peft_does(tmp_path, tp):
    path = str(tmp_path / "base")
    tiny_hf_model("llama", seed=3, **DIMS).save_pretrained(path)
    results = run_distributed(_engine_world, tp, path, str(tmp_path), env={"VLLM_CPU_KVCACHE_SPACE": "1"},
                              timeout_s=900)
    worst, responses, folders, version, left = results[0]
    assert all(result[1] == responses for result in results), "the TP ranks generate alike"
    assert max(worst) <= 1e-5, worst
    assert responses[0] != responses[1], "the second adapter took effect"
    assert folders == ["v1", "v2"] and version == 3 and not left  # a version for the base, one per adapter
