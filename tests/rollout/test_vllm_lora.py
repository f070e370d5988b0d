"""What `lora.sync: adapter` hands a vLLM engine, without vLLM: the PEFT names of the planned adapter tensors, the
adapter folders a run writes (PEFT loads them; only the loaded versions stay) and vLLM's LoRA arguments."""

import pytest
import torch

from rlhf.errors import ConfigError
from rlhf.models.config import LoraConfig
from rlhf.parallel.layout import ParallelLayout
from rlhf.reshard.lora_sync import adapter_specs, peft_named
from rlhf.rollout.vllm_lora import AdapterFolders, VllmLoraSpec
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
