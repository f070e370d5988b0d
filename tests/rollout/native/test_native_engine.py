"""Native engine lifecycle on one launched world: cache sizing errors, sleep/wake, weight release and reload,
load_weights checks, and the HF-name mapping the vllm engine is fed with."""

import pytest
import torch

from rlhf.errors import ConfigError
from rlhf.rollout.native import NativeEngineConfig
from rlhf.rollout.sampling_params import SamplingParams
from rlhf.rollout.types import PromptBatch
from rlhf.testing.distributed import run_distributed
from rlhf.testing.tiny_models import tiny_hf_model

PROMPTS = [[5, 17, 33, 8], [9, 40, 41]]
GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)


def _raises(fn, message):
    with pytest.raises((ConfigError, RuntimeError), match=message):
        fn()


def _lifecycle(path):
    from rlhf.platform import linear
    from rlhf.reshard.hf_names import hf_named
    from tests_native_helpers import native_engine

    linear.MIN_PACKED_NUMEL = 0  # pack even the tiny model's weights: re-packing after updates is under test
    engine, model, _ = native_engine(path, max_batch_size=4, max_seq_len=16)
    batch = PromptBatch.from_token_lists(PROMPTS)
    first = engine.generate(batch, GREEDY)
    assert engine.decoder.layers[0].qkv.kernel != "torch" and engine.decoder.output.kernel != "torch"
    reference = first.response_tokens_rt.tolist()
    _raises(lambda: engine.generate(batch, SamplingParams(max_new_tokens=13)),
            r"a prompt of 4 tokens \+ max_new_tokens=13 needs 17 KV-cache positions but rollout max_seq_len=16")
    # Per-prompt caps (multi-turn: a row's budget left): each row stops at its own cap with the uncapped row's
    # tokens, and the KV check adds each prompt's own cap (4 + 3 and 3 + 13 fit 16 where 4 + 13 would not).
    capped = PromptBatch.from_token_lists(PROMPTS, max_new_tokens_b=torch.tensor([3, 13]))
    both = engine.generate(capped, SamplingParams(max_new_tokens=13, temperature=0.0, ignore_eos=True))
    assert both.response_lengths_r.tolist() == [3, 13] and both.response_tokens_rt.shape == (2, 13)
    assert both.response_tokens_rt[0, :3].tolist() == reference[0][:3] and both.finish_reasons[0].value == "length"
    assert both.response_tokens_rt[1, :6].tolist() == reference[1]
    assert engine.generate(capped, GREEDY).response_lengths_r.tolist() == [3, 6]  # within the sampling's 6
    _raises(lambda: engine.generate(PromptBatch.from_token_lists(PROMPTS, max_new_tokens_b=torch.tensor([13, 3])),
                                    SamplingParams(max_new_tokens=13)),
            r"a prompt of 4 tokens \+ max_new_tokens=13 needs 17 KV-cache positions")
    _raises(lambda: engine.generate(batch, SamplingParams(max_new_tokens=2, n=5)),
            r"n=5 samples per prompt need 5 KV-cache slots but rollout max_batch_size=4")
    assert engine.cache.num_bytes == 2 * 2 * 4 * 2 * 16 * 16 * 4  # K+V x layers x slots x kv x pos x d x fp32

    engine.sleep()
    assert not engine.cache.allocated
    _raises(lambda: engine.generate(batch, GREEDY), r"while asleep: call wake\(\) first")
    engine.wake()
    assert engine.generate(batch, GREEDY).response_tokens_rt.tolist() == reference

    full = {name: p.detach().clone() for name, p in model.named_parameters()}
    engine.sleep(release_weights=True)
    assert all(p.numel() == 0 for p in model.parameters())
    engine.wake()
    _raises(lambda: engine.generate(batch, GREEDY), r"after a weight release: call load_weights\(\) first")
    _raises(lambda: engine.load_weights([("decoder.final_layernorm.weight", full["decoder.final_layernorm.weight"])]),
            r"load_weights after a weight release is missing \['decoder.layers.0")
    engine.load_weights(iter(full.items()))
    assert engine.generate(batch, GREEDY).response_tokens_rt.tolist() == reference
    version = engine.policy_version
    _raises(lambda: engine.load_weights([("no.such.weight", torch.zeros(1))]), r"unknown parameter 'no.such.weight'")
    _raises(lambda: engine.load_weights([("decoder.final_layernorm.weight", torch.zeros(3))]),
            r"decoder.final_layernorm.weight has shape \(3,\), the engine's shard is \(64,\)")
    engine.load_weights([("decoder.final_layernorm.weight", full["decoder.final_layernorm.weight"] * 2)])
    changed = engine.generate(batch, GREEDY)
    assert changed.policy_version == version + 1

    # Shared weights: the optimizer updates parameters in place and the sync bumps policy_version; the
    # next generate must re-pack (checked against the unpacked path on the same weights).
    with torch.no_grad():
        model.decoder.layers[0].mlp.linear_fc2.weight.mul_(-3.0)
    engine.policy_version += 1
    repacked = engine.generate(batch, GREEDY)
    engine.decoder.pack_weights = False
    engine.policy_version += 1
    unpacked = engine.generate(batch, GREEDY)
    assert engine.decoder.layers[0].qkv.kernel == "torch"
    assert repacked.response_tokens_rt.tolist() == unpacked.response_tokens_rt.tolist() != reference
    assert torch.allclose(repacked.response_logprobs_rt, unpacked.response_logprobs_rt, atol=1e-5)

    hf_names = dict(hf_named(model.rlhf_hf_config, full))
    same_tokens = changed.response_tokens_rt.tolist() == reference  # logits x2 keeps every argmax
    sharper = bool((changed.response_logprobs_rt > first.response_logprobs_rt).all())
    return {name: t.tolist() for name, t in hf_names.items()}, same_tokens and sharper


def test_lifecycle_and_hf_name_mapping(tmp_path):
    hf_model = tiny_hf_model("llama", seed=1)
    hf_model.save_pretrained(tmp_path)
    (mapped, changed), = run_distributed(_lifecycle, 1, str(tmp_path), timeout_s=120)
    expected = {name: t.tolist() for name, t in hf_model.state_dict().items()}
    assert mapped == expected
    assert changed  # the doubled final norm reached the forward: same argmax, larger greedy logprobs


def test_config_validation():
    with pytest.raises(ConfigError, match=r"rollout max_seq_len=0 must be a positive integer"):
        NativeEngineConfig(max_seq_len=0)
    with pytest.raises(ConfigError, match=r"rollout pack_weights='yes' must be true or false"):
        NativeEngineConfig(pack_weights="yes")
    with pytest.raises(ConfigError, match=r"rollout fused_kernels=1 must be true or false"):
        NativeEngineConfig(fused_kernels=1)
