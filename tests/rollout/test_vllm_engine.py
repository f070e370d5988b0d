"""The vllm adapter against a stand-in `vllm` module: constructor options, call order, output conversion."""

import importlib.util
from types import SimpleNamespace

import pytest
import torch

from rlhf.errors import ConfigError
from rlhf.rollout.engine import EngineLayout
from rlhf.rollout.sampling_params import SamplingParams, replica_seed
from rlhf.rollout.types import FinishReason, PromptBatch
from rlhf.rollout.vllm_engine import INSTALL_HINT, VllmEngine, import_vllm


class _Model:
    def __init__(self, calls):
        self.calls = calls

    def load_weights(self, weights):
        self.calls.append(("load_weights", [name for name, _ in weights]))


class _LLM:
    """Records every call; `generate` answers 2 completions per prompt with fixed tokens/logprobs."""

    def __init__(self, calls, **kwargs):
        self.calls = calls
        calls.append(("LLM", kwargs))
        runner = SimpleNamespace(model=_Model(calls))
        self.llm_engine = SimpleNamespace(model_executor=SimpleNamespace(
            driver_worker=SimpleNamespace(worker=SimpleNamespace(model_runner=runner))))

    def generate(self, requests, sampling_params, use_tqdm):
        self.calls.append(("generate", [r["prompt_token_ids"] for r in requests], sampling_params))
        return [SimpleNamespace(outputs=[
            SimpleNamespace(token_ids=[7, 2], logprobs=[{7: SimpleNamespace(logprob=-0.5)},
                                                        {2: SimpleNamespace(logprob=-1.5)}], finish_reason="stop"),
            SimpleNamespace(token_ids=[9, 9, 9], logprobs=[{9: SimpleNamespace(logprob=-0.25)}] * 3,
                            finish_reason="length")]) for _ in requests]

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def wake_up(self, tags):
        self.calls.append(("wake_up", tags))


def _stand_in():
    calls = []
    module = SimpleNamespace(LLM=lambda **kw: _LLM(calls, **kw), SamplingParams=lambda **kw: kw)
    return module, calls


def test_missing_vllm_gives_install_hint():
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm is installed here")
    with pytest.raises(ConfigError, match="pip install 'rlhf\\[gpu\\]'"):
        import_vllm()
    assert "rollout.engine=native" in INSTALL_HINT


def test_colocated_options_and_generate_conversion():
    module, calls = _stand_in()
    engine = VllmEngine("/models/tiny", layout=EngineLayout(tp=2, dp=2, dp_rank=1), vllm_module=module)
    options = calls[0][1]
    assert options["distributed_executor_backend"] == "external_launcher"
    assert options["enable_sleep_mode"] is True and options["load_format"] == "dummy"
    assert options["tensor_parallel_size"] == 2 and options["model"] == "/models/tiny"

    batch = PromptBatch.from_token_lists([[5, 6, 7], [8]], pad_token_id=0)
    params = SamplingParams(max_new_tokens=4, temperature=0.7, top_p=0.9, n=2, seed=5, stop_token_ids=(2,))
    out = engine.generate(batch, params)
    _, prompts_sent, sampling = calls[-1]
    assert prompts_sent == [[5, 6, 7], [8]]
    assert sampling == dict(n=2, temperature=0.7, top_p=0.9, top_k=-1, max_tokens=4, stop_token_ids=[2],
                            ignore_eos=False, seed=replica_seed(5, 1), logprobs=0)
    assert out.prompt_index_r.tolist() == [0, 0, 1, 1]
    assert out.response(0) == [7, 2] and out.response(1) == [9, 9, 9]
    assert out.response_tokens_rt[0].tolist() == [7, 2, 0, 0]
    assert out.response_logprobs_rt[1].tolist() == [-0.25, -0.25, -0.25, 0.0]
    assert out.finish_reasons[:2] == [FinishReason.STOP, FinishReason.LENGTH]
    assert out.response_scaled_logprobs_rt is None


def test_sleep_wake_load_sequence():
    module, calls = _stand_in()
    engine = VllmEngine("/m", vllm_module=module)
    batch = PromptBatch.from_token_lists([[1, 2]])
    params = SamplingParams(max_new_tokens=4)
    engine.sleep(release_weights=True)
    with pytest.raises(RuntimeError, match="call wake\\(\\) and load_weights"):
        engine.generate(batch, params)
    with pytest.raises(RuntimeError, match="call wake\\(\\) first"):
        engine.load_weights([("model.norm.weight", torch.ones(2))])
    engine.wake(kv_cache=False)
    engine.load_weights(iter([("model.embed_tokens.weight", torch.ones(3, 2)), ("model.norm.weight", torch.ones(2))]))
    engine.generate(batch, params)
    engine.generate(batch, params)
    engine.sleep()
    engine.wake()
    engine.wake()  # already awake: no call
    names = [c[0] if c[0] != "sleep" and c[0] != "wake_up" else c for c in calls[1:]]
    assert names == [("sleep", 2), ("wake_up", ["weights"]), "load_weights", ("wake_up", ["kv_cache"]),
                     "generate", "generate", ("sleep", 1), ("wake_up", ["weights"]), ("wake_up", ["kv_cache"])]
    assert calls[3][1] == ["model.embed_tokens.weight", "model.norm.weight"]
    assert engine.policy_version == 1
