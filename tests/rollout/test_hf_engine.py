"""The hf engine: greedy equals a plain argmax loop, stops truncate, seeds reproduce, logprobs are consistent."""

import torch

from rlhf.rollout.hf_engine import HFEngine
from rlhf.rollout.sampling_params import SamplingParams
from rlhf.rollout.types import FinishReason, PromptBatch
from rlhf.testing.tiny_models import tiny_hf_model

PROMPTS = [[5, 17, 33, 8], [9, 40], [71, 3, 3, 3, 12, 60]]


def _argmax_loop(model, prompt, steps):
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            tokens.append(int(model(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(prompt):]


def test_greedy_matches_argmax_loop_and_stops():
    model = tiny_hf_model("llama")
    engine = HFEngine(model, eos_token_ids=())
    batch = PromptBatch.from_token_lists(PROMPTS)
    out = engine.generate(batch, SamplingParams(max_new_tokens=10, temperature=0.0))
    expected = [_argmax_loop(model, p, 10) for p in PROMPTS]
    assert [out.response(i) for i in range(3)] == expected
    assert out.finish_reasons == [FinishReason.LENGTH] * 3

    stop = expected[1][4]  # a token row 1 produces mid-way
    stopped = engine.generate(batch, SamplingParams(max_new_tokens=10, temperature=0.0, stop_token_ids=(stop,)))
    for row, tokens in enumerate(expected):
        cut = tokens.index(stop) + 1 if stop in tokens else len(tokens)
        assert stopped.response(row) == tokens[:cut]
        assert stopped.finish_reasons[row] == (FinishReason.STOP if stop in tokens else FinishReason.LENGTH)
    assert (stopped.response_tokens_rt[1, stopped.response_lengths_r[1]:] == 0).all()
    assert (stopped.response_logprobs_rt[1, stopped.response_lengths_r[1]:] == 0).all()


def test_sampling_seeded_and_logprobs_match_forward():
    model = tiny_hf_model("qwen2")
    engine = HFEngine(model)
    batch = PromptBatch.from_token_lists(PROMPTS)
    params = SamplingParams(max_new_tokens=6, temperature=0.8, top_p=0.9, n=2, seed=3, ignore_eos=True)
    first, again = engine.generate(batch, params), engine.generate(batch, params)
    assert torch.equal(first.response_tokens_rt, again.response_tokens_rt)
    assert first.prompt_index_r.tolist() == [0, 0, 1, 1, 2, 2]
    row = 2
    tokens = PROMPTS[1] + first.response(row)
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0, len(PROMPTS[1]) - 1:-1]
    target = torch.tensor(first.response(row))
    raw = torch.log_softmax(logits, -1).gather(-1, target[:, None]).squeeze(-1)
    scaled = torch.log_softmax(logits / 0.8, -1).gather(-1, target[:, None]).squeeze(-1)
    torch.testing.assert_close(first.response_logprobs_rt[row, :6], raw, atol=1e-5, rtol=0)
    torch.testing.assert_close(first.response_scaled_logprobs_rt[row, :6], scaled, atol=1e-5, rtol=0)


def test_load_weights_checks_every_name_and_shape_before_writing():
    import pytest

    from rlhf.errors import ConfigError

    model = tiny_hf_model("llama")
    engine = HFEngine(model, eos_token_ids=())
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    norm = model.model.norm.weight
    bad_shape = [("model.norm.weight", torch.full_like(norm, 2.0)),
                 ("model.embed_tokens.weight", torch.ones(1, norm.shape[0]))]  # would broadcast silently
    with pytest.raises(ConfigError, match=r"'model.embed_tokens.weight' has shape \(1, \d+\), the model's is"):
        engine.load_weights(iter(bad_shape))
    with pytest.raises(ConfigError, match="unknown parameter 'lm_head.bias'"):
        engine.load_weights([("model.norm.weight", norm * 3), ("lm_head.bias", torch.ones(1))])
    for name, param in model.named_parameters():  # nothing half-written
        assert torch.equal(param, before[name]), name
    assert engine.policy_version == 0
    engine.load_weights([("model.norm.weight", torch.full_like(norm, 2.0))])
    assert torch.equal(model.model.norm.weight, torch.full_like(norm, 2.0)) and engine.policy_version == 1
