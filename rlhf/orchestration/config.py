"""Config sections of the orchestration floor (the loop, SFT, replay), free of torch (the owners: loop.py, sft.py,
replay.py)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from rlhf.errors import ConfigError

LOGGERS = ("console", "jsonl", "tensorboard", "wandb", "mlflow")


ASYNC_MODES = ("off", "one_step_off")


@dataclass(kw_only=True)
class TrainerConfig:
    """The loop: steps, validation cadence, logging. `logger`: where metrics go (`tensorboard=false` drops
    TensorBoard too); wandb and mlflow runs are named `project_name` / `experiment_name` (default: the run's
    name). `val_samples` validation generations per validation go to samples.jsonl and TensorBoard text.
    `dump_rollouts`: every `dump_every`-th step's scored rollouts as rollouts/step_<N>.parquet (`rlhf replay`).
    `plot`: every run ends by drawing `curve.png` in its folder (reward, validation, KL, response length per
    step; needs matplotlib). `async_mode=one_step_off` (split placement): the rollout ranks generate
    `max_staleness` batches ahead of the update (`rlhf.orchestration.async_schedule`); `partial_rollout_tokens` > 0:
    each batch's generation spans a weight push after that many tokens per row."""

    total_steps: int = 10  # RL steps to run (a resumed run continues up to this count)
    val_every: int = 0  # validate every N steps; 0: only before training and at the end
    val_before_train: bool = True  # validate once before the first step
    tensorboard: bool = True  # also write TensorBoard events to <run>/tensorboard
    plot: bool = True  # draw <run>/curve.png at the end (reward, validation, KL, response length; needs matplotlib)
    # metric writers: console, jsonl (metrics.jsonl, samples.jsonl), tensorboard, wandb, mlflow
    logger: list[str] = field(default_factory=lambda: ["console", "jsonl", "tensorboard"])
    project_name: str = "rlhf"  # wandb / mlflow project
    experiment_name: str = ""  # wandb / mlflow run name; empty: the run folder's name
    val_samples: int = 4  # validation generations logged as text per validation (samples.jsonl, TensorBoard)
    dump_rollouts: bool = False  # write scored rollouts to <run>/rollouts/step_<N>.parquet (for rlhf replay)
    dump_every: int = 1  # dump every N-th step
    async_mode: str = "off"  # one_step_off: rollout ranks generate ahead of the update (split placement only)
    max_staleness: int = 1  # batches the rollout ranks run ahead (k-step-off); 1: one-step-off
    partial_rollout_tokens: int = 0  # tokens per row before a weight push lands mid-generation; 0: off

    def __post_init__(self) -> None:
        if self.total_steps < 1:
            raise ConfigError(f"trainer.total_steps={self.total_steps} must be >= 1")
        if self.val_every < 0:
            raise ConfigError(f"trainer.val_every={self.val_every} must be >= 0 (0: only before and after)")
        unknown = [name for name in self.logger if name not in LOGGERS]
        if unknown:
            raise ConfigError(f"trainer.logger={self.logger} has unknown logger(s) {', '.join(map(str, unknown))}; "
                              f"choose from {', '.join(LOGGERS)}")
        if self.val_samples < 0:
            raise ConfigError(f"trainer.val_samples={self.val_samples} must be >= 0 (0: no generations logged)")
        if self.dump_every < 1:
            raise ConfigError(f"trainer.dump_every={self.dump_every} must be >= 1")
        if self.async_mode not in ASYNC_MODES:
            raise ConfigError(f"trainer.async_mode={self.async_mode!r} is not one of {', '.join(ASYNC_MODES)}")
        if self.max_staleness < 1:
            raise ConfigError(f"trainer.max_staleness={self.max_staleness} must be >= 1 (1: one-step-off)")
        if self.partial_rollout_tokens < 0:
            raise ConfigError(f"trainer.partial_rollout_tokens={self.partial_rollout_tokens} must be >= 0 (0: off)")

    @property
    def is_async(self) -> bool:
        return self.async_mode != "off"

    @property
    def loggers(self) -> list[str]:
        """The metric writers in use (`tensorboard=false` drops TensorBoard from the list)."""
        return [name for name in self.logger if name != "tensorboard" or self.tensorboard]


@dataclass(kw_only=True)
class ReplayConfig:
    """`rlhf replay`: `rollouts` is the folder of step dumps to train on (`--rollouts`); `reward_norm` divides
    each step's scores by the running std of every score replayed so far (RunningMeanStd; signs are kept)."""

    rollouts: str = ""  # folder of step dumps (<run>/rollouts of a run with trainer.dump_rollouts); or --rollouts
    reward_norm: bool = False  # divide each step's scores by the running std of all scores replayed so far


@dataclass(kw_only=True)
class SftConfig:
    """`steps` optimizer steps of `batch_size` examples; validation every `val_every`; export to `out_dir`."""

    steps: int = 100  # optimizer steps
    batch_size: int = 64  # examples per optimizer step
    val_every: int = 0  # validate every N steps; 0: only at the end
    out_dir: str = ""  # export the SFT policy as an HF folder here; empty: no export

    def __post_init__(self) -> None:
        self.out_dir = os.path.expanduser(self.out_dir)
        if self.steps < 1 or self.batch_size < 1:
            raise ConfigError(f"sft.steps={self.steps} and sft.batch_size={self.batch_size} must be >= 1")
