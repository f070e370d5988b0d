"""The root config: one section per owner, each section defined (with its defaults) next to its owner."""

from __future__ import annotations

from dataclasses import dataclass, field

from rlhf.agents.config import MultiTurnConfig
from rlhf.data.config import DataConfig
from rlhf.models.config import LoraConfig
from rlhf.ops.config import AlertsConfig, MetricsConfig
from rlhf.parallel.config import CommConfig, DistConfig, MeshConfig
from rlhf.rewards.config import RewardConfig
from rlhf.rollout.config import RolloutConfig
from rlhf.run_config import CheckpointConfig, RunConfig
from rlhf.orchestration.config import ReplayConfig, SftConfig, TrainerConfig
from rlhf.stages.config import AlgoConfig, ModelConfig, RefConfig, SamplingConfig, UpdateConfig


@dataclass(kw_only=True)
class RlhfConfig:
    run: RunConfig = field(default_factory=RunConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    multiturn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    actor: UpdateConfig = field(default_factory=UpdateConfig)
    critic: UpdateConfig = field(default_factory=UpdateConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    sft: SftConfig = field(default_factory=SftConfig)
    replay: ReplayConfig = field(default_factory=ReplayConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    alerts: AlertsConfig = field(default_factory=AlertsConfig)
