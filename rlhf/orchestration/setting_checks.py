"""Preflight checks of settings that run but cannot mean anything, or do not run where a run asks for them yet:
algorithms the step does not feed, multi-turn beyond what is tested, context parallelism off its packed path, a
metrics endpoint that cannot bind. Each
raises one ConfigError naming the setting and the fix (`preflight` collects them)."""

from __future__ import annotations

import torch.distributed as dist

from rlhf.agents.config import HistoryPolicy
from rlhf.algo.advantages import TRAJECTORY_KINDS, AdvantageKind
from rlhf.errors import ConfigError
from rlhf.models.lora_peft import check_peft_adapter, read_peft_folder
from rlhf.ops.prometheus import check_listen
from rlhf.orchestration.checks import read_hf_config
from rlhf.orchestration.schema import RlhfConfig
from rlhf.parallel.config import ROLES
from rlhf.parallel.wire import broadcast_json


def check_algo_settings(cfg: RlhfConfig) -> None:
    """Settings that run but cannot mean anything: dynamic sampling without groups, an overlong buffer longer than
    any response; algorithms whose inputs the step does not produce."""
    algo, sampling = cfg.algo, cfg.sampling
    if algo.advantage.kind is AdvantageKind.GDPO:
        check_gdpo(cfg)
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


def check_gdpo(cfg: RlhfConfig) -> None:
    """GDPO reads the named components of the rule reward's dict (a key it lacks is a RewardError at the first
    step, naming the sample); its advantage ignores the scalar score, so what only shapes that score is refused."""
    key = "algo.advantage.kind=gdpo"
    not_fed = [(cfg.reward.remote is not None, "reward.remote (the service answers one score per sample)"),
               (bool(cfg.reward.model_path), "reward.model_path (a reward model gives one score per sample)"),
               (cfg.multiturn.enable, "multiturn.enable=true (trajectories are scored as one number)"),
               (cfg.algo.overlong_buffer.len > 0, f"algo.overlong_buffer.len={cfg.algo.overlong_buffer.len} "
                                                   "(its penalty shapes only the score)"),
               (cfg.algo.kl.use_in_reward, "algo.kl.use_in_reward=true (the penalty enters only the token rewards)")]
    for refused, setting in not_fed:
        if refused:
            raise ConfigError(f"{key} reads the named reward components of a rule reward (reward.function / "
                              f"by_source returning a dict), which {setting} does not feed; drop it or choose "
                              "another estimator")


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


def check_context_parallel(cfg: RlhfConfig) -> None:
    """cp > 1 splits the packed (THD) forwards of the actor, critic, ref and reward model: it needs their token
    budgets set (row-count micro-batches are not sharded); the teachers do not shard."""
    budgets = {"actor": [("actor.max_tokens_per_microbatch", cfg.actor.max_tokens_per_microbatch)],
               "critic": [("critic.max_tokens_per_microbatch", cfg.critic.max_tokens_per_microbatch)],
               "ref": [("ref.max_tokens_per_microbatch", cfg.ref.max_tokens_per_microbatch)],
               "reward": [("reward.model_max_tokens_per_microbatch", cfg.reward.model_max_tokens_per_microbatch)]}
    for role in ROLES:
        layout = getattr(cfg.mesh, role)
        if layout.cp == 1 or role == "rollout":  # the rollout's cp is refused with its layout
            continue
        if role not in budgets:
            raise ConfigError(f"mesh.{role}.cp={layout.cp}: the {role} forwards do not split sequences; set "
                              f"mesh.{role}.cp=1")
        for key, budget in budgets[role]:
            if not budget:
                raise ConfigError(f"mesh.{role}.cp={layout.cp} shards packed micro-batches only, but {key}=0 (row "
                                  f"counts); set {key} to a token budget or mesh.{role}.cp=1")


def check_lora(cfg: RlhfConfig) -> None:
    """LoRA runs where it is built and tested: adapter-only sync into a native or vLLM engine that keeps its base,
    the ref as the actor's base (so no routing replay, whose recorder the two would share)."""
    if not cfg.lora.enabled:
        return
    adapter_sync = cfg.lora.sync == "adapter"
    not_yet = [(adapter_sync and cfg.rollout.engine == "hf", "rollout.engine=hf and lora.sync=adapter (the hf "
                "engine takes merged weights only)", "lora.sync=merged"),
               (adapter_sync and cfg.rollout.sleep == "kv_cache_and_weights", "rollout.sleep=kv_cache_and_weights "
                "and lora.sync=adapter (the engine keeps its base)", "rollout.sleep=kv_cache"),
               (cfg.algo.routing_replay != "none", f"algo.routing_replay={cfg.algo.routing_replay}",
                "algo.routing_replay=none")]
    for refused, setting, fix in not_yet:
        if refused:
            raise ConfigError(f"lora.enabled=true does not run with {setting} yet; use {fix}")


def check_lora_adapter(cfg: RlhfConfig) -> None:
    """`lora.adapter_path`: the PEFT folder fits the lora section and model.path (config and tensor header only)."""
    if not (cfg.lora.enabled and cfg.lora.adapter_path):
        return
    check_peft_adapter(read_peft_folder(cfg.lora.adapter_path), read_hf_config(cfg.model.path), cfg.lora)


def check_multiturn(cfg: RlhfConfig) -> None:
    """Multi-turn rollouts run where they are tested: native or vLLM engine (any rollout tp, colocated or split,
    sync or one step off without partial rollouts); the `fork` history and `credit=turn` with an outcome estimator,
    no KL in reward (`credit=turn`: no reward model either)."""
    if not cfg.multiturn.enable:
        return
    not_yet = [(cfg.trainer.partial_rollout_tokens > 0, f"trainer.partial_rollout_tokens="
                f"{cfg.trainer.partial_rollout_tokens} (a turn is not continued across a weight push)",
                "trainer.partial_rollout_tokens=0"),
               (cfg.algo.advantage.kind == AdvantageKind.REMAX, "algo.advantage.kind=remax (its greedy baseline is "
                                                                "one response)", "another estimator")]
    for refused, setting, fix in not_yet:
        if refused:
            raise ConfigError(f"multiturn.enable=true does not run with {setting} yet; use {fix}")
    budget, native = cfg.multiturn.limits.token_budget, cfg.rollout.native
    if cfg.rollout.engine == "native" and budget > native.max_seq_len:  # a turn generates within its row's budget
        raise ConfigError(f"a multi-turn row holds up to multiturn.limits.token_budget={budget} tokens, but a "
                          f"KV-cache slot holds rollout.native.max_seq_len={native.max_seq_len}; raise max_seq_len "
                          f"to {budget} or lower token_budget")
    if cfg.multiturn.limits.history is HistoryPolicy.FORK:  # one advantage for all rows of a trajectory
        kind = cfg.algo.advantage.kind
        if kind not in TRAJECTORY_KINDS:
            raise ConfigError(f"multiturn.limits.history=fork gives a trajectory several rows, which "
                              f"algo.advantage.kind={kind.value} cannot score as one; use one of "
                              f"{', '.join(k.value for k in TRAJECTORY_KINDS)} or multiturn.limits.history=append")
        if cfg.algo.kl.use_in_reward:
            raise ConfigError("multiturn.limits.history=fork with algo.kl.use_in_reward=true would give the rows "
                              "of one trajectory different rewards; use the KL loss (algo.kl.use_in_reward=false) "
                              "or multiturn.limits.history=append")
    if cfg.multiturn.credit == "turn":  # per-turn scores come from the rollout side, one per turn
        kind = cfg.algo.advantage.kind
        refused = [(kind not in TRAJECTORY_KINDS, f"algo.advantage.kind={kind.value}",
                    f"one of {', '.join(k.value for k in TRAJECTORY_KINDS)}"),
                   (cfg.algo.kl.use_in_reward, "algo.kl.use_in_reward=true",
                    "the KL loss (algo.kl.use_in_reward=false)"),
                   (bool(cfg.reward.model_path), "a reward model (reward.model_path)", "rule or environment rewards")]
        for bad, setting, fix in refused:
            if bad:
                raise ConfigError(f"multiturn.credit=turn does not run with {setting}: its turns are scored on the "
                                  f"rollout side; use {fix} or multiturn.credit=trajectory")


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
