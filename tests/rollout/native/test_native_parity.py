"""Native engine on the megatron model vs transformers and vs the training forward, at rollout tp=1 and tp=2.

One launched world per tp covers the model families (the MoE ones too: at tp=2 each expert split over tp): greedy token-for-token equality with
`transformers.generate` (mixed prompt lengths, EOS stops, slot refill), rollout logprobs equal to the training
forward's within 1e-5, seeded sampling reproducible and identical on every TP rank.
"""

import pytest
import torch

from rlhf.rollout.hf_engine import HFEngine
from rlhf.rollout.sampling_params import SamplingParams
from rlhf.rollout.types import FinishReason, PromptBatch
from rlhf.testing.distributed import run_distributed
from rlhf.testing.tiny_models import FAMILIES, MOE_FAMILIES, tiny_hf_model

PROMPTS = [[5, 17, 33, 8, 90, 4, 61], [9, 40], [71, 3, 3, 3, 12, 60, 11, 23, 54, 7, 99], [44], [13, 14, 15]]
MAX_NEW = 12


def _training_logprobs(model, pgs, vocab_size, prompt, response, temperature):
    from rlhf.models.forward import token_logprobs

    tokens = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(tokens, torch.arange(tokens.shape[1])[None], None)
        logprobs = token_logprobs(logits[:, :-1] / temperature, tokens[:, 1:], pgs.tp, vocab_size)
    return logprobs[0, len(prompt) - 1:]


def _check_family(family, path, expected_greedy, eos, fast):
    """Everything one rank checks for one model; returns what must agree across TP ranks."""
    import shutil

    from tests_native_helpers import native_engine

    # The reference path prefills in small packed forwards (20 tokens: the first admission, lengths 7, 2, 11, is
    # one forward, the refills others) with its attention in groups (at overhead 6: [2], [7 padded to 11, 11]).
    engine, model, pgs = native_engine(path, max_batch_size=3, max_seq_len=32, eos=(eos[0],),  # 3 slots: refill
                                       pack_weights=fast, fused_kernels=fast, max_prefill_tokens=8192 if fast else 20)
    if fast and shutil.which("gcc"):
        assert engine.decoder.fused_attention is not None
    forwards, prefill = [], engine.decoder.prefill
    engine.decoder.prefill = lambda packed, *args: forwards.append(packed) or prefill(packed, *args)
    batch = PromptBatch.from_token_lists(PROMPTS)
    greedy = engine.generate(batch, SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0))
    if not fast:
        assert [len(group.slots_p) for group in forwards[0].groups] == [1, 2]
        assert forwards[0].groups[1].pad_rows is not None
    layer = engine.decoder.layers[0]
    swiglu = layer.swiglu if layer.moe is None else layer.moe.experts[0][0]
    assert (swiglu.kernel != "torch") == fast
    assert [greedy.response(i) for i in range(len(PROMPTS))] == expected_greedy[0], family
    first_stop = engine.generate(batch, SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0,
                                                       stop_token_ids=(eos[1],)))
    assert [first_stop.response(i) for i in range(len(PROMPTS))] == expected_greedy[1], family
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.7, top_p=0.95, n=3, seed=11)
    sampled = engine.generate(batch, params)
    again = engine.generate(batch, params)
    assert torch.equal(sampled.response_tokens_rt, again.response_tokens_rt)
    worst = 0.0
    for row in range(sampled.num_rollouts):
        prompt, response = PROMPTS[int(sampled.prompt_index_r[row])], sampled.response(row)
        for temperature, got in ((1.0, sampled.response_logprobs_rt), (0.7, sampled.response_scaled_logprobs_rt)):
            expected = _training_logprobs(model, pgs, 101, prompt, response, temperature)
            worst = max(worst, float((got[row, :len(response)] - expected).abs().max()))
    assert worst < 1e-5, (family, worst)
    # plain lists: tensors sent through a multiprocessing queue need the (exiting) sender alive
    return greedy.response_tokens_rt.tolist(), sampled.response_tokens_rt.tolist(), sampled.finish_reasons


def _world(paths, expected, eos_by_family, fast):
    """`fast`: oneDNN-packed weights (forced: the tiny models are below the packing threshold) and the fused
    decode-attention kernel; otherwise the plain torch reference path, its prefill in small forwards and groups."""
    from rlhf.platform import linear
    from rlhf.rollout.native import prefill_plan

    if fast:
        linear.MIN_PACKED_NUMEL = 0
    else:
        prefill_plan.ATTENTION_GROUP_OVERHEAD_TOKENS = 6.0
    return {family: _check_family(family, paths[family], expected[family], eos_by_family[family], fast)
            for family in FAMILIES + MOE_FAMILIES}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """HF folders plus HF greedy outputs for two stop tokens: one that some rows emit mid-way (as EOS) and
    one that a row emits first (as a stop token: a row of length 1)."""
    paths, expected, eos_by_family = {}, {}, {}
    for family in FAMILIES + MOE_FAMILIES:
        model = tiny_hf_model(family, seed=3)
        path = str(tmp_path_factory.mktemp(family))
        model.save_pretrained(path)
        batch = PromptBatch.from_token_lists(PROMPTS)
        free = HFEngine(model).generate(batch, SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0))
        eos, first = free.response(0)[3], free.response(1)[0]
        stopped = HFEngine(model, eos_token_ids=(eos,)).generate(
            batch, SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0))
        assert FinishReason.STOP in stopped.finish_reasons and FinishReason.LENGTH in stopped.finish_reasons
        at_first = HFEngine(model, eos_token_ids=(eos,)).generate(
            batch, SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, stop_token_ids=(first,)))
        assert at_first.response(1) == [first]
        paths[family], eos_by_family[family] = path, (eos, first)
        expected[family] = ([stopped.response(i) for i in range(len(PROMPTS))],
                            [at_first.response(i) for i in range(len(PROMPTS))])
    return paths, expected, eos_by_family


# The default suite checks the reference path at tp1 and the fast path at tp2; the other two corners are `slow`.
@pytest.mark.parametrize("tp, fast", [(1, False), pytest.param(1, True, marks=pytest.mark.slow),
                                      pytest.param(2, False, marks=pytest.mark.slow), (2, True)])
def test_native_matches_hf_and_training_forward(reference, tp, fast):
    results = run_distributed(_world, tp, *reference, fast, timeout_s=600)
    for family in FAMILIES + MOE_FAMILIES:
        for rank_result in results[1:]:
            assert rank_result[family] == results[0][family], family
