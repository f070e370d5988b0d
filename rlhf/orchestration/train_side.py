"""The training side of an RL step (DESIGN.md §2): `train(RolloutBatch) -> ScoredBatch`, inside the memory phase.

  RolloutBatch ──► reward model (on its mesh, when configured)
               ──► actor old logprobs (or the rollout's, bypass) · ref logprobs · critic values
               ──► KL in reward · rollout correction weights / rejection, overlong filtering (the actor's final
                   loss mask)
               ──► advantages (GAE | GRPO | RLOO | REINFORCE++ | ReMax | OPO | GPG | pass@k | GDPO: the reward
                   components | optimal token baseline: old logprobs, sum_v pi^2 and correction weights)
               ──► distillation: teacher logprobs, + coef x (teacher - student) per sampled token (estimator
                   topk: the teachers' top-K ids and logprobs per position, for a KL term of the actor's loss)
               ──► Clip-Cov / KL-Cov: the step's high-covariance tokens (global batch, old logprobs)
               ──► ScoredBatch ──► actor.update · critic.update

Every rank runs it on the global batch (roles this rank is not in only take part in their gathers).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from rlhf.algo.advantages import (AdvantageInputs, AdvantageKind, compute_advantages, scores_to_token_rewards,
                                  trajectory_advantages)
from rlhf.algo.dapo import overlong_penalty
from rlhf.algo.groups import Groups
from rlhf.algo.kl import KLController, apply_kl_in_reward
from rlhf.algo.policy_loss_cov import COVARIANCE_KINDS, covariance_selection
from rlhf.algo.rollout_correction import rollout_correction
from rlhf.algo.turn_credit import turn_advantages
from rlhf.algo.value_loss import explained_variance
from rlhf.data.records import PromptRecord
from rlhf.metrics import StepMetrics
from rlhf.orchestration.rollout_side import shaped_scores
from rlhf.orchestration.schema import RlhfConfig
from rlhf.parallel.meshes import RoleMeshes
from rlhf.stages.batch import PADDING_UID, RolloutBatch, ScoredBatch, pad_to_multiple
from rlhf.stages.config import AlgoConfig, UpdateConfig
from rlhf.stages.distill_config import DistillEstimator
from rlhf.stages.distill import DistillStage
from rlhf.stages.memory import MemoryPhases
from rlhf.stages.policy_role import PolicyRole
from rlhf.stages.value_roles import CriticRole, RewardModelRole


@dataclass(frozen=True, kw_only=True)
class TrainRoles:
    """The model roles of the training side (roles this rank is not in hold no model)."""

    actor: PolicyRole
    ref: PolicyRole | None
    critic: CriticRole | None
    reward_model: RewardModelRole | None
    distill: DistillStage | None  # the distillation teachers (algo.distill)

    @classmethod
    def from_config(cls, cfg: RlhfConfig, algo: AlgoConfig, meshes: RoleMeshes,
                    gather_group: dist.ProcessGroup | None, records: Sequence[PromptRecord]) -> TrainRoles:
        """Every role on its mesh (collective); `gather_group`: the ranks that gather their outputs (async);
        `records`: the training prompts (the teachers' routes)."""
        model, moe = cfg.model, cfg.model.moe.build_kwargs()
        policy = dict(fused_head=model.fused_head, temperature=cfg.sampling.logprob_temperature,
                      params_dtype=model.torch_dtype, moe_kwargs=moe, gather_group=gather_group,
                      routing_replay=algo.routing_replay, seed=cfg.dist.seed)
        lora = cfg.lora if cfg.lora.enabled else None
        actor = PolicyRole("actor", meshes["actor"], model.path, update=cfg.actor, recompute=model.recompute,
                           total_steps=cfg.trainer.total_steps * cfg.actor.epochs * cfg.actor.mini_batches,
                           lora=lora, **policy)
        # with LoRA the reference policy is the actor's base: its own model with the adapters off
        ref = (PolicyRole("ref", meshes["actor" if lora else "ref"], model.path, update=None, total_steps=0,
                          micro_batch_size=cfg.ref.micro_batch_size, offload_frozen=cfg.ref.offload,
                          max_tokens_per_microbatch=(cfg.ref.max_tokens_per_microbatch,
                                                     "ref.max_tokens_per_microbatch"),
                          forward_autocast=(cfg.actor.optim.autocast if cfg.ref.autocast == "auto"
                                            else cfg.ref.autocast, "ref.autocast"),
                          base_of=actor if lora else None, **policy)
               if algo.uses_ref else None)
        critic = (CriticRole("critic", meshes["critic"], model.critic_path or model.path, update=cfg.critic,
                             value_head=True, seed=cfg.dist.seed + 1, params_dtype=model.torch_dtype,
                             total_steps=cfg.trainer.total_steps * cfg.critic.epochs * cfg.critic.mini_batches,
                             moe_kwargs=moe, gather_group=gather_group,
                             lora=dataclasses.replace(cfg.lora, adapter_path="") if lora and cfg.lora.critic else None)
                  if algo.uses_critic else None)
        reward_model = (RewardModelRole("reward", meshes["reward"], cfg.reward.model_path, update=None,
                                        total_steps=0, micro_batch_size=cfg.reward.model_micro_batch_size,
                                        max_tokens_per_microbatch=(cfg.reward.model_max_tokens_per_microbatch,
                                                                   "reward.model_max_tokens_per_microbatch"),
                                        value_head=True, offload_frozen=cfg.reward.model_offload,
                                        params_dtype=model.torch_dtype, gather_group=gather_group)
                        if cfg.reward.model_path else None)
        distill = (DistillStage(algo.distill, meshes["teacher"], records, **policy)
                   if algo.distill.enable else None)
        return cls(actor=actor, ref=ref, critic=critic, reward_model=reward_model, distill=distill)

    def by_name(self) -> dict[str, PolicyRole | CriticRole | RewardModelRole | None]:
        teachers = {f"teacher{number}": teacher
                    for number, teacher in enumerate(self.distill.teachers if self.distill else [])}
        return {"actor": self.actor, "critic": self.critic, "ref": self.ref, "reward": self.reward_model} | teachers


@dataclass(kw_only=True, eq=False)
class TrainSide:
    """This rank's training work on each global batch."""

    actor: PolicyRole
    ref: PolicyRole | None
    critic: CriticRole | None
    reward_model: RewardModelRole | None
    distill: DistillStage | None
    algo: AlgoConfig
    actor_update: UpdateConfig
    kl_controller: KLController  # adaptive KL in reward: part of the checkpoint
    max_new_tokens: int
    memory: MemoryPhases
    seed: int  # Clip-Cov's token draw: seeded by (seed, step), so a resumed step draws the same tokens
    step_rows: int  # prompts_per_step x n: a batch of forked multi-turn trajectories is padded to a multiple
    stale: bool  # async: every batch was sampled by an older policy, so `auto` runs the old-logprob forward

    @classmethod
    def from_config(cls, cfg: RlhfConfig, algo: AlgoConfig, roles: TrainRoles, memory: MemoryPhases) -> TrainSide:
        return cls(actor=roles.actor, ref=roles.ref, critic=roles.critic, reward_model=roles.reward_model,
                   distill=roles.distill, algo=algo, actor_update=cfg.actor,
                   kl_controller=KLController.from_config(algo.kl), max_new_tokens=cfg.sampling.max_new_tokens,
                   memory=memory, seed=cfg.dist.seed, step_rows=cfg.data.prompts_per_step * cfg.sampling.n,
                   stale=cfg.trainer.is_async)

    def train(self, batch: RolloutBatch, metrics: StepMetrics, step: int) -> ScoredBatch:
        """The global batch of step `step` scored by every model role, then the actor and critic updates on it."""
        if batch.trajectory_index_b is not None:  # forked trajectories' extra rows: the update still splits evenly
            batch = pad_to_multiple(batch, self.step_rows)
        with self.memory.training(metrics):
            scored = self.score(batch, metrics, step)
            with metrics.timer("update_actor"):
                metrics.update_from_shards(self.actor.update(scored, self.algo))
            if self.critic is not None:
                with metrics.timer("update_critic"):
                    metrics.update_from_shards(self.critic.update(scored, self.algo))
        return scored

    def score(self, batch: RolloutBatch, metrics: StepMetrics, step: int) -> ScoredBatch:
        """Reward model, old / ref logprobs, values, advantages and the actor's loss weights and mask (and
        Clip-Cov / KL-Cov's tokens, drawn with a generator seeded by the step)."""
        algo = self.algo
        if self.reward_model is not None:
            with metrics.timer("reward"):
                batch = dataclasses.replace(batch, scores_b=shaped_scores(
                    self.reward_model.scores(batch), batch.trajectory_lengths_b, self.max_new_tokens,
                    algo.overlong_buffer))
        old_bt = sum_pi_squared_bt = None
        if needs_old_logprobs(algo, self.actor_update, stale=self.stale):
            with metrics.timer("old_log_prob"):
                old_bt = self.actor.logprobs(batch, with_sum_pi_squared=needs_sum_pi_squared(algo))
            if needs_sum_pi_squared(algo):
                old_bt, sum_pi_squared_bt = old_bt.unbind(-1)
            if self.actor.records_routing:  # R2: the update replays the old-logprob forward's routing
                batch = dataclasses.replace(batch, routed_experts_bslk=self.actor.recorded_routing_bslk)
            for name, value in self.actor.routing_metrics.items():  # routing replay R3: rollout vs. training
                metrics.add_global(f"rollout/{name}", value)
        elif bypasses_old_logprobs(algo):
            old_bt = batch.rollout_logprobs_bt
        ref_bt = values_bt = None
        if self.ref is not None:
            with metrics.timer("ref"):
                ref_bt = self.ref.logprobs(batch)
        if self.critic is not None:
            with metrics.timer("values"):
                values_bt = self.critic.values(batch)
        with metrics.timer("adv"):
            token_rewards_bt = self._token_rewards(batch, old_bt, ref_bt, metrics)
            is_weights_bt, loss_mask_bt = loss_filters(batch, old_bt, algo, metrics)
            inputs = AdvantageInputs(token_rewards_bt=token_rewards_bt, response_mask_bt=batch.response_mask_bt,
                                     values_bt=values_bt, baseline_scores_b=batch.baseline_scores_b,
                                     reward_components_bk=batch.reward_components_bk,
                                     groups=Groups.from_index(batch.group_index_b), old_logprobs_bt=old_bt,
                                     sum_pi_squared_bt=sum_pi_squared_bt, is_weights_bt=is_weights_bt)
            if batch.turn_returns_bt is not None:  # multi-turn credit=turn
                result = turn_advantages(algo.advantage, inputs, batch.turn_returns_bt, batch.trajectory_index_b)
            elif batch.trajectory_index_b is not None:
                result = trajectory_advantages(algo.advantage, inputs, batch.trajectory_index_b)
            else:
                result = compute_advantages(algo.advantage, inputs)
        teacher_bt, advantages_bt, topk = None, result.advantages_bt, {}
        if self.distill is not None:
            scores = self.distill.advantages(batch, old_bt, advantages_bt, metrics)
            teacher_bt, advantages_bt = scores.teacher_logprobs_bt, scores.advantages_bt
            topk = {"teacher_topk_ids_btk": scores.topk_ids_btk, "teacher_topk_logprobs_btk": scores.topk_logprobs_btk}
        cov_selected_bt = None
        if algo.policy_loss.kind in COVARIANCE_KINDS:  # once per step on the global batch: DP / micro-batch free
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
            cov_selected_bt = covariance_selection(algo.policy_loss, advantages_bt, old_bt, loss_mask_bt, generator)
        return ScoredBatch.of(batch, old_logprobs_bt=old_bt, ref_logprobs_bt=ref_bt, values_bt=values_bt,
                              token_rewards_bt=token_rewards_bt, advantages_bt=advantages_bt,
                              returns_bt=result.returns_bt, is_weights_bt=is_weights_bt, loss_mask_bt=loss_mask_bt,
                              teacher_logprobs_bt=teacher_bt, cov_selected_bt=cov_selected_bt, **topk)

    def _token_rewards(self, batch: RolloutBatch, old_bt: torch.Tensor | None, ref_bt: torch.Tensor | None,
                       metrics: StepMetrics) -> torch.Tensor:
        """The score on the last token, minus the KL penalty when it is in the reward (and the KL controller's
        update)."""
        token_rewards_bt = scores_to_token_rewards(batch.scores_b, batch.response_mask_bt)
        kl = self.algo.kl
        if not kl.use_in_reward:
            return token_rewards_bt
        shaped = apply_kl_in_reward(token_rewards_bt, old_bt, ref_bt, batch.response_mask_bt, kl.estimator,
                                    self.kl_controller.value)
        current_kl = float(shaped.seq_kl_b.mean())
        metrics.add_global("actor/reward_kl_penalty", current_kl)
        metrics.add_global("actor/reward_kl_coef", self.kl_controller.value)
        self.kl_controller.update(current_kl, batch.size)
        return shaped.token_rewards_bt

    def report(self, metrics: StepMetrics, batch: ScoredBatch, actor_version: int) -> None:
        """Metrics of the trained batch (`record_batch_metrics`)."""
        record_batch_metrics(metrics, batch, self.algo, self.max_new_tokens, actor_version)


def bypasses_old_logprobs(algo: AlgoConfig) -> bool:
    """Rollout correction's bypass mode: the rollout log-probs are the old ones, no forward."""
    correction = algo.rollout_correction
    return correction.active and correction.bypass_mode


def needs_old_logprobs(algo: AlgoConfig, update: UpdateConfig, *, stale: bool) -> bool:
    """Skipped when bypassed, or when the update is strictly on-policy and nothing else (KL in reward,
    decoupled rollout correction, the sampled distillation estimator's student logprobs, the optimal token
    baseline, Clip-Cov / KL-Cov's covariance) reads them (top-K distillation reads the update's own logprobs).
    `stale` (async: an older policy sampled the batch): `auto` runs the forward, since the update's own logprobs
    are not the sampler's policy and the ratio would be 1 without it."""
    if bypasses_old_logprobs(algo):
        return False
    runs_forward = update.old_logprobs_forward or (stale and update.recompute_old_logprobs == "auto")
    return (runs_forward or algo.kl.use_in_reward or algo.rollout_correction.needs_old_logprobs
            or (algo.distill.enable and algo.distill.estimator is DistillEstimator.SAMPLED)
            or needs_sum_pi_squared(algo) or algo.policy_loss.kind in COVARIANCE_KINDS)


def needs_sum_pi_squared(algo: AlgoConfig) -> bool:
    """The optimal token baseline reads the old-logprob forward's sum_v pi(v)^2 per position."""
    return algo.advantage.kind is AdvantageKind.OPTIMAL_TOKEN_BASELINE


def loss_filters(batch: RolloutBatch, old_bt: torch.Tensor | None, algo: AlgoConfig,
                 metrics: StepMetrics) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(rollout-correction weights, the actor's loss mask): rejected tokens and (overlong filtering) truncated
    rows leave the loss and its token count, as in verl."""
    is_weights_bt, keep_bt = None, batch.loss_mask_bt
    if algo.rollout_correction.needs_old_logprobs:
        correction = rollout_correction(old_bt, batch.rollout_logprobs_bt, keep_bt, algo.rollout_correction)
        is_weights_bt, keep_bt = correction.weights_bt, correction.keep_mask_bt
        for name, value in correction.metrics.items():
            metrics.add_global(name, value)
    if algo.overlong_filter:
        keep_bt = keep_bt & ~batch.truncated_b[:, None]
        metrics.add_global("response_length/overlong_filtered_fraction", float(batch.truncated_b.float().mean()))
    return is_weights_bt, keep_bt


def _masked_mean(x_bt: torch.Tensor, mask_bt: torch.Tensor) -> float:
    return float((x_bt * mask_bt).sum() / mask_bt.sum().clamp(min=1))


def record_batch_metrics(metrics: StepMetrics, batch: ScoredBatch, algo: AlgoConfig, max_new_tokens: int,
                         actor_version: int) -> None:
    """Metrics of the global batch (identical on every rank, so rank 0 reports them); staleness is how many
    updates the sampling policy is behind `actor_version` (the updates before this step's). Padding rows
    (`pad_to_multiple`) are left out: they are no rollouts."""
    padding_b = batch.sample_index_b == PADDING_UID
    if padding_b.any():
        batch = batch.select(~padding_b)
    mask = batch.response_mask_bt
    lengths = batch.response_lengths_b.float()
    num_tokens = int(batch.prompt_lengths_b.sum() + batch.response_lengths_b.sum())
    step_s = metrics.local()["timing_s/step"]
    empty_b = (batch.response_lengths_b <= 1) & ~batch.truncated_b  # an immediate EOS: nothing generated
    staleness_bt = (actor_version - batch.policy_version_bt) * mask
    values = {
        "critic/score/mean": float(batch.scores_b.mean()),
        "critic/score/max": float(batch.scores_b.max()),
        "critic/score/min": float(batch.scores_b.min()),
        "critic/advantages/mean": _masked_mean(batch.advantages_bt, mask),
        "response_length/mean": float(lengths.mean()),
        "response_length/max": float(lengths.max()),
        "response_length/min": float(lengths.min()),
        "response_length/clip_ratio": float((lengths >= max_new_tokens).float().mean()),
        "response_length/empty_ratio": float(empty_b.float().mean()),
        "prompt_length/mean": float(batch.prompt_lengths_b.float().mean()),
        "perf/total_num_tokens": float(num_tokens),
        # per rank, like verl's perf/throughput
        "perf/throughput_tok_s": num_tokens / max(step_s, 1e-9) / dist.get_world_size(),
        "rollout/staleness_mean": _masked_mean(staleness_bt.float(), mask),
        "rollout/staleness_max": float(staleness_bt.max()),
    }
    if algo.overlong_buffer.len:
        values["critic/overlong_penalty/mean"] = float(overlong_penalty(
            batch.trajectory_lengths_b, max_new_tokens, algo.overlong_buffer).mean())
    if batch.old_logprobs_bt is not None and not bypasses_old_logprobs(algo):
        diff_bt = (batch.rollout_logprobs_bt - batch.old_logprobs_bt).abs() * mask
        values["rollout/logprob_diff_mean"] = _masked_mean(diff_bt, mask)
        values["rollout/logprob_diff_max"] = float(diff_bt.max())
    if batch.routed_experts_bslk is not None:  # routing replay: what the batch carries per token
        routed = batch.routed_experts_bslk
        values["rollout/routing_bytes_per_token"] = float(routed.element_size() * routed[0, 0].numel())
    if batch.values_bt is not None:
        values["critic/values/mean"] = _masked_mean(batch.values_bt, mask)
        values["critic/returns/mean"] = _masked_mean(batch.returns_bt, mask)
        values["critic/vf_explained_var"] = float(explained_variance(batch.values_bt, batch.returns_bt, mask))
    for name, value in values.items():
        metrics.add_global(name, value)
