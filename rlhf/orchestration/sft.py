"""`rlhf sft`: supervised fine-tuning on (prompt, ground-truth answer) records as a run of the RL trainer, then HF
export. Used to warm-start a policy before RL (the CPU demo).

    step k:  train(load(k)) ──► sync          the replay ordering (`StepDriver.replay`)
      load:  the k-th global batch of records ──► prompt + answer + EOS rows, the answer (+ EOS) the response
      train: the actor's token-mean NLL on the response tokens (`PolicyRole.sft_update`; no scoring, no critic)

Preflight, the watchdog, checkpoints, `checkpoint.resume: auto`, metrics, alerts and validation are the
Trainer's. The loss is normalised by the global token count, so it is the same for any DP size and micro-batching.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch

from rlhf.algo.config import AdvantageConfig, AdvantageKind
from rlhf.data.loader import load_prompts
from rlhf.data.records import PromptRecord
from rlhf.data.tokenize import TokenizedPrompts
from rlhf.errors import ConfigError
from rlhf.metrics import StepMetrics
from rlhf.models.hf_export import export_hf
from rlhf.orchestration.checks import load_tokenizer
from rlhf.orchestration.config import SftConfig
from rlhf.orchestration.loop import Trainer
from rlhf.orchestration.preflight import plan_layouts, preflight
from rlhf.orchestration.schema import RlhfConfig
from rlhf.orchestration.train_side import TrainSide
from rlhf.run_dir import RunDir, get_logger
from rlhf.stages.batch import RolloutBatch, ScoredBatch
from rlhf.stages.config import AlgoConfig

log = get_logger("sft")


def sft_run_config(cfg: RlhfConfig) -> RlhfConfig:
    """The trainer config of an SFT run: the actor on `mesh.actor` and a colocated rollout engine in its layout
    (validation), no reference, critic or reward model (an RL config's placement, roles, rollout layout and algo
    do not apply), `sft.batch_size` records per step, `sft.steps` steps, one sample a row."""
    sft = cfg.sft
    return dataclasses.replace(
        cfg, mesh=dataclasses.replace(cfg.mesh, placement="colocated", roles=None,  # engines do not split sequences
                                      rollout=dataclasses.replace(cfg.mesh.actor, cp=1)),
        algo=AlgoConfig(advantage=AdvantageConfig(kind=AdvantageKind.REINFORCE_PP)),
        reward=dataclasses.replace(cfg.reward, model_path=""),
        data=dataclasses.replace(cfg.data, prompts_per_step=sft.batch_size),
        sampling=dataclasses.replace(cfg.sampling, n=1, temperature=1.0),
        trainer=dataclasses.replace(cfg.trainer, total_steps=sft.steps, val_every=sft.val_every,
                                    val_before_train=False, dump_rollouts=False, async_mode="off"))


def sft_preflight(cfg: RlhfConfig, world_size: int) -> list[str]:
    """The SFT batch split (named by its `sft.` keys) and a new export folder, then every check of `rlhf train` on
    the SFT run's config."""
    run = sft_run_config(cfg)
    actor = cfg.actor
    dp = plan_layouts(run, world_size)["actor"].dp
    packed = bool(actor.max_tokens_per_microbatch)  # packed micro-batches take any rows per rank
    if cfg.sft.batch_size % (actor.mini_batches * dp * (1 if packed else actor.micro_batch_size)):
        micro = "" if packed else f" x actor.micro_batch_size={actor.micro_batch_size}"
        raise ConfigError(f"sft.batch_size={cfg.sft.batch_size} must be a multiple of actor.mini_batches="
                          f"{actor.mini_batches} x dp={dp}{micro}")
    if cfg.sft.out_dir and os.path.lexists(cfg.sft.out_dir):
        raise ConfigError(f"sft.out_dir={cfg.sft.out_dir} already exists; the SFT policy is exported to a new "
                          "folder: choose another or remove it")
    notes = preflight(run, world_size, batch_key=SftTrainer.batch_key)
    check_sft_rows(run)
    return notes


def check_sft_rows(cfg: RlhfConfig) -> None:
    """A packing actor's budget holds the longest SFT row, prompt + answer + EOS. Answers have no length limit of
    their own (the RL rows' is sampling.max_new_tokens), so the rows of data.train_files are measured."""
    budget = cfg.actor.max_tokens_per_microbatch
    if not budget:
        return
    tokenizer = load_tokenizer(cfg.model.path)
    prompts = load_prompts(cfg.data.train_files, tokenizer, cfg.data)
    longest = max(len(ids) + len(answer_ids(tokenizer, record)) for ids, record in zip(prompts.token_ids,
                                                                                       prompts.records))
    if longest > budget:
        raise ConfigError(f"actor.max_tokens_per_microbatch={budget} is smaller than the longest SFT row of "
                          f"data.train_files, {longest} tokens (prompt + answer + EOS; auto sizes the budget for "
                          f"data.max_prompt_length + sampling.max_new_tokens); raise actor.max_tokens_per_microbatch "
                          f"to at least {longest}, or set it to 0 (row counts)")


def answer_ids(tokenizer: Any, record: PromptRecord) -> list[int]:
    """The token ids an SFT row trains on after its prompt: the ground-truth answer and EOS."""
    return list(tokenizer.encode(record.ground_truth, add_special_tokens=False)) + [tokenizer.eos_token_id]


def sft_batch(prompts: TokenizedPrompts, rows: list[int], tokenizer: Any, pad_token_id: int) -> RolloutBatch:
    """Right-padded prompt + answer + EOS rows; the answer tokens are the response, all of them trained on.
    Nothing sampled them: their rollout logprobs are 0 and their policy version 0 (no stage reads either)."""
    answers = [answer_ids(tokenizer, prompts.records[i]) for i in rows]
    seqs = [prompts.token_ids[i] + answer for i, answer in zip(rows, answers)]
    width, resp_width = max(len(s) for s in seqs), max(len(a) for a in answers)
    tokens_bs = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    for row, seq in enumerate(seqs):
        tokens_bs[row, :len(seq)] = torch.tensor(seq)
    lengths_b = torch.tensor([len(a) for a in answers])
    mask_bt = torch.arange(resp_width)[None, :] < lengths_b[:, None]
    num_rows = len(rows)
    return RolloutBatch(tokens_bs=tokens_bs, prompt_lengths_b=torch.tensor([len(prompts.token_ids[i]) for i in rows]),
                        response_lengths_b=lengths_b, response_mask_bt=mask_bt, pad_token_id=pad_token_id,
                        group_index_b=torch.arange(num_rows),
                        sample_index_b=torch.tensor([prompts.records[i].index for i in rows]), trajectory_index_b=None,
                        loss_mask_bt=mask_bt, rollout_logprobs_bt=torch.zeros(mask_bt.shape),
                        policy_version_bt=torch.zeros(mask_bt.shape, dtype=torch.int32),
                        truncated_b=torch.zeros(num_rows, dtype=torch.bool), scores_b=None, baseline_scores_b=None,
                        reward_components_bk=None, routed_experts_bslk=None)


class SftSide(TrainSide):
    """The training side of an SFT step: the actor's supervised update on the batch's response tokens."""

    def train(self, batch: RolloutBatch, metrics: StepMetrics, step: int) -> ScoredBatch:
        """The update; the batch comes back scored with no reward (zero token rewards and advantages)."""
        with self.memory.training(metrics):
            with metrics.timer("update_actor"):
                metrics.update_from_shards(self.actor.sft_update(batch))
        zeros_bt = torch.zeros(batch.response_mask_bt.shape)
        return ScoredBatch.of(batch, old_logprobs_bt=None, ref_logprobs_bt=None, values_bt=None,
                              token_rewards_bt=zeros_bt, advantages_bt=zeros_bt, returns_bt=None, is_weights_bt=None,
                              teacher_logprobs_bt=None, cov_selected_bt=None)

    def report(self, metrics: StepMetrics, batch: ScoredBatch, actor_version: int) -> None:
        """How many answer tokens the step trained on, and their mean length."""
        metrics.add_global("sft/num_tokens", float(batch.response_lengths_b.sum()))
        metrics.add_global("response_length/mean", float(batch.response_lengths_b.float().mean()))


class SftTrainer(Trainer):
    """The trainer whose step is the supervised update on the next global batch of (prompt, answer) records."""

    train_side_type = SftSide
    step_name = "sft"
    steps_key = "sft.steps"
    batch_key = "sft.batch_size"

    def _loader_shard(self) -> tuple[int, int]:
        """Every rank holds the whole global batch (the actor's update takes its DP shard of it)."""
        return 0, 1

    def run_step(self, step: int) -> StepMetrics:
        return self.driver.replay(step, self._batch)

    def _batch(self) -> RolloutBatch:
        return sft_batch(self.loader.prompts, self.loader.sampler.next_indices(), self.tokenizer,
                         self.pad_token_id)


def run_sft(cfg: RlhfConfig, sft: SftConfig, run_dir: RunDir) -> dict[str, float]:
    """Train (resuming the run's newest checkpoint), validate (greedy, mean@1), export to `sft.out_dir`;
    returns the last validation metrics."""
    trainer = SftTrainer(sft_run_config(cfg), run_dir)
    history = trainer.fit()
    actor = trainer.train_side.actor
    if sft.out_dir and actor.model is not None:
        export_hf(actor.model, sft.out_dir, tokenizer_dir=cfg.model.path)
        log.info("exported the SFT policy to %s", sft.out_dir)
    return {key: value for row in history[-1:] for key, value in row.items() if key.startswith("val/")}
