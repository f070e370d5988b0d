"""Continuing from a PEFT LoRA folder (`lora.adapter_path`, `rlhf convert peft-check`): what is read and checked
before anything is built, from the folder's config and tensor header. Each folder rlhf cannot continue is a
one-line ConfigError: another base (other layers or shapes), a module rlhf does not adapt, PEFT options rlhf does
not implement, another rank than the lora section's."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from transformers import AutoConfig, AutoModelForCausalLM

from rlhf.errors import ConfigError
from rlhf.models.config import LoraConfig
from rlhf.models.lora_peft import check_peft_adapter, read_peft_folder
from tests.models.tiny import llama_config, save_hf_model

peft = pytest.importorskip("peft")
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _save_adapter(base: str, folder: str, targets, rank: int = 4, **options) -> str:
    model = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(base), peft.LoraConfig(
        r=rank, lora_alpha=8.0, target_modules=targets, **options))
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("peft")
    bases = {name: str(root / name) for name in ("base", "deep", "wide")}
    for name, config in (("base", llama_config()), ("deep", llama_config(num_hidden_layers=6)),
                         ("wide", llama_config(hidden_size=32))):
        save_hf_model(config, bases[name], seed=2)
    made = {"good": _save_adapter(bases["base"], str(root / "good"), ALL),
            "qv": _save_adapter(bases["base"], str(root / "qv"), ["q_proj", "v_proj"]),
            "linear": _save_adapter(bases["base"], str(root / "linear"), "all-linear"),
            "head": _save_adapter(bases["base"], str(root / "head"), ["q_proj", "lm_head"]),
            "rslora": _save_adapter(bases["base"], str(root / "rslora"), ALL, use_rslora=True),
            "deep": _save_adapter(bases["deep"], str(root / "deep_adapter"), ALL),
            "wide": _save_adapter(bases["wide"], str(root / "wide_adapter"), ALL)}
    made["lying"] = str(root / "lying")  # a config saying r=8 over rank-4 tensors
    shutil.copytree(made["good"], made["lying"])
    config_path = os.path.join(made["lying"], "adapter_config.json")
    with open(config_path) as f:
        saved = json.load(f)
    with open(config_path, "w") as f:
        json.dump({**saved, "r": 8}, f)
    return bases, made


def test_a_peft_folder_is_read_and_checked_against_its_base(folders):
    bases, made = folders
    base = AutoConfig.from_pretrained(bases["base"])
    adapter = read_peft_folder(made["good"])
    assert (adapter.rank, adapter.alpha, adapter.base) == (4, 8.0, bases["base"])
    assert adapter.targets == ("q", "k", "v", "o", "gate", "up", "down") and len(adapter.shapes) == 2 * 7 * 4
    check_peft_adapter(adapter, base, LoraConfig(enabled=True, rank=4, alpha=8.0))
    assert read_peft_folder(made["linear"]).targets == adapter.targets  # PEFT's all-linear: every linear
    qv = read_peft_folder(made["qv"])
    check_peft_adapter(qv, base, LoraConfig(enabled=True, rank=4, alpha=8.0, targets=("v", "q")))
    assert qv.overrides() == ["lora.enabled=true", "lora.rank=4", "lora.alpha=8.0", "lora.targets=[q,v]",
                              f"lora.adapter_path={made['qv']}"]


def test_a_folder_rlhf_cannot_continue_is_a_one_line_error(folders, tmp_path):
    bases, made = folders
    base, lora = AutoConfig.from_pretrained(bases["base"]), LoraConfig(enabled=True, rank=4, alpha=8.0)
    q_a = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    cases = [
        (made["head"], lora, f"lora.adapter_path={made['head']} adapts lm_head, which rlhf's LoRA cannot adapt (it "
                             "adapts q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj); use an adapter "
                             "of those modules only"),
        (made["rslora"], lora, f"lora.adapter_path={made['rslora']} sets use_rslora=True, which rlhf's LoRA does not "
                               "implement; use a plain LoRA adapter (use_rslora=False)"),
        (made["good"], LoraConfig(enabled=True, rank=8, alpha=8.0),
         f"lora.adapter_path={made['good']} holds an adapter with {{'r': 4, 'lora_alpha': 8.0, 'targets': ['q', 'k', "
         "'v', 'o', 'gate', 'up', 'down']}, the lora section asks for {'r': 8, 'lora_alpha': 8.0, 'targets': ['q', "
         "'k', 'v', 'o', 'gate', 'up', 'down']}; set lora.rank=4 lora.alpha=8.0 lora.targets=[q,k,v,o,gate,up,down]"),
        (made["deep"], lora, f"lora.adapter_path={made['deep']} holds 84 adapter tensors, the 4-layer base "
                             "(model.path) takes 56 (first difference 'base_model.model.model.layers.4.mlp.down_proj."
                             f"lora_A.weight'): it adapts another base ({bases['deep']!r})"),
        (made["wide"], lora, f"lora.adapter_path={made['wide']}: {q_a!r} has shape [4, 32], the base (model.path) "
                             f"needs [4, 64]: it adapts another base ({bases['wide']!r})"),
        (made["lying"], LoraConfig(enabled=True, rank=8, alpha=8.0),
         f"lora.adapter_path={made['lying']}: {q_a!r} has shape [4, 64], the base (model.path) needs [8, 64]: it "
         f"adapts another base ({bases['base']!r})"),
        (str(tmp_path), lora, f"lora.adapter_path={tmp_path} has no adapter_config.json; point it at a PEFT adapter "
                              "folder (what peft's save_pretrained or `rlhf export` writes)")]
    for folder, config, message in cases:
        with pytest.raises(ConfigError) as error:
            check_peft_adapter(read_peft_folder(folder), base, config)
        assert str(error.value) == message


def test_convert_peft_check_prints_the_settings_that_continue_an_adapter(folders, capsys):
    from rlhf.cli.main import main

    bases, made = folders
    assert main(["convert", "peft-check", "--adapter", made["qv"], "--hf", bases["base"]]) == 0
    assert capsys.readouterr().out.strip() == (f"model.path={bases['base']} lora.enabled=true lora.rank=4 "
                                               f"lora.alpha=8.0 lora.targets=[q,v] lora.adapter_path={made['qv']}")
    assert main(["convert", "peft-check", "--adapter", made["wide"], "--hf", bases["base"]]) == 2
    assert "it adapts another base" in capsys.readouterr().err
