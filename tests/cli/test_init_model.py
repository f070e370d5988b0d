"""`rlhf init-model` writes a folder transformers and rlhf both load, for every architecture it offers."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlhf.cli.main import main
from rlhf.errors import ConfigError
from rlhf.models.init import InitModelConfig
from rlhf.models.spec import ModelSpec

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM"}


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_init_model_writes_a_loadable_model_of_the_arch(tmp_path, arch, capsys):
    out = tmp_path / arch
    assert main(["init-model", "--out", str(out), "--arch", arch, "--hidden", "32", "--layers", "2", "--heads", "4",
                 "--kv-heads", "2", "--ffn", "64", "--experts", "4", "--experts-per-token", "2",
                 "--expert-ffn", "16"]) == 0
    assert capsys.readouterr().out == f"wrote {out}\n"
    model = AutoModelForCausalLM.from_pretrained(out)
    assert type(model).__name__ == ARCHITECTURES[arch]
    spec = ModelSpec.from_hf(model.config)
    assert spec.model_type == arch and spec.qk_norm == arch.startswith("qwen3")
    if arch in ("qwen3_moe", "mixtral"):
        assert (spec.moe.num_experts, spec.moe.top_k, spec.moe.moe_layers) == (4, 2, (True, True))
        assert spec.moe.expert_ffn_hidden_size == (16 if arch == "qwen3_moe" else 64)
    else:
        assert spec.moe is None
    tokens = AutoTokenizer.from_pretrained(out)("12+3=", return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.isfinite(model(tokens).logits).all()


def test_init_model_rejects_more_experts_per_token_than_experts():
    with pytest.raises(ConfigError, match="num_experts_per_token=5 must be between 1 and num_experts=4"):
        InitModelConfig(arch="mixtral", num_experts=4, num_experts_per_token=5)


def test_init_model_chat_tokenizer_round_trips_a_tool_conversation(tmp_path):
    out = tmp_path / "chat"
    assert main(["init-model", "--out", str(out), "--hidden", "32", "--layers", "1", "--heads", "2",
                 "--kv-heads", "2", "--ffn", "64", "--chat"]) == 0
    tokenizer = AutoTokenizer.from_pretrained(out)
    messages = [{"role": "user", "content": "12*34"},
                {"role": "assistant", "content": '<tool_call>{"name": "calculator"}</tool_call>'},
                {"role": "tool", "content": "408"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == ('<|im_start|>user\n12*34<|im_end|>\n<|im_start|>assistant\n<tool_call>{"name": "calculator"}'
                    '</tool_call><|im_end|>\n<|im_start|>tool\n408<|im_end|>\n<|im_start|>assistant\n')
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text and tokenizer.unk_token_id not in ids
    assert tokenizer.eos_token == "<|im_end|>" and len(tokenizer.encode("<tool_call>", add_special_tokens=False)) == 1
    assert AutoModelForCausalLM.from_pretrained(out).config.vocab_size == len(tokenizer)
