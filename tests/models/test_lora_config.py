"""`lora` config section: defaults off, one-line ConfigErrors for bad input, reachable from the root config."""

from __future__ import annotations

import pytest

from rlhf.errors import ConfigError
from rlhf.models.config import LoraConfig
from rlhf.orchestration.schema import RlhfConfig


def test_lora_is_off_by_default_in_the_root_config():
    lora = RlhfConfig().lora
    assert not lora.enabled and lora.rank == 8 and lora.scaling == 2.0 and lora.sync == "merged"


@pytest.mark.parametrize("kwargs,message", [
    (dict(rank=0), "lora.rank=0 must be > 0 (lora.enabled=false switches LoRA off)"),
    (dict(rank=-4), "lora.rank=-4 must be > 0 (lora.enabled=false switches LoRA off)"),
    (dict(alpha=0.0), "lora.alpha=0.0 must be > 0 (the adapter is scaled by alpha / rank)"),
    (dict(dropout=1.0), "lora.dropout=1.0 must be in [0, 1)"),
    (dict(sync="full"), "lora.sync='full' is not one of merged, adapter"),
    (dict(dtype="bf16"), "lora.dtype='bf16' is not one of fp32, base"),
    (dict(targets=()), "lora.targets is empty; name at least one of q, k, v, o, gate, up, down"),
    (dict(targets=("q", "gaet")), "lora.targets has unknown target 'gaet' (did you mean 'gate'?); choose from "
                                  "q, k, v, o, gate, up, down, experts, router"),
    (dict(targets=("lm_head",)), "lora.targets has unknown target 'lm_head'; choose from q, k, v, o, gate, up, "
                                 "down, experts, router"),
])
def test_bad_lora_settings_are_one_line_errors(kwargs, message):
    with pytest.raises(ConfigError) as error:
        LoraConfig(**kwargs)
    assert str(error.value) == message


@pytest.mark.parametrize("overrides,message", [
    (["lora.sync=adapter", "rollout.engine=hf"], "lora.enabled=true does not run with rollout.engine=hf and "
     "lora.sync=adapter (the hf engine takes merged weights only) yet; use lora.sync=merged"),
    (["lora.sync=adapter", "rollout.sleep=kv_cache_and_weights"], "lora.enabled=true does not run with "
     "rollout.sleep=kv_cache_and_weights and lora.sync=adapter (the engine keeps its base) yet; use "
     "rollout.sleep=kv_cache"),
    (["algo.routing_replay=r3"],
     "lora.enabled=true does not run with algo.routing_replay=r3 yet; use algo.routing_replay=none"),
])
def test_lora_settings_the_trainer_does_not_run_yet_are_refused(overrides, message):
    from rlhf.config import from_dict
    from rlhf.config.loader import apply_overrides
    from rlhf.orchestration.setting_checks import check_lora

    def config(extra):
        return from_dict(RlhfConfig, apply_overrides({}, ["lora.enabled=true", *extra]))

    check_lora(config([]))
    check_lora(config(["lora.sync=adapter"]))
    check_lora(config(["lora.sync=adapter", "rollout.engine=vllm"]))
    check_lora(config(["actor.optim.offload=true"]))
    with pytest.raises(ConfigError) as error:
        check_lora(config(overrides))
    assert str(error.value) == message


def test_a_checkpoint_of_another_base_or_without_lora_is_a_one_line_error():
    from rlhf.errors import CheckpointError
    from rlhf.models.lora import check_same_base

    base = {"path": "/models/a", "sha256": "a" * 64}
    check_same_base(base, {"path": "/moved/a", "sha256": "a" * 64}, "actor")  # the same bytes elsewhere
    check_same_base(None, None, "actor")
    cases = [(base, {"path": "/models/b", "sha256": "b" * 64},
              "the actor checkpoint's LoRA adapters were trained on /models/a (sha256 aaaaaaaaaaaa), not on this "
              "run's model.path /models/b (sha256 bbbbbbbbbbbb); resume with the base model it was trained on"),
             (None, base, "the actor checkpoint holds full fine-tuning but this run has lora.enabled=true; resume "
                          "with the run's own lora setting")]
    for saved, current, message in cases:
        with pytest.raises(CheckpointError) as error:
            check_same_base(saved, current, "actor")
        assert str(error.value) == message


def test_expert_and_router_targets_are_refused_in_one_line_before_any_model_is_touched():
    from rlhf.models.lora import apply_lora

    with pytest.raises(ConfigError) as error:
        apply_lora(None, LoraConfig(enabled=True, targets=("q", "experts", "router")))
    assert str(error.value) == ("lora.targets=['q', 'experts', 'router']: experts, router adapters are not built yet; "
                                "adapt the attention and dense MLP linears (q, k, v, o, gate, up, down)")
