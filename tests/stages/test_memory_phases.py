"""Memory phases in the real trainer on 2 gloo ranks: offload + sleep change no number, the order is the
documented one, and the native engine's KV cache (and, when it owns them, its weights) is freed between steps."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "orchestration"))
from fixtures import make_tiny_setup, trainer_config  # noqa: E402

from rlhf.testing.distributed import run_distributed  # noqa: E402

NOT_COMPARED = ("timing_s/", "perf/throughput", "memory/")
GRPO = ["algo.kl.coef=0.01", "trainer.total_steps=2"]
# PPO with a critic; actor tp2 -> rollout tp1 x dp2, so the native engine owns a resharded copy of the weights.
PPO = ["algo.advantage.kind=gae", "algo.advantage.lam=0.95", "mesh.actor.tp=2", "mesh.rollout.tp=1",
       "actor.optim.lr=0.05", "trainer.total_steps=2"]
ON = ["actor.optim.offload=true", "critic.optim.offload=true", "ref.offload=true"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_setup(tmp_path_factory.mktemp("tiny"), num_val=4)


def _record(calls, name, fn):
    """Calls are recorded by name and keyword arguments (the memory calls pass theirs by keyword)."""
    def wrapper(*args, **kwargs):
        calls.append((name, *sorted(kwargs.items())) if kwargs else name)
        return fn(*args, **kwargs)
    return wrapper


def _fit(paths, root, overrides):
    """Fit a trainer whose engine, roles and weight sync record their memory-relevant calls."""
    import torch.distributed as dist

    from rlhf.run_dir import close_run, setup_run
    from rlhf.orchestration.loop import Trainer
    from rlhf.orchestration.preflight import preflight

    cfg = trainer_config(paths, root, overrides)
    preflight(cfg, dist.get_world_size())
    trainer = Trainer(cfg, setup_run(cfg.run, cfg))
    train, calls, resident = trainer.train_side, [], []
    engine = trainer.rollout_side.engine
    for name in ("generate", "sleep", "wake", "load_weights"):
        setattr(engine, name, _record(calls, name, getattr(engine, name)))
    recorded_generate = engine.generate

    def generate(*args):  # what the training roles hold on this rank while the engine generates
        resident.append({role.name: _resident_bytes(role) for role in (train.actor, train.critic, train.ref,
                                                                         train.reward_model) if role is not None})
        return recorded_generate(*args)

    engine.generate = generate
    for role in (train.actor, train.critic, train.ref, train.reward_model):
        if role is not None:
            role.offload = _record(calls, f"{role.name}.offload", role.offload)
            role.reload = _record(calls, f"{role.name}.reload", role.reload)
    at_sync = []  # (KV cache allocated, weights released) when each weight sync starts
    weight_sync = trainer.boundary.weight_sync
    recorded_sync = _record(calls, "sync", weight_sync.sync)

    def sync():
        at_sync.append((engine.cache.allocated, all(p.numel() == 0 for p in engine.model.parameters())))
        return recorded_sync()

    weight_sync.sync = sync
    try:
        history = trainer.fit()
    finally:
        close_run()
    weights = {k: v.detach().clone() for k, v in train.actor.model.state_dict().items() if v is not None}
    cache_after_fit = engine.cache.allocated
    engine.wake()
    return {"history": history, "weights": weights, "calls": calls, "cache_after_fit": cache_after_fit,
            "cache_after_wake": engine.cache.allocated and engine.cache.keys[0].shape == engine.cache.shape,
            "at_sync": at_sync, "resident": resident, "optimizer_state": _optimizer_state_bytes(train.actor)}


def _resident_bytes(role):
    """Bytes of parameters, grad buffers and optimizer state this role holds on this rank."""
    params = sum(p.untyped_storage().nbytes() for p in role.model.parameters())
    if role.engine is None:
        return {"params": params}
    grads = sum(b.grad_data.untyped_storage().nbytes() for b in role.engine.model.buffers)
    return {"params": params, "grads": grads, "state": _optimizer_state_bytes(role)}


def _optimizer_state_bytes(role):
    """Adam moments (the scalar step counters stay resident: a few bytes)."""
    inner = role.engine.optimizer
    parts = getattr(inner, "chained_optimizers", [inner])
    return sum(t.untyped_storage().nbytes() for part in parts for state in part.optimizer.state.values()
               for t in state.values() if hasattr(t, "untyped_storage") and t.numel() > 1)


def _runs(paths, root, reward_model):
    reward = Path(root) / "length_reward.py"  # a dense signal, so every update really moves the weights
    reward.write_text("def score(data_source, solution, ground_truth, extra_info):\n"
                      "    return float(len(solution) % 2)\n")
    dense = ["reward.by_source={}", f"reward.function={reward}:score"]
    return {name: _fit(paths, f"{root}/{name}", overrides + dense + [f"run.name={name}"]) for name, overrides in {
        "grpo_off": GRPO + ["rollout.sleep=none"],
        "grpo_on": GRPO + ON + ["rollout.sleep=kv_cache"],
        "ppo_off": PPO + ["rollout.sleep=none"],
        "ppo_on": PPO + ON + ["rollout.sleep=kv_cache_and_weights"],
        "rm_off": [f"reward.model_path={reward_model}", "rollout.sleep=none"],
        "rm_on": [f"reward.model_path={reward_model}", "reward.model_offload=true", "rollout.sleep=kv_cache"],
    }.items()}


@pytest.fixture(scope="module")
def world(tiny, tmp_path_factory):
    from transformers import AutoConfig, AutoModelForSequenceClassification

    root = tmp_path_factory.mktemp("runs")
    rm_config = AutoConfig.from_pretrained(tiny["model"], num_labels=1, pad_token_id=0)
    AutoModelForSequenceClassification.from_config(rm_config).float().save_pretrained(root / "reward_model")
    return run_distributed(_runs, 2, tiny, str(root), str(root / "reward_model"), timeout_s=500)


def _comparable(history):
    return [{k: v for k, v in row.items() if not k.startswith(NOT_COMPARED)} for row in history]


@pytest.mark.parametrize("algo", ["grpo", "ppo", "rm"])
def test_offload_and_sleep_change_no_metric_and_no_weight(world, algo):
    import torch

    for rank in world:
        off, on = rank[f"{algo}_off"], rank[f"{algo}_on"]
        assert _comparable(on["history"]) == _comparable(off["history"])
        assert on["weights"].keys() == off["weights"].keys()
        assert all(torch.equal(on["weights"][k], off["weights"][k]) for k in off["weights"])
        assert on["optimizer_state"] > 0, "state is back in place after the last reload"
    last = world[0][f"{algo}_on"]["history"][-1]
    assert last["actor/grad_norm"] > 0 and last["critic/score/max"] > last["critic/score/min"]
    for phase in ("rollout", "train", "sync"):
        assert last[f"memory/{phase}/peak_gb"] > 0 and last[f"memory/{phase}/allocated_gb"] > 0
    assert "memory/asleep/allocated_gb" in last and "timing_s/offload" in last and "timing_s/reload" in last
    assert "timing_s/offload" not in world[0][f"{algo}_off"]["history"][-1]


def test_native_engine_frees_its_kv_cache_between_steps_and_wake_reallocates_it(world):
    for rank in world:
        assert rank["grpo_off"]["cache_after_fit"] is True and rank["grpo_off"]["at_sync"] == [(True, False)] * 2
        assert rank["grpo_on"]["cache_after_fit"] is False and rank["grpo_on"]["cache_after_wake"] is True
        # Shared with the actor: the weights stay; an own copy is dropped until the sync refills it.
        assert rank["grpo_on"]["at_sync"] == [(False, False)] * 2
        # (the first sync is the initial push into the engine's own copy, before any rollout: engine awake)
        assert rank["ppo_on"]["at_sync"] == [(True, False)] + [(False, True)] * 2
        # Validation (no sync follows it) keeps the weights: the last validation left them in place.
        assert rank["ppo_on"]["cache_after_fit"] is False and rank["ppo_on"]["cache_after_wake"] is True


def test_offloaded_roles_hold_nothing_while_the_engine_generates(world):
    for rank in world:
        # step 2's rollout (index 1 is step 1's, index 0 validation) without offload: everything resident
        off = rank["grpo_off"]["resident"][2]
        assert off["actor"]["state"] > 0 and off["actor"]["grads"] > 0 and off["ref"]["params"] > 0
        for on in rank["grpo_on"]["resident"]:
            assert on == {"actor": {"params": off["actor"]["params"], "grads": 0, "state": 0}, "ref": {"params": 0}}
        zero = {"params": 0, "grads": 0, "state": 0}
        assert all(on == {"actor": zero, "critic": zero} for on in rank["ppo_on"]["resident"])
        # A colocated reward model parks its weights (the actor, without optim.offload, keeps everything).
        assert rank["rm_off"]["resident"][2]["reward"]["params"] > 0
        assert all(on["reward"] == {"params": 0} and on["actor"]["state"] > 0 for on in rank["rm_on"]["resident"][2:])


def _step_2_rollout(calls):
    """Index of step 2's generate: the first after step 1's sync (the last two syncs are the steps')."""
    syncs = [i for i, call in enumerate(calls) if call == "sync"]
    return calls.index("generate", syncs[-2])


def test_call_order_of_one_step(world):
    # Colocated, shared weights: the actor keeps its parameters (the engine reads them), the ref parks.
    calls = world[0]["grpo_on"]["calls"]
    first = _step_2_rollout(calls)
    assert calls[first - 3:calls.index("sync", first) + 1] == [
        ("actor.offload", ("keep_params", True)), ("ref.offload", ("keep_params", False)), "wake",
        "generate", ("sleep", ("release_weights", False)), "actor.reload", "ref.reload",
        ("wake", ("kv_cache", False)), "sync"]
    # Own copy of the weights (resharded): they are dropped at sleep and re-acquired before the push.
    calls = world[0]["ppo_on"]["calls"]
    assert calls[:2] == ["sync", "load_weights"], "the engine's own copy gets the actor's weights first"
    first = _step_2_rollout(calls)
    step = calls[first - 3:calls.index("sync", first) + 1]
    assert step[:6] == [("actor.offload", ("keep_params", False)), ("critic.offload", ("keep_params", False)),
                        "wake", "generate", ("sleep", ("release_weights", True)), "actor.reload"]
    assert step[6:9] == ["critic.reload", ("wake", ("kv_cache", False)), "sync"], step
