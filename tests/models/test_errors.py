"""Bad input is a one-line error naming the tensor or number, raised before anything is loaded or written."""

from __future__ import annotations

import os
import re

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import GPT2Config, MistralConfig

from rlhf.parallel.layout import ParallelLayout
from rlhf.errors import CheckpointError, ConfigError
from rlhf.models.hf_load import HfFolder, check_folder
from rlhf.models.param_specs import param_specs
from rlhf.models.spec import ModelSpec
from tests.models.tiny import llama_config, mixtral_config, qwen2_config, qwen3_config, qwen3_moe_config, save_hf_model


def _one_line(error: pytest.ExceptionInfo) -> str:
    message = str(error.value)
    assert "\n" not in message
    return message


def test_unsupported_architecture_is_named():
    with pytest.raises(ConfigError) as error:
        ModelSpec.from_hf(GPT2Config())
    assert _one_line(error).startswith("unsupported architecture model_type='gpt2'")
    config = llama_config(architectures=["LlamaForTokenClassification"])
    with pytest.raises(ConfigError, match=re.escape("unsupported architecture 'LlamaForTokenClassification'")):
        ModelSpec.from_hf(config)
    with pytest.raises(ConfigError, match="unsupported hidden_act='gelu'"):
        ModelSpec.from_hf(llama_config(hidden_act="gelu"))
    with pytest.raises(ConfigError, match="unsupported sliding_window=4096 for mistral"):
        ModelSpec.from_hf(MistralConfig(sliding_window=4096))
    with pytest.raises(ConfigError, match="unsupported attention_bias=True for qwen3; only bias-free attention"):
        ModelSpec.from_hf(qwen3_config(attention_bias=True))
    with pytest.raises(ConfigError, match="unsupported router_jitter_noise=0.1 for mixtral; set it to 0"):
        ModelSpec.from_hf(mixtral_config(router_jitter_noise=0.1))


def test_moe_layers_follow_mlp_only_layers_and_decoder_sparse_step():
    moe = ModelSpec.from_hf(qwen3_moe_config(num_hidden_layers=6, mlp_only_layers=[4], decoder_sparse_step=2)).moe
    assert moe.moe_layers == (False, True, False, True, False, True)
    assert ModelSpec.from_hf(qwen3_moe_config(mlp_only_layers=[0, 1, 2, 3])).moe is None
    specs = {p.name for p in param_specs(qwen3_moe_config(), ParallelLayout())}
    assert "decoder.layers.0.mlp.experts.local_experts.3.linear_fc2.weight" in specs
    assert "decoder.layers.1.mlp.linear_fc1.weight" in specs and "decoder.layers.1.mlp.router.weight" not in specs


def test_moe_at_tp2_splits_each_expert_and_rejects_an_odd_expert_width():
    specs = {p.name: p for p in param_specs(mixtral_config(num_local_experts=3), ParallelLayout(tp=2))}
    assert specs["decoder.layers.0.mlp.experts.local_experts.2.linear_fc1.weight"].shard_shape(2) == (48, 64)
    with pytest.raises(ConfigError) as error:
        param_specs(mixtral_config(intermediate_size=49), ParallelLayout(tp=2))
    assert _one_line(error) == ("tp=2 does not divide the experts' intermediate size 49 (each expert is split over "
                                "tp: expert-tensor-parallel = tp); choose tp among its divisors")


@pytest.mark.parametrize("tp,pp,message", [
    (4, 1, "tp=4 does not divide num_key_value_heads=2; choose tp among the divisors of 2"),
    (3, 1, "tp=3 does not divide num_attention_heads=4; choose tp among the divisors of 4"),
    (1, 3, "pp=3 does not divide num_hidden_layers=4; choose pp among the divisors of 4"),
])
def test_layout_that_does_not_divide_the_model_is_rejected(tp, pp, message):
    with pytest.raises(ConfigError) as error:
        param_specs(llama_config(), ParallelLayout(tp=tp, pp=pp))
    assert _one_line(error) == message


def test_vocab_is_padded_to_a_multiple_of_tp():
    specs = {p.name: p for p in param_specs(qwen2_config(), ParallelLayout(tp=4, pp=2))}
    assert specs["embedding.word_embeddings.weight"].full_shape == (104, 64)
    assert specs["output_layer.weight"].tied_copy and specs["output_layer.weight"].pp_stage == 1
    assert specs["decoder.layers.1.self_attention.linear_qkv.bias"].shard_shape(4) == (48,)


@pytest.fixture()
def hf_folder(tmp_path):
    path = str(tmp_path / "llama")
    save_hf_model(llama_config(num_hidden_layers=2), path)
    return path


def _rewrite(path: str, edit) -> None:
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


@pytest.mark.parametrize("edit,message", [
    (lambda t: t.pop("model.layers.1.mlp.up_proj.weight"),
     "is missing tensor 'model.layers.1.mlp.up_proj.weight' (config expects shape [96, 64])"),
    (lambda t: t.__setitem__("model.layers.2.mlp.up_proj.weight", torch.zeros(96, 64)),
     "has unexpected tensor 'model.layers.2.mlp.up_proj.weight' (not in a llama model with 2 layers)"),
    (lambda t: t.__setitem__("model.layers.0.self_attn.k_proj.weight", torch.zeros(16, 64)),
     "tensor 'model.layers.0.self_attn.k_proj.weight' in {path} has shape [16, 64], config expects [32, 64]"),
])
def test_bad_hf_folder_names_the_tensor(hf_folder, edit, message):
    _rewrite(hf_folder, edit)
    spec = ModelSpec.from_hf(llama_config(num_hidden_layers=2))
    with pytest.raises(CheckpointError) as error:
        check_folder(HfFolder(hf_folder), spec)
    assert message.format(path=hf_folder) in _one_line(error)


def test_folder_without_weights_is_named(tmp_path):
    with pytest.raises(CheckpointError, match="has neither model.safetensors nor model.safetensors.index.json"):
        HfFolder(str(tmp_path))


@pytest.mark.parametrize("cut", [0, 7, 100, -1])
def test_truncated_or_empty_safetensors_is_named(hf_folder, cut):
    file = os.path.join(hf_folder, "model.safetensors")
    with open(file, "rb") as f:
        data = f.read()
    with open(file, "wb") as f:
        f.write(data[:cut] if cut >= 0 else data[:len(data) // 2])
    with pytest.raises(CheckpointError) as error:
        HfFolder(hf_folder)
    assert _one_line(error).startswith(f"{file} is not a readable safetensors file (Error while deserializing "
                                       "header: ")
    assert _one_line(error).endswith("); re-download or re-export the model")


def _load_into_one_rank(path: str) -> str:
    from transformers import AutoConfig

    from rlhf.parallel.groups import GroupCache, build_layout_groups
    from rlhf.models.builder import build_gpt
    from rlhf.models.hf_load import load_hf_weights

    groups = build_layout_groups(ParallelLayout(tp=1, pp=1, dp=1), GroupCache())
    try:
        load_hf_weights(build_gpt(AutoConfig.from_pretrained(path), groups), path)
    except CheckpointError as error:
        return str(error)
    return "loaded"


def test_non_finite_weights_are_named(hf_folder):
    from rlhf.testing.distributed import run_distributed

    assert run_distributed(_load_into_one_rank, 1, hf_folder, timeout_s=120) == ["loaded"]
    _rewrite(hf_folder, lambda t: t["model.layers.1.mlp.down_proj.weight"].view(-1).__setitem__(5, float("inf")))
    message = run_distributed(_load_into_one_rank, 1, hf_folder, timeout_s=120)[0]
    assert message == (f"decoder.layers.1.mlp.linear_fc2.weight read from {hf_folder} holds NaN/inf values (a "
                       "corrupted safetensors file?); re-download or re-export the model")
