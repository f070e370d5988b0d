"""`rlhf replay`: the trainer with each step's batch read from a rollout dump (`trainer.dump_rollouts`) instead of
generated. Step k trains on the k-th dump of `replay.rollouts`: its token ids, scores and rollout logprobs.

    dump k ──► [reward_norm: scores / running std] ──► old/ref logprobs, values ──► advantages
           ──► rollout correction (the dumped logprobs are pi_rollout) ──► actor.update · critic.update

No rollout engine is built unless validation needs one (data.val_files); then it validates as `rlhf train`
does. Resume is the trainer's; the reward statistics are rebuilt from the dumps already trained on (the same
merges in the same order, so a resumed replay equals an uninterrupted one).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from rlhf.algo.running_stats import RunningMeanStd
from rlhf.orchestration.schema import RlhfConfig
from rlhf.errors import ConfigError
from rlhf.metrics import StepMetrics
from rlhf.run_dir import RunDir, get_logger
from rlhf.stages.batch import PADDING_UID, RolloutBatch
from rlhf.orchestration.checks import read_hf_config
from rlhf.orchestration.loop import Trainer
from rlhf.orchestration.preflight import Problems, check_token_budgets, plan_layouts, preflight
from rlhf.orchestration.rollout_dump import check_dumps, longest_dumped_row, read_dump, read_scores
from rlhf.stages.sync import SharedWeights

log = get_logger("replay")


def replay_config(cfg: RlhfConfig) -> RlhfConfig:
    """The config a replay runs: rollout correction's `auto` is on (the dumps came from another policy's
    weights), and nothing is dumped again."""
    if not cfg.replay.rollouts:
        raise ConfigError("rlhf replay needs the dumps to train on: --rollouts DIR (a run's rollouts/ folder)")
    algo = cfg.algo
    if algo.rollout_correction.enable == "auto":
        algo = dataclasses.replace(algo, rollout_correction=dataclasses.replace(algo.rollout_correction, enable=True))
    trainer = dataclasses.replace(cfg.trainer, dump_rollouts=False)
    return dataclasses.replace(cfg, algo=algo, trainer=trainer)


def replay_preflight(cfg: RlhfConfig, world_size: int) -> list[str]:
    """The dump folder's checks (format, metadata, column types, sizes; the first dump's rows), then
    `rlhf train`'s, then every packing budget against the longest dumped row (the dumps may come from a run with
    longer rows than this config's limits); returns its notes."""
    files = check_dumps(cfg.replay.rollouts, num_steps=cfg.trainer.total_steps,
                        rows_per_step=cfg.data.prompts_per_step * cfg.sampling.n)
    run_path = (Path(cfg.run.output_dir) / cfg.run.name).resolve() if cfg.run.name else None
    if run_path is not None and run_path in Path(cfg.replay.rollouts).resolve().parents:
        raise ConfigError(f"--rollouts {cfg.replay.rollouts} lies in the replay's own run folder {run_path}; "
                          f"set run.name to another name")
    notes = preflight(cfg, world_size)
    hf_config = read_hf_config(cfg.model.path)
    read_dump(files[0], hf_config.vocab_size, hf_config.max_position_embeddings)
    problems = Problems()
    check_token_budgets(cfg, plan_layouts(cfg, world_size), problems, longest=longest_dumped_row(files))
    problems.raise_all()
    return notes


class Replayer(Trainer):
    """The RL trainer on dumped rollouts: same roles, updates, validation, metrics and checkpoints."""

    def __init__(self, cfg: RlhfConfig, run_dir: RunDir) -> None:
        self.dumps = check_dumps(cfg.replay.rollouts, num_steps=cfg.trainer.total_steps,
                                 rows_per_step=cfg.data.prompts_per_step * cfg.sampling.n)
        hf_config = read_hf_config(cfg.model.path)
        self.vocab_size, self.max_positions = hf_config.vocab_size, hf_config.max_position_embeddings
        self.reward_stats, self._folded = RunningMeanStd(), 0
        super().__init__(cfg, run_dir)
        log.info("replay: %d step dumps from %s (reward_norm=%s, validation engine: %s)", len(self.dumps),
                 cfg.replay.rollouts, cfg.replay.reward_norm, "yes" if cfg.data.val_files else "none")

    def _build_rollout(self, actor):
        """An engine only to validate with; none (and nothing to sync) without validation prompts."""
        if self.cfg.data.val_files:
            return super()._build_rollout(actor)
        return None, SharedWeights(None)

    def run_step(self, step: int) -> StepMetrics:
        self.push_initial_weights()
        raw = {}
        metrics = self.driver.replay(step, lambda: self._batch(step, raw))
        metrics.add_global("replay/raw_score/mean", raw["mean"])
        if self.cfg.replay.reward_norm:
            metrics.add_global("replay/reward_std", self.reward_stats.std)
        return metrics

    def _batch(self, step: int, raw: dict) -> RolloutBatch:
        batch = read_dump(self.dumps[step - 1], self.vocab_size, self.max_positions)
        rollouts_b = batch.sample_index_b != PADDING_UID  # a forked batch's padding rows are no rollouts
        raw["mean"] = float(batch.scores_b[rollouts_b].mean())
        if self.cfg.replay.reward_norm:
            batch = dataclasses.replace(batch, scores_b=self._normalized(batch.scores_b, rollouts_b, step))
        return batch

    def _normalized(self, scores_b: torch.Tensor, rollouts_b: torch.Tensor, step: int) -> torch.Tensor:
        """Scores divided by the running std of every rollout's score replayed through `step` (a resumed replay
        first folds in the dumps its checkpoint had trained on)."""
        while self._folded < step - 1:
            self.reward_stats.update(read_scores(self.dumps[self._folded]))
            self._folded += 1
        self.reward_stats.update(scores_b[rollouts_b])
        self._folded = step
        return self.reward_stats.normalize(scores_b, center=False)
