"""`MemoryPhases` with recording stand-ins (no processes): the call order of one step, what validation and
split placement change, the metrics it records, and the config errors for nonsense values."""

from types import SimpleNamespace

import pytest

from rlhf.config import from_dict
from rlhf.orchestration.schema import RlhfConfig
from rlhf.errors import ConfigError
from rlhf.metrics import StepMetrics
from rlhf.rewards.registry import RewardConfig
from rlhf.rollout.factory import RolloutConfig
from rlhf.stages.memory import MemoryPhases, ParkedRole, check_sleep, plan_memory_phases


class RecordingEngine:
    """Keeps vLLM's rules: no generate while asleep, no weight push into sleeping weights."""

    def __init__(self, calls):
        self.calls, self.asleep = calls, set()

    def generate(self, prompts=None, params=None):
        assert not self.asleep, f"generate while {self.asleep} sleep"
        self.calls.append("generate")

    def load_weights(self, weights):
        assert "weights" not in self.asleep, "weights pushed into a sleeping engine"
        self.calls.append("load_weights")

    def sleep(self, release_weights=False):
        self.calls.append(("sleep", release_weights))
        self.asleep = {"kv_cache", "weights"}

    def wake(self, kv_cache=True):
        self.calls.append(("wake", kv_cache))
        self.asleep -= {"weights", "kv_cache"} if kv_cache else {"weights"}


class RecordingRole:
    def __init__(self, name, calls, member=True, offloads=True):
        self.name, self.calls, self.offloads = name, calls, offloads
        self.mesh = SimpleNamespace(is_member=member)

    def offload(self, *, keep_params=False):
        self.calls.append((f"{self.name}.offload", keep_params))

    def reload(self):
        self.calls.append(f"{self.name}.reload")


def _one_step(phases, engine, calls, metrics):
    """The phases of a synchronous step (`StepDriver.sync`), with a sync that pushes weights into the engine."""
    with phases.rollout(metrics):
        engine.generate()
    with phases.training(metrics):
        calls.append("update")
    with phases.weight_sync(metrics):
        engine.load_weights([])


def test_step_order_with_released_weights_and_validation_keeping_them():
    calls = []
    engine = RecordingEngine(calls)
    phases = plan_memory_phases(engine=engine, roles={"actor": RecordingRole("actor", calls),
                                                      "critic": RecordingRole("critic", calls), "ref": None},
                                on_rollout_mesh=True, sleep="kv_cache_and_weights", weights_shared=False)
    metrics = StepMetrics()
    for _ in range(2):
        _one_step(phases, engine, calls, metrics)
    step = [("actor.offload", False), ("critic.offload", False), ("wake", True), "generate", ("sleep", True),
            "actor.reload", "critic.reload", "update", ("wake", False), "load_weights"]
    assert calls == step * 2
    calls.clear()
    with phases.rollout(sync_follows=False):  # validation: nothing refills dropped weights, so keep them
        engine.generate()
    assert calls == [("actor.offload", False), ("critic.offload", False), ("wake", True), "generate",
                     ("sleep", False), "actor.reload", "critic.reload"]
    values = metrics.local()
    for phase in ("rollout", "train", "sync"):
        assert values[f"memory/{phase}/allocated_gb"] > 0 and values[f"memory/{phase}/peak_gb"] > 0
    assert {"memory/asleep/allocated_gb", "timing_s/offload", "timing_s/reload"} <= set(values)


def test_shared_weights_keep_the_actor_params_and_split_placement_is_a_no_op():
    calls = []
    actor, critic = RecordingRole("actor", calls), RecordingRole("critic", calls)
    shared = plan_memory_phases(engine=RecordingEngine(calls), roles={"actor": actor, "critic": critic},
                                on_rollout_mesh=True, sleep="kv_cache", weights_shared=True)
    assert [(p.name, p.keep_params) for p in shared.roles] == [("actor", True), ("critic", False)]
    # A role not on this rank, one that does not offload, or a rank off the rollout mesh: nothing to park.
    roles = {"actor": RecordingRole("actor", calls, member=False),
             "critic": RecordingRole("critic", calls, offloads=False)}
    assert plan_memory_phases(engine=None, roles=roles, on_rollout_mesh=True, sleep="kv_cache",
                              weights_shared=False).roles == []
    split = plan_memory_phases(engine=None, roles={"actor": actor}, on_rollout_mesh=False, sleep="kv_cache",
                               weights_shared=False)
    metrics = StepMetrics()
    _one_step(split, RecordingEngine(calls), calls, metrics)
    assert calls == ["generate", "update", "load_weights"]
    assert "timing_s/offload" not in metrics.local() and "memory/train/peak_gb" in metrics.local()


def test_sleep_none_leaves_the_engine_alone():
    calls = []
    phases = MemoryPhases(RecordingEngine(calls), [ParkedRole("actor", RecordingRole("actor", calls))],
                          sleep="none")
    _one_step(phases, phases.engine, calls, None)
    assert calls == [("actor.offload", False), "generate", "actor.reload", "update", "load_weights"]


def test_an_engine_that_cannot_sleep_is_left_alone_and_says_so(caplog):
    """vLLM on CPU has no sleep mode (`can_sleep=False`): the phases neither sleep nor wake it (nothing is
    released, nothing claimed) and log that once."""
    calls = []
    engine = RecordingEngine(calls)
    engine.can_sleep = False
    with caplog.at_level("INFO", logger="rlhf.stages.memory"):
        phases = MemoryPhases(engine, [ParkedRole("actor", RecordingRole("actor", calls))],
                              sleep=RolloutConfig(engine="vllm").resolved_sleep(accelerator=False))
    assert caplog.messages == ["rollout.sleep=kv_cache_and_weights: the engine cannot sleep on this platform, "
                               "so nothing is released between rollouts"]
    _one_step(phases, engine, calls, StepMetrics())
    assert calls == [("actor.offload", False), "generate", "actor.reload", "update", "load_weights"]


def test_sleep_defaults_per_engine_and_device():
    assert [RolloutConfig(engine=e).resolved_sleep(accelerator=a) for e in ("native", "vllm", "hf")
            for a in (False, True)] == ["none", "kv_cache", "kv_cache_and_weights", "kv_cache_and_weights",
                                        "none", "none"]
    assert RolloutConfig(sleep="kv_cache").resolved_sleep(accelerator=False) == "kv_cache"


def test_nonsense_sleep_and_offload_settings_are_config_errors():
    with pytest.raises(ConfigError) as err:
        RolloutConfig(sleep="always")
    assert str(err.value) == ("rollout.sleep='always' is not one of auto, none, kv_cache, kv_cache_and_weights "
                              "(auto: kv_cache_and_weights for vllm, kv_cache for native on an accelerator, else none)")
    with pytest.raises(ConfigError) as err:
        from_dict(RlhfConfig, {"rollout": {"sleep": False}})  # YAML's bare `off`
    assert str(err.value) == ("rollout.sleep=False is not one of 'auto', 'none', 'kv_cache', "
                              "'kv_cache_and_weights'")
    with pytest.raises(ConfigError) as err:
        check_sleep("kv_cache_and_weights", weights_shared=True)
    assert str(err.value) == ("rollout.sleep=kv_cache_and_weights would free the weights the native engine "
                              "shares with the actor (same layout); use rollout.sleep=kv_cache, or give "
                              "mesh.rollout its own layout (e.g. another tp)")
    with pytest.raises(ConfigError) as err:
        RewardConfig(model_offload=True)
    assert str(err.value) == ("reward.model_offload=true needs a reward model to offload; set "
                              "reward.model_path or drop reward.model_offload")
