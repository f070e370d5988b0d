"""The native engine's one-call decode step (`rlhf.rollout.native.fused_step`) against its per-op decode.

On the same packed weights both run the same kernels in the same order, so greedy and seeded sampled rollouts
(mixed prompt lengths, slot refill, EOS) must be equal token for token and their logprobs bit for bit; Qwen3's q/k
norms are torch's op in the per-op path and the library's in the fused one (rounding apart: within 1e-5, the
rollout-vs-training bound). Routed models and TP keep the per-op path. The per-op fast path is checked against
transformers in test_native_parity.
"""

import shutil
import weakref

import pytest
import torch

from rlhf.rollout.sampling_params import SamplingParams
from rlhf.rollout.types import PromptBatch
from rlhf.testing.distributed import run_distributed
from rlhf.testing.tiny_models import FAMILIES, tiny_hf_model

PROMPTS = [[5, 17, 33, 8, 90, 4, 61], [9, 40], [71, 3, 3, 3, 12, 60, 11, 23, 54, 7, 99], [44], [13, 14, 15]]
GCC = shutil.which("gcc") is not None


def _rollouts(engine):
    batch = PromptBatch.from_token_lists(PROMPTS)
    greedy = engine.generate(batch, SamplingParams(max_new_tokens=12, temperature=0.0))
    sampled = engine.generate(batch, SamplingParams(max_new_tokens=12, temperature=0.8, top_p=0.9, n=2, seed=5))
    return greedy, sampled


def _world(paths):
    from tests_native_helpers import native_engine

    from rlhf.platform import linear

    linear.MIN_PACKED_NUMEL = 0  # the per-op path packs the tiny weights too: both run the decode GEMM
    out = {}
    for family, path in paths.items():
        engine, _, _ = native_engine(path, max_batch_size=3, max_seq_len=32, eos=(7,))  # 3 slots: refills
        decoder = engine.decoder
        fused = _rollouts(engine)
        out[family] = decoder.fused_step is not None
        if decoder.fused_step is None:
            continue
        decoder.fused_step = None  # same weights version: `prepare` keeps it off for the second run
        per_op = _rollouts(engine)
        assert decoder.fused_step is None
        for a, b in zip(fused, per_op):
            assert torch.equal(a.response_tokens_rt, b.response_tokens_rt), family
            assert a.finish_reasons == b.finish_reasons, family
            if family == "qwen3":
                torch.testing.assert_close(a.response_logprobs_rt, b.response_logprobs_rt, rtol=0, atol=1e-5)
            else:
                assert torch.equal(a.response_logprobs_rt, b.response_logprobs_rt), family
        # sleep frees the KV cache (the fused step keeps no reference to it); after a wake it is re-pointed
        decoder.prepared_version = None
        greedy = _rollouts(engine)[0]
        released = weakref.ref(engine.cache.keys[0])
        engine.sleep()
        assert released() is None, family
        engine.wake()
        assert torch.equal(_rollouts(engine)[0].response_tokens_rt, greedy.response_tokens_rt), family
    return out


def _moe_world(path):
    from tests_native_helpers import native_engine

    engine, _, _ = native_engine(path, max_batch_size=3, max_seq_len=32)
    engine.generate(PromptBatch.from_token_lists(PROMPTS[:2]), SamplingParams(max_new_tokens=3, temperature=0.0))
    return engine.decoder.fused_step is None and engine.decoder.prepared_version is not None


@pytest.mark.skipif(not GCC, reason="the CPU kernels need a C compiler")
def test_fused_step_equals_per_op_decode(tmp_path):
    paths = {}
    for family in FAMILIES:
        paths[family] = str(tmp_path / family)
        tiny_hf_model(family, seed=3).save_pretrained(paths[family])
    used = run_distributed(_world, 1, paths, timeout_s=300)[0]
    assert used == {family: True for family in FAMILIES}


@pytest.mark.skipif(not GCC, reason="the CPU kernels need a C compiler")
def test_fused_step_off_for_routed_layers_and_tp(tmp_path):
    path = str(tmp_path / "moe")
    tiny_hf_model("qwen3_moe", seed=3).save_pretrained(path)
    assert run_distributed(_moe_world, 1, path, timeout_s=300) == [True]
    dense = str(tmp_path / "dense")
    tiny_hf_model("qwen2", seed=3).save_pretrained(dense)
    assert run_distributed(_moe_world, 2, dense, timeout_s=300) == [True, True]
