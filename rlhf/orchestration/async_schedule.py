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
(`RolloutBatch.policy_version_bt`; metrics rollout/staleness_mean|max). Old logprobs are recomputed by the actor,
as verl's one-step-off recipe does (its compute_log_prob runs on every batch): PPO's ratio is taken against
the policy at update time, and rollout correction (token TIS by default for an engine with its own weights)
reweights each token by pi_old / pi_rollout, which now carries the staleness as well as the numerics.

The step is `StepDriver.one_step_off` (`rlhf.orchestration.step`); this module keeps the pipeline's bookkeeping.
In-flight work is part of the checkpoint: the training ranks hold the s batches already received (written once
for the group in `RolloutBatch`'s declared schema, `stages.batch.ROLLOUT_SCHEMA`), the rollout ranks their loader
position, RNG, started batch and held metrics (`RolloutSide.state_dict`), and every rank the count of batches
generated; a resumed run continues the same schedule, so its metrics equal the uninterrupted run's.
With partial rollouts (`trainer.partial_rollout_tokens` = P, needs s >= 2; `rlhf.orchestration.partial_rollout`) the
rollout ranks at step k finish batch k+s-1 (begun in step k-1) with v_{k-1}, then sample the first P tokens of
batch k+s; the trainers hold s-1 received batches, and the oldest token of a batch is still s updates behind.
With dynamic sampling (`algo.filter_groups`) the rollout ranks generate a batch's rounds as the synchronous loop
does (`RolloutSide.generate`: the batch's own seed per round, one loader batch each), gathered over the rollout mesh's
own group so every rollout rank agrees on the informative groups and the rounds; each rollout contributor sends
its dp share of the filled batch's groups at the boundary, and the batch's dynamic_sampling/* metrics wait on
the rollout ranks (and in their checkpoint) for the step that trains it. With partial rollouts too, the started
batch is a batch's first round: finished with the current weights, then its extra rounds run whole.
Engines: native or vLLM (on the rollout ranks alone, its world is the rollout mesh: `vllm_engine.rollout_world`).
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch.distributed as dist

from rlhf.algo.advantages import AdvantageKind
from rlhf.checkpoint import Replicated
from rlhf.orchestration.schema import RlhfConfig
from rlhf.errors import ConfigError
from rlhf.parallel.layout import ParallelLayout
from rlhf.parallel.meshes import RoleMeshes
from rlhf.orchestration.rollout_side import RolloutSide
from rlhf.orchestration.train_side import bypasses_old_logprobs, needs_old_logprobs
from rlhf.stages.batch import RolloutBatch, rollout_from_state, rollout_state
from rlhf.stages.config import AlgoConfig


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
    if not (needs_old_logprobs(algo, cfg.actor, stale=True) or bypasses_old_logprobs(algo)):
        raise ConfigError(f"{mode} trains on rollouts of an older policy, so the ratio needs old logprobs, which "
                          "actor.recompute_old_logprobs=false skips: set it to auto or true (or "
                          "algo.rollout_correction.bypass_mode=true to use the rollout's)")


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


class AsyncSchedule:
    """The k-step-off pipeline's bookkeeping on this rank (module docstring): which batch comes next, the batches
    in flight to the training ranks, and their checkpoint (with the rollout side's own in-flight work)."""

    def __init__(self, meshes: RoleMeshes, max_staleness: int, train_group: dist.ProcessGroup,
                 partial_tokens: int, rollout: RolloutSide) -> None:
        # batches the training ranks hold at a step's start: a started batch counts against the staleness bound
        self.depth = max_staleness - 1 if partial_tokens else max_staleness
        self.trains = not meshes["rollout"].is_member
        self.train_group, self.rollout = train_group, rollout
        self.reporter_rank = min(set(range(meshes.world_size)) - set(meshes["rollout"].layout.ranks))
        self.in_flight: deque[RolloutBatch] = deque()  # training ranks: batches received, not yet trained on
        self.num_generated = 0  # batches generated (and exchanged) so far; the same on every rank

    @property
    def next_index(self) -> int:
        """The batch the rollout ranks generate next."""
        return self.num_generated + 1

    def filling(self, step: int) -> bool:
        """Before step `step` trains, the pipeline still lacks a batch (step 1: batches 1..depth - 1)."""
        return self.num_generated < step + self.depth - 1

    def push(self, batch: RolloutBatch) -> None:
        """A batch exchanged at the boundary: the training ranks hold it until its step."""
        self.num_generated += 1
        if self.trains:
            self.in_flight.append(batch)

    def pop(self, step: int) -> RolloutBatch | None:
        """The batch step `step` trains (training ranks; None on the rollout ranks)."""
        if not self.trains:
            return None
        assert len(self.in_flight) == self.depth, (len(self.in_flight), step)
        return self.in_flight.popleft()

    def state_dict(self) -> dict[str, Any]:
        return {"num_generated": self.num_generated, "in_flight": [rollout_state(b) for b in self.in_flight],
                **self.rollout.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """After the loader's own state (a started batch reads its prompts from it again)."""
        self.num_generated = state["num_generated"]
        self.in_flight = deque(rollout_from_state(batch) for batch in state["in_flight"])
        self.rollout.load_state_dict(state)

    def replicated(self) -> list[Replicated]:
        """The in-flight batches are identical on every training rank: written once for their group."""
        return [Replicated(("async", "in_flight"), "async_in_flight", self.train_group)] if self.trains else []
