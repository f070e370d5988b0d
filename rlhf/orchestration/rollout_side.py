"""The rollout side of an RL step (DESIGN.md §2): `generate(k)` turns batch k's prompts into its `RolloutBatch`.

  prompts (loader) ──► engine.generate (batch k's own seed) ──► rule rewards (+ overlong shaping; GDPO: and
                                                                   their named components) ──► RolloutBatch
                   multi-turn (`multiturn.enable`): agent loops, turn-batched on the engine, one row per trajectory
                   DAPO dynamic sampling: rounds of prompts, gathered over `round_group`, until the groups fill it
                   partial rollouts (async): `start(k+1)` samples its first tokens, `generate(k+1)` finishes them

Each rollout rank returns its share of the batch (`RolloutShare`); the boundary's exchange makes it global.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from rlhf.agents.batch import to_rows, turn_returns_bt
from rlhf.agents.config import HistoryPolicy
from rlhf.agents.rollout import TOTALS, MultiTurnResult, MultiTurnRollout
from rlhf.agents.scheduler import TpRelay
from rlhf.algo.advantages import AdvantageKind
from rlhf.algo.config import OverlongBufferConfig
from rlhf.algo.dapo import overlong_penalty
from rlhf.data.loader import PromptLoader, PromptStep
from rlhf.metrics import StepMetrics
from rlhf.orchestration.partial_rollout import StartedBatch, continue_rollouts, restore_started, started_state
from rlhf.orchestration.schema import RlhfConfig
from rlhf.parallel.layout import ParallelLayout
from rlhf.parallel.meshes import RoleMeshes
from rlhf.rollout.engine import RolloutEngine
from rlhf.rollout.sampling_params import SamplingParams
from rlhf.rollout.types import PromptBatch, Rollouts
from rlhf.stages.batch import RolloutBatch, build_rollout_batch
from rlhf.stages.config import AlgoConfig, SamplingConfig
from rlhf.stages.dynamic_sampling import count_groups, fill_batch, informative_groups
from rlhf.stages.exchange import gather_global_batch, group_shard, is_contributor
from rlhf.stages.memory import MemoryPhases
from rlhf.stages.scoring import Scorer


@dataclass(frozen=True)
class RolloutShare:
    """A rollout rank's part of a batch for the boundary: its rows (contributors only) and its prompt count."""

    batch: RolloutBatch | None
    num_prompts: int


@dataclass(kw_only=True, eq=False)
class RolloutSide:
    """This rank's rollout work; `active` off the rollout mesh only in async (sync: every rank reads the loader
    and follows dynamic sampling's rounds)."""

    engine: RolloutEngine | None  # None off the rollout mesh
    layout: ParallelLayout  # the rollout mesh's
    loader: PromptLoader
    scorer: Scorer
    sampling: SamplingConfig
    algo: AlgoConfig
    memory: MemoryPhases
    pad_token_id: int
    scored_by_model: bool  # a reward model scores the batch on the training side
    active: bool
    round_group: dist.ProcessGroup | None  # dynamic sampling's rounds are gathered over it (None: the world)
    partial_tokens: int  # trainer.partial_rollout_tokens
    multiturn: MultiTurnRollout | None = None  # multiturn.enable: agent loops instead of one response per sample
    started: StartedBatch | None = None  # partial rollouts: the next batch, begun
    held_metrics: deque[dict[str, float]] = field(default_factory=deque)  # dynamic_sampling/* of untrained batches
    agent_rounds: list[MultiTurnResult] = field(default_factory=list)  # this step's multi-turn calls (metrics)

    @classmethod
    def from_config(cls, cfg: RlhfConfig, algo: AlgoConfig, meshes: RoleMeshes, *, engine: RolloutEngine | None,
                    loader: PromptLoader, scorer: Scorer, memory: MemoryPhases, pad_token_id: int) -> RolloutSide:
        mesh, is_async = meshes["rollout"], cfg.trainer.is_async
        return cls(engine=engine, layout=mesh.layout, loader=loader, scorer=scorer, sampling=cfg.sampling,
                   algo=algo, memory=memory, pad_token_id=pad_token_id, scored_by_model=bool(cfg.reward.model_path),
                   active=mesh.is_member or not is_async,
                   round_group=mesh.pgs.layout_all if is_async and mesh.is_member else None,
                   partial_tokens=cfg.trainer.partial_rollout_tokens,
                   multiturn=(MultiTurnRollout.from_config(cfg.multiturn, scorer.tokenizer, TpRelay.over(mesh.pgs.tp))
                              if cfg.multiturn.enable and mesh.is_member else None))

    def generate(self, index: int, metrics: StepMetrics) -> RolloutShare:
        """Batch `index` (sampled with its own seed), this rank's share of it; a started batch is finished."""
        if not self.active:
            return RolloutShare(None, 0)
        with self.memory.rollout(metrics):
            started, self.started = self.started, None
            if started is not None:
                assert started.index == index, (started.index, index)
                prompts, first_extra_round = started.prompts, 2  # its continuation took seed round 1
                with metrics.timer("gen"):
                    local = self._finish(started)
            else:
                prompts, first_extra_round = self.loader.next_step(), 1
                local = self._round(prompts, index, 0, metrics)
            share = RolloutShare(local, len(prompts.records))
            if self.algo.filter_groups.enable:
                share = self._fill(share, index, first_extra_round, metrics)
        if self.agent_rounds:  # multiturn/* over every round the step generated (DAPO: several)
            for name, value in MultiTurnResult.merged(self.agent_rounds).metrics().items():
                metrics.add(name, value, "sum" if name in TOTALS else "mean")
            self.agent_rounds.clear()
        return share

    def start(self, index: int, metrics: StepMetrics) -> None:
        """Partial rollouts: sample the first `partial_tokens` of every row of batch `index` with the current
        weights (finished by `generate(index)` after the next weight push); otherwise nothing."""
        if not (self.active and self.partial_tokens):
            return
        with self.memory.rollout(metrics), metrics.timer("gen"):
            loader_state = self.loader.state_dict()
            prompts = self.loader.next_step()
            params = dataclasses.replace(self.sampling.train_params(index), max_new_tokens=self.partial_tokens)
            rollouts = self.engine.generate(self._prompt_batch(prompts), params)
        self.started = StartedBatch(prompts, loader_state, index, rollouts)

    def report(self, metrics: StepMetrics) -> None:
        """The dynamic_sampling/* metrics of the batch this step trains (held by the ranks that decided them)."""
        if self.held_metrics:
            for name, value in self.held_metrics.popleft().items():
                metrics.add(name, value, "max")

    def _round(self, prompts: PromptStep, index: int, gen_round: int, metrics: StepMetrics) -> RolloutBatch | None:
        """One generation round on the rollout ranks; contributors return it scored by the rule reward."""
        with metrics.timer("gen"):
            if self.engine is None:
                return None
            params = self.sampling.train_params(index, gen_round)
            if self.multiturn is not None:
                result = self.multiturn.collect(self.engine, prompts.records, params, self.pad_token_id)
                if result is None:  # a TP rank that followed its leader's engine calls
                    return None
                self.agent_rounds.append(result)
                return self._agent_batch(prompts, result)
            prompt_batch = self._prompt_batch(prompts)
            rollouts = self.engine.generate(prompt_batch, params)
            greedy = None
            if self.algo.advantage.kind == AdvantageKind.REMAX:  # every TP rank generates: it is collective
                greedy = self.engine.generate(prompt_batch, SamplingParams(
                    max_new_tokens=params.max_new_tokens, temperature=0.0, seed=params.seed))
            if not is_contributor(self.layout, dist.get_rank()):
                return None
            return self._batch(prompts, prompt_batch, rollouts, greedy)

    def _finish(self, started: StartedBatch) -> RolloutBatch | None:
        """Partial rollouts: the started rows still running continued with the current weights."""
        prompt_batch = self._prompt_batch(started.prompts)
        merged, versions_rt = continue_rollouts(self.engine, prompt_batch, started.rollouts,
                                                self.sampling.train_params(started.index, gen_round=1),
                                                self.sampling.max_new_tokens)
        if not is_contributor(self.layout, dist.get_rank()):
            return None
        return self._batch(started.prompts, prompt_batch, merged, versions_rt=versions_rt)

    def _batch(self, prompts: PromptStep, prompt_batch: PromptBatch, rollouts: Rollouts,
               greedy: Rollouts | None = None, versions_rt: torch.Tensor | None = None) -> RolloutBatch:
        """The rollouts as a batch with their rule rewards (none when a reward model scores them)."""
        scores_b = baseline_b = components_bk = None
        if not self.scored_by_model:
            if self.algo.advantage.kind == AdvantageKind.GDPO:
                rewards_b, components_bk = self.scorer.score_components(prompts.records, rollouts,
                                                                        self.algo.advantage.gdpo_reward_keys)
            else:
                rewards_b = self.scorer.score(prompts.records, rollouts)
            scores_b = shaped_scores(rewards_b, rollouts.response_lengths_r, self.sampling.max_new_tokens,
                                     self.algo.overlong_buffer)
            if greedy is not None:
                baseline_b = self.scorer.score(prompts.records, greedy)[rollouts.prompt_index_r]
        return build_rollout_batch(prompt_batch, rollouts, sample_index_b=sample_indices(prompts, rollouts),
                                   scores_b=scores_b, baseline_scores_b=baseline_b,
                                   reward_components_bk=components_bk, policy_version_rt=versions_rt)

    def _agent_batch(self, prompts: PromptStep, result: MultiTurnResult) -> RolloutBatch:
        """Trajectories as rows (loss, KL and advantages on sampled tokens only), scored on their last turn (or
        by their environment) and overlong-shaped on the whole trajectory's length; a dropped group keeps its
        rows with nothing to train on."""
        rows = to_rows(result, self.pad_token_id, num_samples=self.sampling.n)
        sample_index_b = torch.tensor([record.index for record in prompts.records],
                                      dtype=torch.long)[rows.group_index_b]
        forks = self.multiturn.limits.history is HistoryPolicy.FORK  # a trajectory may be several rows
        batch = RolloutBatch(tokens_bs=rows.tokens_bs, prompt_lengths_b=rows.prompt_lengths_b,
                             response_lengths_b=rows.response_lengths_b, response_mask_bt=rows.loss_mask_bt,
                             pad_token_id=self.pad_token_id, group_index_b=rows.group_index_b,
                             sample_index_b=sample_index_b, loss_mask_bt=rows.loss_mask_bt,
                             trajectory_index_b=rows.trajectory_index_b if forks else None,
                             rollout_logprobs_bt=rows.rollout_logprobs_bt, policy_version_bt=rows.policy_version_bt,
                             truncated_b=rows.truncated_b, scores_b=None, baseline_scores_b=None,
                             reward_components_bk=None, routed_experts_bslk=None)
        if self.scored_by_model:
            return batch
        texts = self.multiturn.final_texts(result)
        rule = self.scorer.score_texts([record for record, _ in texts], [text for _, text in texts])
        own = [t.reward for group in result.kept for t in group.trajectories]
        kept_b = torch.tensor([own_reward if own_reward is not None else float(score)
                               for own_reward, score in zip(own, rule.tolist())], dtype=torch.float32)
        scores_b = torch.zeros(rows.size, dtype=torch.float32)
        scores_b[rows.kept_b] = kept_b[rows.rollout_index_b[rows.kept_b]]
        penalty_b = overlong_penalty(batch.trajectory_lengths_b, self.sampling.max_new_tokens,
                                     self.algo.overlong_buffer)
        turn_returns = (turn_returns_bt(rows, kept_b, penalty_b, self.multiturn.limits.turn_discount)
                        if self.multiturn.credit == "turn" else None)
        return dataclasses.replace(batch, scores_b=scores_b + penalty_b, turn_returns_bt=turn_returns)

    def _fill(self, first: RolloutShare, index: int, first_extra_round: int, metrics: StepMetrics) -> RolloutShare:
        """DAPO dynamic sampling: rounds of prompts (gathered over `round_group`, so its ranks agree on them) until
        the informative groups fill the batch; each contributor then shares its dp range of the groups."""
        with metrics.timer("gather"):
            rounds = [gather_global_batch(first.batch, first.num_prompts, self.layout, self.round_group)]
        target = count_groups(rounds[0])
        while informative_groups(rounds) < target and len(rounds) < self.algo.filter_groups.max_num_gen_batches:
            prompts = self.loader.next_step()
            local = self._round(prompts, index, first_extra_round + len(rounds) - 1, metrics)
            with metrics.timer("gather"):
                rounds.append(gather_global_batch(local, len(prompts.records), self.layout, self.round_group))
        full = fill_batch(rounds, target)
        self.held_metrics.append({f"dynamic_sampling/{name}": value for name, value in full.metrics.items()})
        rank = dist.get_rank()
        if not is_contributor(self.layout, rank):
            return RolloutShare(None, 0)
        return RolloutShare(group_shard(full.batch, self.layout.coords(rank).dp_rank, self.layout.dp),
                            first.num_prompts)

    def _prompt_batch(self, prompts: PromptStep) -> PromptBatch:
        return PromptBatch.from_token_lists(prompts.token_ids, pad_token_id=self.pad_token_id)

    def state_dict(self) -> dict[str, Any]:
        """In-flight rollout work (async checkpoints): the started batch and the held metrics."""
        return {"started": started_state(self.started), "dynamic_sampling": list(self.held_metrics)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """After the loader's own state (a started batch reads its prompts from it again)."""
        self.started = restore_started(state["started"], self.loader)
        self.held_metrics = deque(state.get("dynamic_sampling", []))  # absent: written before it existed


def sample_indices(prompts: PromptStep, rollouts: Rollouts) -> torch.Tensor:
    """int64 [R]: the dataset index of each rollout's prompt (rollout dumps, replay)."""
    return torch.tensor([record.index for record in prompts.records], dtype=torch.long)[rollouts.prompt_index_r]


def shaped_scores(scores_b: torch.Tensor, lengths_b: torch.Tensor, max_new_tokens: int,
                  overlong: OverlongBufferConfig) -> torch.Tensor:
    """Sequence rewards plus DAPO's overlong penalty (zero unless algo.overlong_buffer.len > 0)."""
    return scores_b + overlong_penalty(lengths_b, max_new_tokens, overlong)
