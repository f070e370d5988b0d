"""On-policy distillation's stage of the training side: frozen teacher(s) on the teacher mesh score each token the
student sampled (fused LM head: a logprob per sampled token, never `[T, vocab]` logits), each sample routed to its
teacher by its data_source (`algo.distill.routes`), and the per-token reverse-KL advantage (`rlhf.algo.distill`)
mixed with the task reward's advantage or alone (`algo.distill.mode`). With `estimator: topk` the teachers also
return their top-K ids and logprobs per position (`[B, T, K]`), which the actor's loss reads (`ScoredBatch`)."""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rlhf.algo.distill import reverse_kl_advantages, topk_teacher_metrics
from rlhf.data.records import PromptRecord
from rlhf.errors import ConfigError
from rlhf.metrics import StepMetrics
from rlhf.parallel.meshes import RoleMesh
from rlhf.stages.batch import PADDING_UID, RolloutBatch
from rlhf.stages.distill_config import DistillConfig, DistillEstimator, DistillMode
from rlhf.stages.policy_role import PolicyRole


def route_teachers(config: DistillConfig, records: Sequence[PromptRecord]) -> dict[int, int]:
    """{dataset index: teacher index in `config.teacher_paths`} of every training prompt; a route naming a
    data_source no prompt has, or a prompt no teacher takes, is a one-line ConfigError."""
    sources = sorted({record.data_source for record in records})
    for source in config.routes:
        if source not in sources:
            close = difflib.get_close_matches(source, sources, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"algo.distill.routes names data_source {source!r}, which no training prompt has"
                              f"{hint}; the training data sources are: {', '.join(sources)}")
    index = {path: number for number, path in enumerate(config.teacher_paths)}
    routes = {}
    for record in records:
        path = config.routes.get(record.data_source, config.teacher_path)
        if not path:
            raise ConfigError(f"training prompt {record.index} has data_source {record.data_source!r}, which no "
                              "teacher takes: add it to algo.distill.routes or set algo.distill.teacher_path")
        routes[record.index] = index[path]
    return routes


MAX_FLOAT_ID = 2 ** 24  # the teachers hand their top-K ids back as fp32 (`PolicyRole.logprobs`): exact below this


def check_topk(config: DistillConfig, student_vocab: int, teacher_vocabs: Sequence[tuple[str, int]],
               fused_head: bool) -> None:
    """The top-K estimator's one-line ConfigErrors: K above a vocabulary, a teacher whose vocabulary size is not
    the student's (its ids index the student's head), the unfused head."""
    if config.estimator is not DistillEstimator.TOPK:
        return
    if not fused_head:
        raise ConfigError("algo.distill.estimator=topk scores the teacher's top-K ids through the fused LM head; "
                          "set model.fused_head=true")
    if config.topk > student_vocab:
        raise ConfigError(f"algo.distill.topk={config.topk} is larger than the vocabulary ({student_vocab} tokens, "
                          f"model.path); set algo.distill.topk <= {student_vocab}")
    for key, vocab in teacher_vocabs:
        if vocab != student_vocab or vocab >= MAX_FLOAT_ID:
            raise ConfigError(f"{key} has vocab_size {vocab}, the student {student_vocab}: the top-K estimator "
                              "needs a teacher of the student's vocabulary size (below 2^24); use "
                              "algo.distill.estimator=sampled")


@dataclass(frozen=True)
class DistillScores:
    """The stage's output: the teachers' logprobs of the sampled tokens, the step's advantages, and (estimator
    topk) the teachers' top-K ids (int64) and logprobs (fp32) `[B, T, K]` for the actor's loss."""

    teacher_logprobs_bt: torch.Tensor
    advantages_bt: torch.Tensor
    topk_ids_btk: torch.Tensor | None = None
    topk_logprobs_btk: torch.Tensor | None = None


class DistillStage:
    """The teachers (one PolicyRole each, frozen, on the teacher mesh) and each training prompt's teacher."""

    def __init__(self, config: DistillConfig, mesh: RoleMesh, records: Sequence[PromptRecord],
                 **policy: Any) -> None:
        """`policy`: the PolicyRole settings the actor and ref share (temperature, dtype, gather group, ...)."""
        self.config = config
        policy = policy | {"fused_head": True, "routing_replay": "none"}  # a logprob per token; routes freely
        self.teachers = [PolicyRole("teacher", mesh, path, update=None, total_steps=0,
                                    micro_batch_size=config.micro_batch_size, offload_frozen=config.offload, **policy)
                         for path in config.teacher_paths]
        routes = route_teachers(config, records)
        self.teacher_of_sample = torch.full((max(routes) + 1,), -1, dtype=torch.long)
        self.teacher_of_sample[list(routes)] = torch.tensor(list(routes.values()), dtype=torch.long)

    @property
    def topk(self) -> int:
        return self.config.topk if self.config.estimator is DistillEstimator.TOPK else 0

    def teacher_logprobs(self, batch: RolloutBatch) -> torch.Tensor:
        """fp32 `[B, T]`: each row's sampled tokens scored by its teacher (estimator topk: `[B, T, 1 + 2K]`, then
        its top-K logprobs and ids, `PolicyRole.logprobs`); collective over the world: every teacher runs on the
        rows routed to it, padded by repeating one to a multiple of the mesh's dp."""
        if len(self.teachers) == 1:
            return self.teachers[0].logprobs(batch, topk=self.topk)
        teacher_b = self.teacher_of_sample[batch.sample_index_b.clamp(min=0)]
        teacher_b[batch.sample_index_b == PADDING_UID] = -1  # a padding row: no teacher, nothing to train on
        logprobs_bt = torch.zeros(batch.response_mask_bt.shape + ((1 + 2 * self.topk,) if self.topk else ()))
        for number, teacher in enumerate(self.teachers):
            rows = (teacher_b == number).nonzero().squeeze(1)
            if rows.numel():
                padded = torch.cat([rows, rows[:1].expand(-rows.numel() % teacher.dp_size)])
                logprobs_bt[rows] = teacher.logprobs(batch.select(padded), topk=self.topk)[:rows.numel()].float()
        return logprobs_bt

    def advantages(self, batch: RolloutBatch, student_logprobs_bt: torch.Tensor | None,
                   task_advantages_bt: torch.Tensor, metrics: StepMetrics) -> DistillScores:
        """Sampled: the task advantage (mode mix; alone: none) + coef x the clipped teacher - student logprob on
        the sampled tokens of the loss mask. Top-K: the task advantage (mix) or zero (alone: the KL term is the
        whole loss), and the teachers' top-K for the actor's loss."""
        with metrics.timer("teacher"):
            teacher_bt = self.teacher_logprobs(batch)
        mask_bt = batch.loss_mask_bt & batch.response_mask_bt
        alone = self.config.mode is DistillMode.ALONE
        if self.topk:
            k = self.topk
            teacher_bt, top_logp_btk, ids_btk = teacher_bt[..., 0], teacher_bt[..., 1:1 + k], teacher_bt[..., 1 + k:]
            ids_btk = ids_btk.long() * mask_bt[..., None]
            tokens_bt = batch.tokens_bs.gather(1, batch.response_positions_bt().add(1).clamp(
                max=batch.tokens_bs.shape[1] - 1))
            for name, value in topk_teacher_metrics(teacher_bt, top_logp_btk, ids_btk, tokens_bt, mask_bt).items():
                metrics.add_global(name, value)
            advantages_bt = torch.zeros_like(task_advantages_bt) if alone else task_advantages_bt
            return DistillScores(teacher_bt, advantages_bt, ids_btk, top_logp_btk * mask_bt[..., None])
        signal = reverse_kl_advantages(teacher_bt, student_logprobs_bt, mask_bt, coef=self.config.coef,
                                       clip=self.config.clip)
        for name, value in signal.metrics.items():
            metrics.add_global(name, value)
        if alone:
            return DistillScores(teacher_bt, signal.advantages_bt)
        return DistillScores(teacher_bt, task_advantages_bt + signal.advantages_bt)
