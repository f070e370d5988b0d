"""Asynchronous RL on split placement (`trainer.async_mode=one_step_off`; `trainer.max_staleness` = s steps off):
the rollout ranks generate batch k+s while the training ranks score and update on batch k.

SPMD without threads: every rank runs this same program and skips the other side's work, so the two sides
share collectives only at the step boundary, issued in one fixed order on every rank:

  step k     rollout ranks                             training ranks (actor, ref, critic, reward model)
  ────────   ────────────────────────────────────────  ──────────────────────────────────────────────────
  work       generate + rule-score batch k+s with      batch k: reward model, old / ref logprobs, values,
             policy v_{k-1} (batch k+s's own seed);    advantages, actor and critic updates (v_{k-1} -> v_k);
             collectives: the rollout mesh's only      collectives: the training ranks' group only
  boundary   exchange batch k+s (world) -> weight push v_k (world) -> metric reduction (world)
             -> validation / checkpoint when due (world), exactly as in the synchronous loop

Before step 1 the pipeline fills: batches 1..s are generated with v_0 and exchanged while the trainers wait.
Batch j is sampled by v_{max(0, j-s-1)} and trained by v_{j-1}: staleness min(j-1, s), recorded per token
(`TrainBatch.policy_version_bt`; metrics rollout/staleness_mean|max). Old logprobs are recomputed by the actor,
as verl's one-step-off recipe does (its compute_log_prob runs on every batch): PPO's ratio is taken against
the policy at update time, and rollout correction (token TIS by default for an engine with its own weights)
reweights each token by pi_old / pi_rollout, which now carries the staleness as well as the numerics.

In-flight work is part of the checkpoint: the training ranks hold the s batches already received (written once
for the group, safetensors + JSON), the rollout ranks their loader position and RNG, and every rank the count of
batches generated; a resumed run continues the same schedule, so its metrics equal the uninterrupted run's.
With partial rollouts (`trainer.partial_rollout_tokens` = P, needs s >= 2; `rlhf.orchestration.partial_rollout`) the
rollout ranks at step k finish batch k+s-1 (begun in step k-1) with v_{k-1}, then sample the first P tokens of
batch k+s; the trainers hold s-1 received batches, and the oldest token of a batch is still s updates behind.
With dynamic sampling (`algo.filter_groups`) the rollout ranks generate a batch's rounds as the synchronous loop
does (`collect_batch`: the batch's own seed per round, one loader batch each), gathered over the rollout mesh's
own group so every rollout rank agrees on the informative groups and the rounds; each rollout contributor sends
its dp share of the filled batch's groups at the boundary, and the batch's dynamic_sampling/* metrics wait on
the rollout ranks (and in their checkpoint) for the step that trains it. With partial rollouts too, the started
batch is a batch's first round: finished with the current weights, then its extra rounds run whole.
Engines: native or vLLM (on the rollout ranks alone, its world is the rollout mesh: `vllm_engine.rollout_world`).
"""

from __future__ import annotations

import dataclasses
from collections import deque
from typing import Any

import torch.distributed as dist

from rlhf.algo.advantages import AdvantageKind
from rlhf.checkpoint import Replicated
from rlhf.orchestration.schema import RlhfConfig
from rlhf.data.loader import PromptLoader, PromptStep
from rlhf.errors import CheckpointError, ConfigError
from rlhf.metrics import StepMetrics
from rlhf.parallel.layout import ParallelLayout
from rlhf.parallel.meshes import RoleMeshes
from rlhf.orchestration.step import (RLStack, collect_batch, fill_rounds, generate_and_score,
                                     record_batch_metrics, score_and_update)
from rlhf.trainer.batch import TrainBatch
from rlhf.trainer.config import AlgoConfig
from rlhf.trainer.exchange import gather_global_batch, group_shard, is_contributor
from rlhf.orchestration.partial_rollout import StartedBatch, finish_batch, restore_started, start_batch, started_state


def check_async(cfg: RlhfConfig, layouts: dict[str, ParallelLayout], algo: AlgoConfig) -> None:
    """Async needs rollout ranks no training role uses, and old logprobs the update can trust (pure)."""
    check_partial_rollouts(cfg)
    if not cfg.trainer.is_async:
        return
    mode = f"trainer.async_mode={cfg.trainer.async_mode}"
    if cfg.mesh.placement != "split":
        raise ConfigError(f"{mode} needs mesh.placement=split: colocated ranks generate and train one after the "
                          "other, so nothing can overlap; set mesh.placement=split with mesh.rollout.ranks apart "
                          "from the training roles' ranks, or trainer.async_mode=off")
    rollout = set(layouts["rollout"].ranks)
    for role, layout in layouts.items():
        shared = sorted(rollout & set(layout.ranks)) if role != "rollout" else []
        if shared:
            raise ConfigError(f"{mode} needs the rollout on ranks of its own, but mesh.{role} also uses ranks "
                              f"{shared[0]}..{shared[-1]} of mesh.rollout.ranks={cfg.mesh.rollout.ranks}; give "
                              f"mesh.rollout a range no other role uses, or set trainer.async_mode=off")
    correction = algo.rollout_correction
    if not (cfg.actor.recompute_old_logprobs or algo.kl.use_in_reward or correction.needs_old_logprobs
            or (correction.active and correction.bypass_mode)):
        raise ConfigError(f"{mode} trains on rollouts of an older policy, so the ratio needs old logprobs: set "
                          "actor.recompute_old_logprobs=true (or algo.rollout_correction.bypass_mode=true to use "
                          "the rollout's)")


def check_partial_rollouts(cfg: RlhfConfig) -> None:
    """Partial rollouts need async with room in the staleness bound for a batch's first tokens (pure)."""
    tokens, trainer = cfg.trainer.partial_rollout_tokens, cfg.trainer
    if not tokens:
        return
    key = f"trainer.partial_rollout_tokens={tokens}"
    if not trainer.is_async or trainer.max_staleness < 2:
        raise ConfigError(f"{key} continues rows after a weight push, which stales their first tokens one more "
                          f"step: it needs trainer.async_mode=one_step_off with trainer.max_staleness >= 2 (got "
                          f"{trainer.async_mode}, {trainer.max_staleness})")
    if tokens >= cfg.sampling.max_new_tokens:
        raise ConfigError(f"{key} must be below sampling.max_new_tokens={cfg.sampling.max_new_tokens} (rows stop "
                          "there anyway); lower it or set 0")
    if cfg.rollout.engine not in ("native", "vllm") or cfg.algo.advantage.kind == AdvantageKind.REMAX:
        raise ConfigError(f"{key} runs with the native or vllm engine and without ReMax's greedy baseline only yet "
                          f"(rollout.engine={cfg.rollout.engine}, algo.advantage.kind={cfg.algo.advantage.kind})")


def training_group(meshes: RoleMeshes) -> dist.ProcessGroup:
    """The ranks outside the rollout mesh, which gather the training roles' outputs (collective: every rank)."""
    rollout = set(meshes["rollout"].layout.ranks)
    return dist.new_group([rank for rank in range(meshes.world_size) if rank not in rollout])


def batch_state(batch: TrainBatch) -> dict[str, Any]:
    """A batch as a checkpoint state tree (tensors and plain values, no pickle)."""
    return {field.name: getattr(batch, field.name) for field in dataclasses.fields(TrainBatch)}


def batch_from_state(state: dict[str, Any]) -> TrainBatch:
    names = {field.name for field in dataclasses.fields(TrainBatch)}
    if set(state) != names:
        raise CheckpointError(f"the checkpoint's in-flight batch has fields {sorted(set(state) ^ names)} this "
                              "version does not expect; resume it with the version that wrote it")
    return TrainBatch(**state)


class AsyncSchedule:
    """This rank's side of the k-step-off schedule (module docstring); `step(k)` ends at the step boundary."""

    def __init__(self, stack: RLStack, loader: PromptLoader, meshes: RoleMeshes, max_staleness: int,
                 train_group: dist.ProcessGroup, partial_tokens: int = 0) -> None:
        self.stack, self.loader, self.max_staleness = stack, loader, max_staleness
        self.partial_tokens = partial_tokens
        # batches the training ranks hold at a step's start: a started batch counts against the staleness bound
        self.depth = max_staleness - 1 if partial_tokens else max_staleness
        self.started: StartedBatch | None = None  # rollout ranks, partial rollouts: the next batch, begun
        self.rollout_layout = meshes["rollout"].layout
        self.generates = meshes["rollout"].is_member
        # dynamic sampling: the rollout ranks decide a batch's rounds among themselves (their own group)
        self.rollout_group = meshes["rollout"].pgs.layout_all if self.generates else None
        self.sampling_metrics: deque[dict[str, float]] = deque()  # rollout ranks: batches generated, not trained
        self.train_group = train_group
        self.reporter_rank = min(set(range(meshes.world_size)) - set(self.rollout_layout.ranks))
        self.in_flight: deque[TrainBatch] = deque()  # training ranks: batches received, not yet trained on
        self.num_generated = 0  # batches generated (and exchanged) so far; the same on every rank

    def step(self, step: int) -> StepMetrics:
        """Run step `step` on this rank (unreduced metrics): fill the pipeline if needed, this side's work, then
        the boundary (exchange of the next batch, weight push)."""
        metrics = StepMetrics(reporter_rank=self.reporter_rank)
        batch = None
        with metrics.timer("step"):
            while self.num_generated < step + self.depth - 1:
                self._exchange(self._generate(metrics), metrics)
            local = self._generate(metrics)
            if self.generates and self.partial_tokens:
                with self.stack.memory.rollout(metrics), metrics.timer("gen"):
                    self.started = start_batch(self.stack, self.loader, self.num_generated + 2, self.partial_tokens)
            if not self.generates:
                assert len(self.in_flight) == self.depth, (len(self.in_flight), step)
                batch = self.in_flight.popleft()
                self.stack.last_batch = batch  # what alerts.nan_policy=abort dumps
                with self.stack.memory.training(metrics):
                    score_and_update(self.stack, batch, metrics)
                if self.stack.dump is not None:  # trainer.dump_rollouts: under the step that trains the batch
                    with metrics.timer("dump"):
                        self.stack.dump(batch, step)
            self._exchange(local, metrics)
            with self.stack.memory.weight_sync(metrics), metrics.timer("update_weights"):
                self.stack.weight_sync.sync()
        if batch is not None:
            record_batch_metrics(metrics, batch, self.stack.algo, self.stack.sampling.max_new_tokens,
                                 actor_version=step - 1)
        if self.sampling_metrics:  # batch `step`'s rounds, agreed on every rollout rank: "max" keeps the value
            for name, value in self.sampling_metrics.popleft().items():
                metrics.add(name, value, "max")
        return metrics

    def _generate(self, metrics: StepMetrics) -> tuple[TrainBatch | None, int]:
        """Rollout ranks: the next batch's rollouts and rule rewards, sampled with that batch's own seed (a
        started batch is finished with the current weights)."""
        if not self.generates:
            return None, 0
        if self.started is not None:
            started, self.started = self.started, None
            assert started.index == self.num_generated + 1, (started.index, self.num_generated)
            if self.stack.algo.filter_groups.enable:
                return self._fill_started(started, metrics)
            with self.stack.memory.rollout(metrics), metrics.timer("gen"):
                return finish_batch(self.stack, started), len(started.prompts.records)
        prompts = self.loader.next_step()
        if self.stack.algo.filter_groups.enable:
            return self._fill(prompts, metrics)
        with self.stack.memory.rollout(metrics), metrics.timer("gen"):
            return generate_and_score(self.stack, prompts, self.num_generated + 1), len(prompts.records)

    def _fill(self, prompts: PromptStep, metrics: StepMetrics) -> tuple[TrainBatch | None, int]:
        """Dynamic sampling on the rollout ranks: the synchronous loop's rounds (seeds, loader batches), gathered
        over the rollout mesh only; each contributor then sends its dp share of the filled batch's groups."""
        with self.stack.memory.rollout(metrics):
            batch, sampling = collect_batch(self.stack, prompts, self.num_generated + 1, self.loader.next_step,
                                            metrics, self.rollout_group)
        return self._share(batch, sampling, len(prompts.records))

    def _fill_started(self, started: StartedBatch, metrics: StepMetrics) -> tuple[TrainBatch | None, int]:
        """Dynamic sampling with partial rollouts: the started first round finished with the current weights
        (its continuation took seed round 1), then the extra rounds, whole, with seed rounds 2, 3, ..."""
        layout = self.rollout_layout
        with self.stack.memory.rollout(metrics):
            with metrics.timer("gen"):
                local = finish_batch(self.stack, started)
            with metrics.timer("gather"):
                first = gather_global_batch(local, len(started.prompts.records), layout, self.rollout_group)
            batch, sampling = fill_rounds(self.stack, first, started.index, self.loader.next_step, metrics,
                                          self.rollout_group, first_seed_round=2)
        return self._share(batch, sampling, len(started.prompts.records))

    def _share(self, batch: TrainBatch, sampling: dict[str, float], num_prompts: int) -> tuple[TrainBatch | None, int]:
        """Hold the filled batch's dynamic_sampling/* metrics; each contributor sends its dp share of the groups
        (`num_prompts`: this dp rank's share of the target, data.prompts_per_step / dp)."""
        self.sampling_metrics.append(sampling)
        layout, rank = self.rollout_layout, dist.get_rank()
        if not is_contributor(layout, rank):
            return None, 0
        return group_shard(batch, layout.coords(rank).dp_rank, layout.dp), num_prompts

    def _exchange(self, local: tuple[TrainBatch | None, int], metrics: StepMetrics) -> None:
        """Collective over the world: the rollout ranks' new batch reaches every training rank."""
        with metrics.timer("gather"):
            batch = gather_global_batch(local[0], local[1], self.rollout_layout)
        self.num_generated += 1
        if not self.generates:
            self.in_flight.append(batch)

    def state_dict(self) -> dict[str, Any]:
        return {"num_generated": self.num_generated, "in_flight": [batch_state(b) for b in self.in_flight],
                "started": started_state(self.started), "dynamic_sampling": list(self.sampling_metrics)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """After the loader's own state (a started batch reads its prompts from it again)."""
        self.num_generated = state["num_generated"]
        self.in_flight = deque(batch_from_state(batch) for batch in state["in_flight"])
        self.started = restore_started(state["started"], self.loader)
        self.sampling_metrics = deque(state.get("dynamic_sampling", []))  # absent: written before it existed

    def replicated(self) -> list[Replicated]:
        """The in-flight batches are identical on every training rank: written once for their group."""
        return [] if self.generates else [Replicated(("async", "in_flight"), "async_in_flight", self.train_group)]
