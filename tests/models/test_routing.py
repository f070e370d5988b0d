"""MoE at ep=2 on 2 gloo ranks (one launch): Qwen3-MoE and Mixtral logits and grads vs transformers with both
token dispatchers, bitwise export, the router losses from config (grads = transformers' loss + the switch
load-balancing and z-losses written out here), and the routing recorder's choices and metrics vs transformers'
router, and one TrainEngine step at ep1 vs ep2 (megatron DDP over the expert-dp groups)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from rlhf.errors import ConfigError
from rlhf.models.config import MoeConfig
from rlhf.testing.distributed import run_distributed
from tests.models.test_parity import _hf_reference, _per_expert, _tensors
from tests.models.tiny import VOCAB, mixtral_config, qwen3_moe_config, sample_tokens, save_hf_model

TOKENS = dict(batch=2, seq=12)
LOSSES = MoeConfig(aux_loss_coeff=0.1, z_loss_coeff=0.01)
# (model, token dispatcher, router losses)
CASES = [("qwen3_moe", "alltoall", False), ("qwen3_moe", "allgather", True), ("mixtral", "allgather", False)]


def _world(paths: dict[str, str], out_root: str) -> dict:
    from rlhf.parallel.groups import GroupCache
    from rlhf.models.forward import forward_backward
    from rlhf.models.hf_export import export_hf
    from rlhf.models.routing import RoutingRecorder
    from tests.models import world

    cache, results = GroupCache(), {}
    tokens = sample_tokens(TOKENS["batch"], TOKENS["seq"])
    for name, dispatcher, losses in CASES:
        config = LOSSES if losses else MoeConfig(token_dispatcher=dispatcher)
        model, groups = world.layout_model(paths[name], 1, 1, cache, ep=2,
                                           moe_kwargs=MoeConfig(**{**vars(config), "token_dispatcher": dispatcher})
                                           .build_kwargs())
        with RoutingRecorder(model) as routing:
            reports = forward_backward(model, [world.MicroBatch(tokens)], world.rl_loss(groups, VOCAB), groups)
        export_hf(model, os.path.join(out_root, f"{name}-{dispatcher}-{losses}"))
        results[(name, dispatcher, losses)] = {
            "grads": world.hf_grads(model, groups), "logits": reports[0]["logits"].numpy(),
            "experts": {layer: ids.numpy() for layer, ids in routing.topk_experts().items()},
            "metrics": routing.metrics()}
    results["train"] = {ep: _train_step_grads(paths["qwen3_moe"], cache, ep) for ep in (1, 2)}
    return results


def _train_step_grads(path: str, cache, ep: int) -> tuple[float, dict]:
    """One TrainEngine step (megatron DDP: expert grads reduced over the expert-dp group) on this rank's half of
    the batch: (global loss, this rank's reduced grads by global parameter name)."""
    import torch.distributed as dist

    from rlhf.models.forward import token_logprobs
    from rlhf.models.hf_load import param_specs_for, stage_params
    from rlhf.train.config import OptimConfig
    from rlhf.train.engine import TrainEngine
    from tests.models import world

    model, groups = world.layout_model(path, 1, 1, cache, ep=ep)
    engine = TrainEngine(model, groups, OptimConfig(lr=1e-2, total_steps=1))
    tokens = sample_tokens(4, TOKENS["seq"], seed=5).chunk(2)[dist.get_rank()]

    def loss_fn(logits, micro_batch):
        return -token_logprobs(logits, micro_batch.tokens_bs, groups.tp, VOCAB).sum() / tokens.numel() / 2, {}

    result = engine.train_step([world.MicroBatch(tokens)], loss_fn)
    return result.loss, {spec.name: param.main_grad.numpy().copy()
                         for spec, param in stage_params(engine.module, param_specs_for(engine.module))}


def _router_reference(model, tokens, losses: MoeConfig | None):
    """transformers' forward with each router's logits captured; with `losses`, megatron's router losses on
    them (switch load balancing over the sequence's tokens, z-loss) join the loss before backward."""
    logits_by_layer = []
    hooks = [m.register_forward_hook(lambda _m, _i, out: logits_by_layer.append(out[0]))
             for n, m in model.named_modules() if n.endswith("mlp.gate")]
    model.zero_grad()
    if losses is None:
        logits, _, _, grads = _hf_reference(model, tokens)
    else:
        logits = model(tokens).logits
        logprobs = torch.log_softmax(logits, -1)
        token_lp = logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        loss = -token_lp.mean() - 0.1 * (-(logprobs.exp() * logprobs).sum(-1)).mean()
        top_k = model.config.num_experts_per_tok
        for router_logits in logits_by_layer:
            num_tokens, num_experts = router_logits.shape
            probs = torch.softmax(router_logits, -1)
            load = torch.zeros(num_experts).scatter_add_(0, probs.topk(top_k).indices.flatten(),
                                                         torch.ones(num_tokens * top_k))
            loss = loss + losses.aux_loss_coeff * num_experts / (top_k * num_tokens ** 2) * (probs.sum(0) * load).sum()
            loss = loss + losses.z_loss_coeff * torch.logsumexp(router_logits, -1).square().mean()
        loss.backward()
        grads = _per_expert({n: p.grad.numpy() for n, p in model.named_parameters()}, model.config)
    for hook in hooks:
        hook.remove()
    return logits.detach(), grads, [x.detach() for x in logits_by_layer]


@pytest.fixture(scope="module")
def routed(tmp_path_factory):
    root = tmp_path_factory.mktemp("routing")
    configs = {"qwen3_moe": qwen3_moe_config(), "mixtral": mixtral_config()}
    paths = {name: str(root / name) for name in configs}
    models = {name: save_hf_model(config, paths[name], seed=7 + i) for i, (name, config) in enumerate(configs.items())}
    ranks = run_distributed(_world, 2, paths, str(root / "out"), timeout_s=600)
    results = {"train": {ep: (ranks[0]["train"][ep][0], {**ranks[0]["train"][ep][1], **ranks[1]["train"][ep][1]})
                         for ep in (1, 2)}}
    for key in (key for key in ranks[0] if key != "train"):
        results[key] = dict(ranks[0][key], grads={**ranks[0][key]["grads"], **ranks[1][key]["grads"]},
                            logits_rank1=ranks[1][key]["logits"], metrics_rank1=ranks[1][key]["metrics"])
    return root, paths, models, results


@pytest.mark.parametrize("name,dispatcher,losses", CASES)
def test_ep2_logits_and_grads_match_transformers(routed, name, dispatcher, losses):
    _, _, models, results = routed
    got = results[(name, dispatcher, losses)]
    logits, grads, _ = _router_reference(models[name], sample_tokens(TOKENS["batch"], TOKENS["seq"]),
                                         LOSSES if losses else None)
    assert np.abs(got["logits"] - logits.numpy()).max() <= 1e-5
    assert np.abs(got["logits_rank1"] - logits.numpy()).max() <= 1e-5
    assert sorted(got["grads"]) == sorted(grads)
    for grad_name, grad in grads.items():
        assert np.abs(got["grads"][grad_name] - grad).max() <= 1e-5, grad_name
    if losses:  # the router losses moved the router's grads (they are not the plain loss's)
        plain = results[("qwen3_moe", "alltoall", False)]["grads"]["model.layers.0.mlp.gate.weight"]
        assert np.abs(got["grads"]["model.layers.0.mlp.gate.weight"] - plain).max() > 1e-4


@pytest.mark.parametrize("name,dispatcher,losses", CASES)
def test_ep2_export_is_bitwise(routed, name, dispatcher, losses):
    root, paths, _, _ = routed
    source, result = _tensors(paths[name]), _tensors(str(root / "out" / f"{name}-{dispatcher}-{losses}"))
    assert sorted(result) == sorted(source)
    assert all(torch.equal(result[n], t) for n, t in source.items())


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_recorded_routing_and_metrics_match_transformers_router(routed, name):
    _, _, models, results = routed
    got = results[(name, "allgather" if name == "mixtral" else "alltoall", False)]
    tokens = sample_tokens(TOKENS["batch"], TOKENS["seq"])
    _, _, router_logits = _router_reference(models[name], tokens, None)
    top_k, batch, seq = models[name].config.num_experts_per_tok, TOKENS["batch"], TOKENS["seq"]
    assert len(got["experts"]) == len(router_logits)
    loads, entropies = [], []
    for (_, experts_nk), logits in zip(sorted(got["experts"].items()), router_logits):
        # megatron's tokens are sequence-major ([s, b]); transformers' batch-major
        batch_major = experts_nk.reshape(seq, batch, top_k).transpose(1, 0, 2).reshape(-1, top_k)
        assert np.array_equal(batch_major, np.sort(logits.topk(top_k).indices.numpy(), axis=-1))
        loads.append(np.bincount(batch_major.flatten(), minlength=logits.shape[1]))
        logprobs = torch.log_softmax(logits, -1)
        entropies.append(float(-(logprobs.exp() * logprobs).sum(-1).mean()))
    metrics = got["metrics"]
    assert metrics == got["metrics_rank1"]
    assert metrics["moe/tokens_per_expert_max"] == np.mean([load.max() for load in loads])
    assert metrics["moe/tokens_per_expert_mean"] == batch * seq * top_k / router_logits[0].shape[1]
    assert metrics["moe/load_imbalance"] == pytest.approx(np.mean([load.max() / load.mean() for load in loads]))
    assert metrics["moe/router_entropy"] == pytest.approx(np.mean(entropies), abs=1e-5)


def test_train_step_grads_at_ep2_equal_ep1(routed):
    """Through TrainEngine (megatron DDP + finalize): each expert lives on one ep rank, its grad summed over the
    expert-dp group, and every grad equals the ep=1 run's."""
    _, _, _, results = routed
    (loss_ep1, grads_ep1), (loss_ep2, grads_ep2) = results["train"][1], results["train"][2]
    assert loss_ep1 == pytest.approx(loss_ep2, abs=1e-6)
    assert sorted(grads_ep1) == sorted(grads_ep2)
    assert any(".experts." in name for name in grads_ep1)
    for name, grad in grads_ep1.items():
        assert np.abs(grads_ep2[name] - grad).max() <= 1e-6, name


def test_moe_config_errors_name_the_value():
    with pytest.raises(ConfigError, match=r"^moe.aux_loss_coeff=-0.1 must be >= 0 \(0 switches the loss off\)$"):
        MoeConfig(aux_loss_coeff=-0.1)
    with pytest.raises(ConfigError, match="^moe.token_dispatcher='flex' is not one of allgather, alltoall$"):
        MoeConfig(token_dispatcher="flex")


def test_moe_config_is_a_model_config_section():
    from rlhf.config.loader import from_dict
    from rlhf.stages.config import ModelConfig

    config = from_dict(ModelConfig, {"moe": {"aux_loss_coeff": 0.01, "token_dispatcher": "alltoall"}}, "model")
    assert config.moe.build_kwargs() == dict(aux_loss_coeff=0.01, z_loss_coeff=0.0, token_dispatcher="alltoall")
    with pytest.raises(ConfigError, match="^unknown config key 'model.moe.z_los_coeff'; did you mean 'z_loss_coeff'"):
        from_dict(ModelConfig, {"moe": {"z_los_coeff": 0.01}}, "model")
