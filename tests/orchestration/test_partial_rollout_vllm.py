"""Partial rollouts' continuation on real vLLM (`make test-vllm`; 2 gloo ranks, one vLLM replica each): a row
still running after P tokens is resubmitted as prompt + its tokens so far for the remaining tokens
(`continue_rollouts`), keeping every token's logprob and policy version.

Greedy and without a weight change the continuation is the uninterrupted generation, token for token. Sampled
it cannot be: vLLM seeds a request's own torch.Generator from SamplingParams.seed at admission and draws from it
once per sampled token (on CPU a 31-bit seed for its fused Gumbel-max kernel, on CUDA an exponential vector per
token), and nothing admits a request with its generator already P draws along, so a continuation is a fresh,
reproducible draw (the batch's round-1 seed). What is asserted instead, across a weight push between the two
chunks: each first-chunk token's logprob is transformers' under the old weights and each continued token's is
transformers' under the new weights in its full context (prompt + first tokens + continuation so far), and the
versions say which policy sampled which token.
"""

import dataclasses
import importlib.util

import pytest
import torch

from rlhf.rollout.sampling_params import SamplingParams
from rlhf.rollout.types import FinishReason, PromptBatch
from rlhf.testing.distributed import run_distributed
from rlhf.testing.tiny_models import tiny_hf_model

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                                   reason="needs vLLM: make install-vllm")]

PROMPTS = [[5, 17, 33, 8, 90, 4, 61], [9, 40], [71, 3, 3, 3, 12, 60, 11, 23, 54, 7, 99], [44], [9, 40], [8, 8, 1]]
WIDTH, FIRST, TEMPERATURE = 12, 4, 0.8
DIMS = dict(hidden_size=128, num_heads=4, num_kv_heads=2, intermediate_size=256)  # vLLM-CPU: head_dim >= 32


def _scaled(weights: dict) -> dict:
    return {name: t * 1.1 if t.dim() == 2 else t for name, t in weights.items()}


def _continuations(path: str) -> dict:
    """On each rank (its own vLLM replica): greedy split vs whole, then sampled chunks around a weight push."""
    from safetensors.torch import load_file

    from rlhf.orchestration.partial_rollout import continue_rollouts
    from rlhf.parallel.groups import build_layout_groups
    from rlhf.parallel.layout import ParallelLayout
    from rlhf.rollout.factory import RolloutConfig, build_engine, close_engine
    from rlhf.rollout.vllm_engine import VllmEngineConfig

    pgs = build_layout_groups(ParallelLayout(dp=2))
    engine = build_engine(RolloutConfig(engine="vllm", vllm=VllmEngineConfig(enforce_eager=True,
                                                                             kv_cache_gb=0.25)), path, pgs)
    weights = load_file(f"{path}/model.safetensors")
    engine.load_weights(weights.items())
    prompts = PromptBatch.from_token_lists(PROMPTS)
    greedy = SamplingParams(max_new_tokens=WIDTH, temperature=0.0)
    engine.eos_token_ids = ()
    free = [engine.generate(prompts, greedy).response(row) for row in range(len(PROMPTS))]
    engine.eos_token_ids = (free[1][1],)  # a stop token some rows emit within the first chunk
    whole = engine.generate(prompts, greedy)
    first = engine.generate(prompts, dataclasses.replace(greedy, max_new_tokens=FIRST))
    merged, versions_rt = continue_rollouts(engine, prompts, first, greedy, WIDTH)
    engine.eos_token_ids = ()
    sampled = SamplingParams(max_new_tokens=WIDTH, temperature=TEMPERATURE, n=2, seed=5)
    started = engine.generate(prompts, dataclasses.replace(sampled, max_new_tokens=FIRST))
    engine.load_weights(_scaled(weights).items())
    pushed, pushed_versions_rt = continue_rollouts(engine, prompts, started, dataclasses.replace(sampled, seed=6),
                                                   WIDTH)
    close_engine(engine)
    return {"whole": whole, "first": first, "merged": merged, "versions": versions_rt, "pushed": pushed,
            "pushed_versions": pushed_versions_rt}


def _hf_logprobs(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    """transformers' logprob of each response token in its full context, at the sampling temperature."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1].float() / TEMPERATURE
    return logits.log_softmax(-1).gather(1, torch.tensor(response)[:, None])[:, 0]


def test_vllm_continuation_is_exact_greedy_and_per_token_across_a_push(tmp_path):
    model = tiny_hf_model("qwen2", seed=3, **DIMS)
    model.save_pretrained(tmp_path)
    ranks = run_distributed(_continuations, 2, str(tmp_path), env={"VLLM_CPU_KVCACHE_SPACE": "1"}, timeout_s=900)
    for result in ranks:
        whole, first, merged = result["whole"], result["first"], result["merged"]
        continued = [row for row, reason in enumerate(first.finish_reasons) if reason is FinishReason.LENGTH]
        assert 0 < len(continued) < len(PROMPTS), "some rows stop in the first chunk, the others continue"
        assert torch.equal(merged.response_tokens_rt, whole.response_tokens_rt)
        assert torch.equal(merged.response_lengths_r, whole.response_lengths_r)
        assert merged.finish_reasons == whole.finish_reasons
        torch.testing.assert_close(merged.response_logprobs_rt, whole.response_logprobs_rt, rtol=0, atol=1e-5)
        real_rt = torch.arange(WIDTH)[None, :] < merged.response_lengths_r[:, None]
        assert set(result["versions"][real_rt].tolist()) == {1}, "no push in between: one version"
    new_model = tiny_hf_model("qwen2", seed=3, **DIMS)
    new_model.load_state_dict(_scaled(model.state_dict()))
    for result in ranks:
        pushed, versions_rt = result["pushed"], result["pushed_versions"]
        lengths = pushed.response_lengths_r.tolist()
        assert len(lengths) == 2 * len(PROMPTS) and max(lengths) > FIRST, lengths
        for row in range(pushed.num_rollouts):
            length, prompt = int(pushed.response_lengths_r[row]), PROMPTS[int(pushed.prompt_index_r[row])]
            response = pushed.response(row)
            assert versions_rt[row, :length].tolist() == [1] * min(length, FIRST) + [2] * (length - FIRST)
            old, new = _hf_logprobs(model, prompt, response), _hf_logprobs(new_model, prompt, response)
            if length == WIDTH:
                assert float((old[FIRST:] - new[FIRST:]).abs().max()) > 1e-4, "the push moved these logprobs"
            want = torch.cat([old[:FIRST], new[FIRST:]])
            torch.testing.assert_close(pushed.response_logprobs_rt[row, :length], want, rtol=0, atol=1e-5)
