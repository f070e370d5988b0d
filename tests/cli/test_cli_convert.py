"""`rlhf convert` at tp=2 on two gloo ranks: a bf16 HF folder -> fp32 sharded checkpoint -> HF (bf16 again) is
bitwise identical; a bad HF folder is a one-line error (exit 3) that leaves nothing behind."""

from __future__ import annotations

import os

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from rlhf.testing.distributed import run_distributed
from tests.models.test_parity import _tensors
from tests.models.tiny import qwen2_config, save_hf_model


def _convert_world(hf: str, bad_hf: str, odd_hf: str, root: str) -> list[int]:
    from rlhf.cli.main import main

    ckpt, out = os.path.join(root, "ckpt"), os.path.join(root, "hf")
    codes = [main(["convert", "hf-to-ckpt", "--hf", hf, "--out", ckpt, "--tp", "2"]),
             main(["convert", "ckpt-to-hf", "--ckpt", ckpt, "--out", out, "--tokenizer-dir", hf]),
             main(["convert", "hf-to-ckpt", "--hf", bad_hf, "--out", os.path.join(root, "bad-ckpt"), "--tp", "2"]),
             main(["convert", "hf-to-ckpt", "--hf", odd_hf, "--out", os.path.join(root, "pp-ckpt"), "--pp", "2"])]
    return codes


def test_convert_round_trip_under_two_ranks(tmp_path, capfd):
    hf, bad_hf = str(tmp_path / "qwen2"), str(tmp_path / "bad")
    save_hf_model(qwen2_config(), hf, dtype=torch.bfloat16)
    save_hf_model(qwen2_config(), bad_hf)
    odd_hf = str(tmp_path / "three-layers")
    save_hf_model(qwen2_config(num_hidden_layers=3), odd_hf)
    weights = load_file(os.path.join(bad_hf, "model.safetensors"))
    weights["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(32)
    save_file(weights, os.path.join(bad_hf, "model.safetensors"), metadata={"format": "pt"})

    codes = run_distributed(_convert_world, 2, hf, bad_hf, odd_hf, str(tmp_path), timeout_s=300)

    assert codes == [[0, 0, 3, 2], [0, 0, 3, 2]]  # a folder that does not match its config: the checkpoint class
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["model_tp0_pp0.safetensors", "model_tp1_pp0.safetensors",
                                                     "rlhf_model.json"]
    source, result = _tensors(hf), _tensors(str(tmp_path / "hf"))
    assert sorted(source) == sorted(result)
    assert all(result[name].dtype == torch.bfloat16 and torch.equal(source[name], result[name]) for name in source)
    assert os.path.exists(tmp_path / "hf" / "tokenizer_config.json")
    assert AutoConfig.from_pretrained(str(tmp_path / "hf")).dtype == torch.bfloat16
    assert not os.path.exists(tmp_path / "bad-ckpt") and not os.path.exists(tmp_path / "bad-ckpt.partial")
    err = capfd.readouterr().err
    assert ("rlhf convert: error: tensor 'model.layers.0.self_attn.q_proj.bias' in "
            f"{bad_hf} has shape [32], config expects [64]") in err
    # pp=2 does not divide the 3 layers: the same one line on both ranks, checked before any group exists
    assert err.count("rlhf convert: error: pp=2 does not divide num_hidden_layers=3") == 2, err
    assert "Gloo" not in err and not os.path.exists(tmp_path / "pp-ckpt")
