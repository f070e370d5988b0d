"""`algo.distill`: on-policy distillation's config section (teachers, estimator, coefficient) and its enums."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum

from rlhf.algo.registry import parse_kind
from rlhf.config.loader import local_folder
from rlhf.errors import ConfigError


class DistillMode(StrEnum):
    """How the reverse-KL signal meets the task reward's advantage."""

    MIX = "mix"  # the task advantage + coef x signal
    ALONE = "alone"  # coef x signal only (pure on-policy distillation; the task reward is only reported)


class DistillEstimator(StrEnum):
    """What the teacher tells the student at each response position of the student's own samples."""

    SAMPLED = "sampled"  # its logprob of the sampled token: coef x clip(teacher - student) joins the advantage
    TOPK = "topk"  # its top-K ids and logprobs: coef x KL(teacher, student) over those K joins the actor's loss


class DistillKL(StrEnum):
    """The direction of the top-K KL (both over the teacher's K ids, each distribution renormalised on them)."""

    FORWARD = "forward"  # KL(teacher || student): sum_k p_t (log p_t - log p_s), mass-covering
    REVERSE = "reverse"  # KL(student || teacher): sum_k p_s (log p_s - log p_t), mode-seeking


DEFAULT_TOPK = 16  # algo.distill.topk when estimator=topk leaves it unset


@dataclass(kw_only=True)
class DistillConfig:
    """On-policy distillation: frozen teacher(s) score each position of the student's own samples. `estimator:
    sampled` (default): the per-token advantage gains `coef` x (teacher logprob - student logprob), the negative
    reverse-KL estimate on the token the student sampled, clipped to [-clip, clip] (0: no clipping). `estimator:
    topk` (NeMo-RL's): the teacher returns its `topk` most likely ids and their logprobs per position, and the
    actor's loss gains `coef` x the KL between teacher and student renormalised on those ids (direction `kl`),
    on the loss mask, aggregated as the policy loss is; dense supervision: it names the right token, not only how
    wrong the sampled one is. `kl` defaults to forward: the K ids are the teacher's, so they hold most of the
    teacher's mass but not necessarily the student's, and the forward KL's gradient (student - teacher
    probability per id) moves the student's mass onto the teacher's likely tokens even where the student puts
    little; reverse weights each id by the student's own probability, so it barely moves those. `topk` defaults to 16: a sharp teacher's top 16 hold nearly
    all of its mass (`distill/teacher_topk_mass` reports it), at [B, T, 16] tensors whatever the vocabulary. `routes` send a sample to a
    teacher by its data_source; every other data_source goes to `teacher_path`. Teachers share the student's
    tokenizer and sit on mesh.teacher."""

    enable: bool = False  # distil the teachers into the actor (adds the teacher role and mesh.teacher)
    teacher_path: str = ""  # HF folder of the teacher of every data_source `routes` does not name
    routes: dict[str, str] = field(default_factory=dict)  # data_source -> HF folder of its teacher (multi-teacher)
    coef: float = 1.0  # weight of the reverse-KL advantage, in (0, 100]
    mode: DistillMode = DistillMode.MIX  # mix: added to the task advantage (or loss); alone: replaces it
    clip: float = 0.0  # per-token bound on |teacher - student logprob|; 0: none (estimator=sampled)
    estimator: DistillEstimator = DistillEstimator.SAMPLED  # sampled: advantage term; topk: a KL term in the loss
    topk: int | None = None  # estimator=topk: teacher ids per position (unset: 16); at most the vocab size
    kl: DistillKL | None = None  # estimator=topk: forward (unset) = KL(teacher || student) | reverse
    micro_batch_size: int = 8  # sequences per teacher forward on each DP rank
    offload: bool = False  # park the teachers' weights on the host while the rollout engine runs

    def __post_init__(self) -> None:
        self.mode = parse_kind(DistillMode, self.mode, "algo.distill.mode")
        self.estimator = parse_kind(DistillEstimator, self.estimator, "algo.distill.estimator")
        if self.estimator is DistillEstimator.SAMPLED:
            for name in ("topk", "kl"):
                if getattr(self, name) is not None:
                    raise ConfigError(f"algo.distill.{name}={getattr(self, name)} is read only by the top-K "
                                      "estimator: set algo.distill.estimator=topk, or drop algo.distill."
                                      f"{name}")
        else:
            self.topk = DEFAULT_TOPK if self.topk is None else self.topk
            self.kl = parse_kind(DistillKL, DistillKL.FORWARD if self.kl is None else self.kl, "algo.distill.kl")
            if isinstance(self.topk, bool) or not isinstance(self.topk, int) or self.topk < 1:
                raise ConfigError(f"algo.distill.topk={self.topk} must be an integer >= 1 (teacher ids per "
                                  f"position; e.g. {DEFAULT_TOPK})")
        self.teacher_path = local_folder(self.teacher_path)
        self.routes = {source: local_folder(path) for source, path in self.routes.items()}
        if not (math.isfinite(self.coef) and 0.0 < self.coef <= 100.0):
            raise ConfigError(f"algo.distill.coef={self.coef} is out of range: the reverse-KL advantage's weight "
                              "must be in (0, 100]; e.g. 1.0")
        if not (math.isfinite(self.clip) and self.clip >= 0.0):
            raise ConfigError(f"algo.distill.clip={self.clip} must be >= 0 (0: no per-token clipping)")
        if self.micro_batch_size < 1:
            raise ConfigError(f"algo.distill.micro_batch_size={self.micro_batch_size} must be >= 1")
        if self.enable and not (self.teacher_path or self.routes):
            raise ConfigError("algo.distill.enable=true needs a teacher: set algo.distill.teacher_path (or "
                              "algo.distill.routes: {data_source: folder})")

    @property
    def teacher_paths(self) -> list[str]:
        """Every distinct teacher folder, `teacher_path` first (the teachers' order on the teacher mesh)."""
        paths = [self.teacher_path] if self.teacher_path else []
        return list(dict.fromkeys(paths + list(self.routes.values())))
