"""One RL step, in data-flow order (DESIGN.md §2), inside the colocated memory phases (`trainer/memory.py`):

  rollout │ PromptBatch ──► rollout.generate ──► Rollouts ──► rule reward (+ overlong shaping) ──► TrainBatch
          │             (global, on every rank; DAPO dynamic sampling: more rounds until the groups fill it)
  train   │             ──► reward model (on its mesh, when configured)
          │             ──► actor old logprobs (or the rollout's, bypass) · ref logprobs · critic values
          │             ──► advantages (GAE | GRPO | RLOO | REINFORCE++ | ReMax), KL in reward
          │             ──► rollout correction weights / rejection, overlong filtering (the actor's loss mask)
          │             ──► actor.update · critic.update
          │             ──► dump the scored batch (trainer.dump_rollouts: rollouts/step_<N>.parquet)
  sync    │             ──► weight sync actor ─► rollout engine, policy version + 1

Heavy work lives in the stages; this file only sequences them and records verl-named metrics.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from rlhf.algo.advantages import AdvantageInputs, AdvantageKind, compute_advantages, scores_to_token_rewards
from rlhf.algo.config import OverlongBufferConfig
from rlhf.algo.dapo import overlong_penalty
from rlhf.algo.groups import Groups
from rlhf.algo.kl import KLController, apply_kl_in_reward
from rlhf.algo.rollout_correction import rollout_correction
from rlhf.algo.value_loss import explained_variance
from rlhf.data.loader import PromptStep
from rlhf.metrics import StepMetrics
from rlhf.rollout.engine import RolloutEngine
from rlhf.rollout.sampling_params import SamplingParams
from rlhf.rollout.types import PromptBatch, Rollouts
from rlhf.trainer.batch import TrainBatch, build_train_batch
from rlhf.trainer.config import AlgoConfig, SamplingConfig, UpdateConfig
from rlhf.trainer.dynamic_sampling import count_groups, fill_batch, informative_groups
from rlhf.trainer.exchange import gather_global_batch, is_contributor
from rlhf.trainer.memory import MemoryPhases
from rlhf.trainer.roles import CriticRole, PolicyRole, RewardModelRole
from rlhf.trainer.scoring import Scorer
from rlhf.trainer.sync import EngineSync


@dataclass
class RLStack:
    """The step driver's handles on this rank (roles this rank is not in hold no model); only the drivers below
    (`rl_step`, `collect_batch`, `score_and_update`, `generate_and_score`) read it, the stages they call take
    the values they need."""

    rollout: RolloutEngine | None
    rollout_layout: Any
    scorer: Scorer
    actor: PolicyRole
    ref: PolicyRole | None
    critic: CriticRole | None
    weight_sync: EngineSync
    algo: AlgoConfig
    sampling: SamplingConfig
    actor_update: UpdateConfig
    kl_controller: KLController
    pad_token_id: int
    reward_model: RewardModelRole | None = None
    memory: MemoryPhases = field(default_factory=MemoryPhases)
    dump: Callable[[TrainBatch, int], None] | None = None  # `trainer.dump_rollouts`: (scored batch, step)
    last_batch: TrainBatch | None = None  # the last step's scored batch (what alerts.nan_policy=abort dumps)


def rl_step(stack: RLStack, prompts: PromptStep, step: int,
            more_prompts: Callable[[], PromptStep] | None = None) -> StepMetrics:
    """Run one step on this rank; returns this rank's (unreduced) metrics. `more_prompts` feeds dynamic
    sampling's extra generation rounds (the loader's `next_step`, on every rank)."""
    metrics = StepMetrics()
    with metrics.timer("step"):
        with stack.memory.rollout(metrics):
            batch, sampling = collect_batch(stack, prompts, step, more_prompts, metrics)
        train_and_sync(stack, batch, step, metrics)
    record_batch_metrics(metrics, batch, stack.algo, stack.sampling.max_new_tokens, actor_version=step - 1)
    for name, value in sampling.items():
        metrics.add_global(name, value)
    return metrics


def train_and_sync(stack: RLStack, batch: TrainBatch, step: int, metrics: StepMetrics) -> None:
    """The training phase on a global batch (generated now, or read from a dump by `rlhf replay`), the dump of
    the scored batch, then the weight sync."""
    stack.last_batch = batch
    with stack.memory.training(metrics):
        score_and_update(stack, batch, metrics)
    if stack.dump is not None:
        with metrics.timer("dump"):
            stack.dump(batch, step)
    with stack.memory.weight_sync(metrics), metrics.timer("update_weights"):
        stack.weight_sync.sync()


def replay_step(stack: RLStack, load: Callable[[], TrainBatch], step: int) -> StepMetrics:
    """`rl_step` on a batch read back (`rlhf replay`: `load` returns the step's dumped, scored rollouts)."""
    metrics = StepMetrics()
    with metrics.timer("step"):
        with metrics.timer("load"):
            batch = load()
        train_and_sync(stack, batch, step, metrics)
    record_batch_metrics(metrics, batch, stack.algo, stack.sampling.max_new_tokens, actor_version=step - 1)
    return metrics


def collect_batch(stack: RLStack, prompts: PromptStep, step: int,
                  more_prompts: Callable[[], PromptStep] | None, metrics: StepMetrics,
                  group: dist.ProcessGroup | None = None) -> tuple[TrainBatch, dict[str, float]]:
    """The step's global batch on every rank of `group` (default the world; async: the rollout mesh) and its
    dynamic_sampling/* metrics; with dynamic sampling, rounds of prompts until it is full."""
    batch = generate_round(stack, prompts, step, 0, metrics, group)
    return fill_rounds(stack, batch, step, more_prompts, metrics, group)


def fill_rounds(stack: RLStack, first: TrainBatch, step: int, more_prompts: Callable[[], PromptStep] | None,
                metrics: StepMetrics, group: dist.ProcessGroup | None = None,
                first_seed_round: int = 1) -> tuple[TrainBatch, dict[str, float]]:
    """Dynamic sampling after the first round (`first`, on every rank of `group`): rounds of prompts until the
    batch is full, the k-th extra round sampled with seed round `first_seed_round` + k - 1; without it `first`."""
    if not stack.algo.filter_groups.enable:
        return first, {}
    assert more_prompts is not None, "dynamic sampling (algo.filter_groups) needs rl_step(more_prompts=...)"
    rounds = [first]
    target = count_groups(first)
    while (informative_groups(rounds) < target
           and len(rounds) < stack.algo.filter_groups.max_num_gen_batches):
        rounds.append(generate_round(stack, more_prompts(), step, first_seed_round + len(rounds) - 1, metrics,
                                     group))
    full = fill_batch(rounds, target)
    return full.batch, {f"dynamic_sampling/{name}": value for name, value in full.metrics.items()}


def generate_round(stack: RLStack, prompts: PromptStep, step: int, gen_round: int, metrics: StepMetrics,
                   group: dist.ProcessGroup | None = None) -> TrainBatch:
    """One generation round: rollouts and rule rewards on the rollout ranks, gathered to every rank of `group`."""
    with metrics.timer("gen"):
        local = generate_and_score(stack, prompts, step, gen_round)
    with metrics.timer("gather"):
        return gather_global_batch(local, len(prompts.records), stack.rollout_layout, group)


def score_and_update(stack: RLStack, batch: TrainBatch, metrics: StepMetrics) -> TrainBatch:
    """The global batch scored by every model role, with advantages; then the actor and critic updates."""
    if stack.reward_model is not None:
        with metrics.timer("reward"):
            batch.scores_b = shaped_scores(stack.reward_model.scores(batch), batch.response_lengths_b,
                                           stack.sampling.max_new_tokens, stack.algo.overlong_buffer)
    if needs_old_logprobs(stack.algo, stack.actor_update):
        with metrics.timer("old_log_prob"):
            batch.old_logprobs_bt = stack.actor.logprobs(batch)
        for name, value in stack.actor.routing_metrics.items():  # routing replay R3: rollout vs. training
            metrics.add_global(f"rollout/{name}", value)
    elif bypasses_old_logprobs(stack.algo):
        batch.old_logprobs_bt = batch.rollout_logprobs_bt
    if stack.ref is not None:
        with metrics.timer("ref"):
            batch.ref_logprobs_bt = stack.ref.logprobs(batch)
    if stack.critic is not None:
        with metrics.timer("values"):
            batch.values_bt = stack.critic.values(batch)
    with metrics.timer("adv"):
        add_advantages(batch, stack.algo, stack.kl_controller, metrics)
        add_loss_filters(batch, stack.algo, metrics)
    with metrics.timer("update_actor"):
        metrics.update_from_shards(stack.actor.update(batch, stack.algo))
    if stack.critic is not None:
        with metrics.timer("update_critic"):
            metrics.update_from_shards(stack.critic.update(batch, stack.algo))
    return batch


def bypasses_old_logprobs(algo: AlgoConfig) -> bool:
    """Rollout correction's bypass mode: the rollout log-probs are the old ones, no forward."""
    correction = algo.rollout_correction
    return correction.active and correction.bypass_mode


def needs_old_logprobs(algo: AlgoConfig, update: UpdateConfig) -> bool:
    """Skipped when bypassed, or when the update is strictly on-policy and nothing else (KL in reward,
    decoupled rollout correction) reads them."""
    if bypasses_old_logprobs(algo):
        return False
    return update.old_logprobs_forward or algo.kl.use_in_reward or algo.rollout_correction.needs_old_logprobs


def generate_and_score(stack: RLStack, prompts: PromptStep, step: int, gen_round: int = 0) -> TrainBatch | None:
    """On rollout ranks: sample n responses per prompt and score them (contributors return the batch)."""
    if stack.rollout is None:
        return None
    prompt_batch = PromptBatch.from_token_lists(prompts.token_ids, pad_token_id=stack.pad_token_id)
    params = stack.sampling.train_params(step, gen_round)
    rollouts = stack.rollout.generate(prompt_batch, params)
    greedy = None
    if stack.algo.advantage.kind == AdvantageKind.REMAX:  # every TP rank generates: it is collective
        greedy = stack.rollout.generate(prompt_batch, SamplingParams(
            max_new_tokens=params.max_new_tokens, temperature=0.0, seed=params.seed))
    if not is_contributor(stack.rollout_layout, dist.get_rank()):
        return None
    batch = build_train_batch(prompt_batch, rollouts)
    batch.sample_index_b = sample_indices(prompts, rollouts)
    if stack.reward_model is not None:
        return batch  # scored by the reward model on its own mesh, after the gather
    batch.scores_b = shaped_scores(stack.scorer.score(prompts.records, rollouts), batch.response_lengths_b,
                                   stack.sampling.max_new_tokens, stack.algo.overlong_buffer)
    if greedy is not None:
        batch.baseline_scores_b = stack.scorer.score(prompts.records, greedy)[rollouts.prompt_index_r]
    return batch


def sample_indices(prompts: PromptStep, rollouts: Rollouts) -> torch.Tensor:
    """int64 [R]: the dataset index of each rollout's prompt (rollout dumps, replay)."""
    return torch.tensor([record.index for record in prompts.records], dtype=torch.long)[rollouts.prompt_index_r]


def shaped_scores(scores_b: torch.Tensor, lengths_b: torch.Tensor, max_new_tokens: int,
                  overlong: OverlongBufferConfig) -> torch.Tensor:
    """Sequence rewards plus DAPO's overlong penalty (zero unless algo.overlong_buffer.len > 0)."""
    return scores_b + overlong_penalty(lengths_b, max_new_tokens, overlong)


def add_loss_filters(batch: TrainBatch, algo: AlgoConfig, metrics: StepMetrics) -> None:
    """Rollout-correction weights and rejection, and overlong filtering: what the actor's loss weighs and
    keeps (rejected tokens and truncated rows leave the loss and its token count, as in verl)."""
    keep_bt = batch.response_mask_bt.bool()
    if algo.rollout_correction.needs_old_logprobs:
        correction = rollout_correction(batch.old_logprobs_bt, batch.rollout_logprobs_bt, keep_bt,
                                        algo.rollout_correction)
        batch.is_weights_bt, keep_bt = correction.weights_bt, correction.keep_mask_bt
        for name, value in correction.metrics.items():
            metrics.add_global(name, value)
    if algo.overlong_filter:
        keep_bt = keep_bt & ~batch.truncated_b[:, None]
        metrics.add_global("response_length/overlong_filtered_fraction", float(batch.truncated_b.float().mean()))
    if not torch.equal(keep_bt, batch.response_mask_bt.bool()):
        batch.loss_mask_bt = keep_bt


def add_advantages(batch: TrainBatch, algo: AlgoConfig, kl_controller: KLController, metrics: StepMetrics) -> None:
    """Token rewards (score on the last token, minus the KL penalty when it is in the reward), then advantages."""
    token_rewards_bt = scores_to_token_rewards(batch.scores_b, batch.response_mask_bt)
    kl = algo.kl
    if kl.use_in_reward:
        shaped = apply_kl_in_reward(token_rewards_bt, batch.old_logprobs_bt, batch.ref_logprobs_bt,
                                    batch.response_mask_bt, kl.estimator, kl_controller.value)
        token_rewards_bt = shaped.token_rewards_bt
        current_kl = float(shaped.seq_kl_b.mean())
        metrics.add_global("actor/reward_kl_penalty", current_kl)
        metrics.add_global("actor/reward_kl_coef", kl_controller.value)
        kl_controller.update(current_kl, batch.size)
    batch.token_rewards_bt = token_rewards_bt
    groups = Groups.from_index(batch.group_index_b)
    result = compute_advantages(algo.advantage, AdvantageInputs(
        token_rewards_bt=token_rewards_bt, response_mask_bt=batch.response_mask_bt, values_bt=batch.values_bt,
        baseline_scores_b=batch.baseline_scores_b, groups=groups))
    batch.advantages_bt, batch.returns_bt = result.advantages_bt, result.returns_bt


def _masked_mean(x_bt: torch.Tensor, mask_bt: torch.Tensor) -> float:
    return float((x_bt * mask_bt).sum() / mask_bt.sum().clamp(min=1))


def _empty_b(batch: TrainBatch) -> torch.Tensor:
    """Responses that stopped at their first token (an immediate EOS: nothing generated)."""
    stopped_b = ~batch.truncated_b if batch.truncated_b is not None else torch.ones_like(batch.response_lengths_b,
                                                                                          dtype=torch.bool)
    return (batch.response_lengths_b <= 1) & stopped_b


def record_batch_metrics(metrics: StepMetrics, batch: TrainBatch, algo: AlgoConfig, max_new_tokens: int,
                         actor_version: int) -> None:
    """Metrics of the global batch (identical on every rank, so rank 0 reports them); staleness is how many
    updates the sampling policy is behind `actor_version` (the updates before this step's)."""
    mask = batch.response_mask_bt
    lengths = batch.response_lengths_b.float()
    num_tokens = int(batch.prompt_lengths_b.sum() + batch.response_lengths_b.sum())
    step_s = metrics.local()["timing_s/step"]
    world = dist.get_world_size()
    values = {
        "critic/score/mean": float(batch.scores_b.mean()),
        "critic/score/max": float(batch.scores_b.max()),
        "critic/score/min": float(batch.scores_b.min()),
        "critic/advantages/mean": _masked_mean(batch.advantages_bt, mask),
        "response_length/mean": float(lengths.mean()),
        "response_length/max": float(lengths.max()),
        "response_length/min": float(lengths.min()),
        "response_length/clip_ratio": float((lengths >= max_new_tokens).float().mean()),
        "response_length/empty_ratio": float(_empty_b(batch).float().mean()),
        "prompt_length/mean": float(batch.prompt_lengths_b.float().mean()),
        "perf/total_num_tokens": float(num_tokens),
        "perf/throughput_tok_s": num_tokens / max(step_s, 1e-9) / world,  # per rank, like verl's perf/throughput
    }
    if algo.overlong_buffer.len:
        values["critic/overlong_penalty/mean"] = float(overlong_penalty(
            batch.response_lengths_b, max_new_tokens, algo.overlong_buffer).mean())
    if batch.old_logprobs_bt is not None and not bypasses_old_logprobs(algo):
        diff_bt = (batch.rollout_logprobs_bt - batch.old_logprobs_bt).abs() * mask
        values["rollout/logprob_diff_mean"] = _masked_mean(diff_bt, mask)
        values["rollout/logprob_diff_max"] = float(diff_bt.max())
    if batch.policy_version_bt is not None:
        staleness_bt = (actor_version - batch.policy_version_bt) * mask
        values["rollout/staleness_mean"] = _masked_mean(staleness_bt.float(), mask)
        values["rollout/staleness_max"] = float(staleness_bt.max())
    if batch.routed_experts_bslk is not None:  # routing replay: what the batch carries per token
        routed = batch.routed_experts_bslk
        values["rollout/routing_bytes_per_token"] = float(routed.element_size() * routed[0, 0].numel())
    if batch.values_bt is not None:
        values["critic/values/mean"] = _masked_mean(batch.values_bt, mask)
        values["critic/returns/mean"] = _masked_mean(batch.returns_bt, mask)
        values["critic/vf_explained_var"] = float(explained_variance(batch.values_bt, batch.returns_bt, mask))
    for name, value in values.items():
        metrics.add_global(name, value)
