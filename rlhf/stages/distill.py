"""On-policy distillation's stage of the training side: frozen teacher(s) on the teacher mesh score each token the
student sampled (fused LM head: a logprob per sampled token, never `[T, vocab]` logits), each sample routed to its
teacher by its data_source (`algo.distill.routes`), and the per-token reverse-KL advantage (`rlhf.algo.distill`)
mixed with the task reward's advantage or alone (`algo.distill.mode`)."""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from typing import Any

import torch

from rlhf.algo.distill import reverse_kl_advantages
from rlhf.data.records import PromptRecord
from rlhf.errors import ConfigError
from rlhf.metrics import StepMetrics
from rlhf.parallel.meshes import RoleMesh
from rlhf.stages.batch import PADDING_UID, RolloutBatch
from rlhf.stages.config import DistillConfig, DistillMode
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

    def teacher_logprobs(self, batch: RolloutBatch) -> torch.Tensor:
        """fp32 `[B, T]`: each row's sampled tokens scored by its teacher (collective over the world: every
        teacher runs on the rows routed to it, padded by repeating one to a multiple of the mesh's dp)."""
        if len(self.teachers) == 1:
            return self.teachers[0].logprobs(batch)
        teacher_b = self.teacher_of_sample[batch.sample_index_b.clamp(min=0)]
        teacher_b[batch.sample_index_b == PADDING_UID] = -1  # a padding row: no teacher, nothing to train on
        logprobs_bt = torch.zeros(batch.response_mask_bt.shape)
        for number, teacher in enumerate(self.teachers):
            rows = (teacher_b == number).nonzero().squeeze(1)
            if rows.numel():
                padded = torch.cat([rows, rows[:1].expand(-rows.numel() % teacher.dp_size)])
                logprobs_bt[rows] = teacher.logprobs(batch.select(padded))[:rows.numel()].float()
        return logprobs_bt

    def advantages(self, batch: RolloutBatch, student_logprobs_bt: torch.Tensor, task_advantages_bt: torch.Tensor,
                   metrics: StepMetrics) -> tuple[torch.Tensor, torch.Tensor]:
        """(teacher logprobs, the step's advantages): the task advantage (mode mix; alone: none) + coef x the
        clipped teacher - student logprob on the sampled tokens of the loss mask."""
        with metrics.timer("teacher"):
            teacher_bt = self.teacher_logprobs(batch)
        signal = reverse_kl_advantages(teacher_bt, student_logprobs_bt, batch.loss_mask_bt & batch.response_mask_bt,
                                       coef=self.config.coef, clip=self.config.clip)
        for name, value in signal.metrics.items():
            metrics.add_global(name, value)
        if self.config.mode is DistillMode.ALONE:
            return teacher_bt, signal.advantages_bt
        return teacher_bt, task_advantages_bt + signal.advantages_bt
