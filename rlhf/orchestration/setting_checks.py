"""Preflight checks of settings that run but cannot mean anything, or do not run where a run asks for them yet:
algorithms the step does not feed, multi-turn beyond what is tested, a metrics endpoint that cannot bind. Each
raises one ConfigError naming the setting and the fix (`preflight` collects them)."""

from __future__ import annotations

import torch.distributed as dist

from rlhf.agents.config import HistoryPolicy
from rlhf.algo.advantages import AdvantageKind
from rlhf.errors import ConfigError
from rlhf.ops.prometheus import check_listen
from rlhf.orchestration.schema import RlhfConfig
from rlhf.parallel.wire import broadcast_json

# registered (and verl-parity tested) but fed by inputs the RL step does not compute yet: refused before anything
# starts, not at the first update. (key, kind, what it needs)
UNWIRED = (("algo.advantage.kind", "gdpo", "per-component rewards from the scorer"),)


def check_algo_settings(cfg: RlhfConfig) -> None:
    """Settings that run but cannot mean anything: dynamic sampling without groups, an overlong buffer longer than
    any response; algorithms whose inputs the step does not produce yet."""
    algo, sampling = cfg.algo, cfg.sampling
    chosen = {"algo.policy_loss.kind": str(algo.policy_loss.kind), "algo.advantage.kind": str(algo.advantage.kind)}
    for key, kind, needs in UNWIRED:
        if chosen[key] == kind:
            raise ConfigError(f"{key}={kind} is not usable in the RL step yet: it needs {needs}, which the step does "
                              "not compute; choose another kind")
    if algo.advantage.kind is AdvantageKind.OPTIMAL_TOKEN_BASELINE:
        check_optimal_token_baseline(cfg)
    if algo.filter_groups.enable and sampling.n < 2:
        raise ConfigError(f"algo.filter_groups.enable=true keeps only groups whose rewards differ, but sampling.n="
                          f"{sampling.n} makes every group a single sample: no group is ever kept; set sampling.n >= 2 "
                          "or algo.filter_groups.enable=false")
    if algo.overlong_buffer.len > sampling.max_new_tokens:
        raise ConfigError(f"algo.overlong_buffer.len={algo.overlong_buffer.len} > sampling.max_new_tokens="
                          f"{sampling.max_new_tokens}: the penalty would start before the first token and hit every "
                          f"response; set algo.overlong_buffer.len <= {sampling.max_new_tokens}")


def check_optimal_token_baseline(cfg: RlhfConfig) -> None:
    """The optimal token baseline reads sum_v pi(v)^2 from the actor's own old-logprob forward, which the fused
    head computes (rollout correction's bypass mode skips that forward)."""
    key = "algo.advantage.kind=optimal_token_baseline"
    if not cfg.model.fused_head:
        raise ConfigError(f"{key} reads each position's sum of squared probabilities from the fused LM head; set "
                          "model.fused_head=true")
    correction = cfg.algo.rollout_correction
    if correction.bypass_mode and correction.enable is not False:
        raise ConfigError(f"{key} reads the actor's old-logprob forward, which algo.rollout_correction.bypass_mode="
                          "true skips; set bypass_mode=false or choose another estimator")


def check_multiturn(cfg: RlhfConfig, layouts: dict) -> None:
    """Multi-turn rollouts run where they are tested: native engine at rollout tp=1, synchronous, one row per
    trajectory (the `append` history policy), no rollout dumps yet."""
    if not cfg.multiturn.enable:
        return
    not_yet = [(cfg.rollout.engine != "native", f"rollout.engine={cfg.rollout.engine}", "rollout.engine=native"),
               (layouts["rollout"].tp > 1, f"mesh.rollout.tp={layouts['rollout'].tp} (every tp rank would run the "
                                           "tools)", "mesh.rollout.tp=1"),
               (cfg.trainer.is_async, f"trainer.async_mode={cfg.trainer.async_mode}", "trainer.async_mode=off"),
               (cfg.algo.advantage.kind == AdvantageKind.REMAX, "algo.advantage.kind=remax (its greedy baseline is "
                                                                "one response)", "another estimator"),
               (cfg.multiturn.limits.history is HistoryPolicy.FORK, "multiturn.limits.history=fork (a trajectory of "
                                                              "several rows)", "multiturn.limits.history=append"),
               (cfg.trainer.dump_rollouts, "trainer.dump_rollouts=true (dumps hold no loss mask yet)",
                "trainer.dump_rollouts=false")]
    for refused, setting, fix in not_yet:
        if refused:
            raise ConfigError(f"multiturn.enable=true does not run with {setting} yet; use {fix}")


def check_metrics_endpoint(cfg: RlhfConfig) -> None:
    """Rank 0 binds metrics.prometheus_host:port and lets go (a taken port used to fail after the run folder and
    a resumed run's config.yaml were written); every rank raises rank 0's error."""
    if not cfg.metrics.prometheus_port:
        return
    error = None
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            check_listen(cfg.metrics)
        except ConfigError as found:
            error = str(found)
    if dist.is_initialized() and dist.get_world_size() > 1:
        error = broadcast_json(error, src=0)
    if error:
        raise ConfigError(error)
