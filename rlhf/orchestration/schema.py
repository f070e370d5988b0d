"""The root config: one section per owner, each section defined (with its defaults) next to its owner."""

from __future__ import annotations

import dataclasses
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

    def __post_init__(self) -> None:
        resolve_token_budgets(self)


def longest_row(cfg: RlhfConfig) -> tuple[int, str]:
    """(tokens, where that comes from) of the longest row a step can have: the prompt limit plus the response
    limit, or with multi-turn rollouts the row's token budget (prompt + every response and observation token)."""
    if cfg.multiturn.enable:
        budget = cfg.multiturn.limits.token_budget
        return budget, f"multiturn.limits.token_budget={budget}"
    return (cfg.data.max_prompt_length + cfg.sampling.max_new_tokens,
            f"data.max_prompt_length={cfg.data.max_prompt_length} + "
            f"sampling.max_new_tokens={cfg.sampling.max_new_tokens}")


def resolve_token_budgets(cfg: RlhfConfig) -> None:
    """Every packing budget left at `auto` becomes the role's micro_batch_size x `longest_row` (a packed
    micro-batch then never holds more tokens than a row-count one could), so every reader sees an int. The
    reference's forward-only passes take at least the actor's forward-only budget: a forward without backward
    holds less than the actor's update of as many tokens, so what the actor fits the reference fits."""
    longest, _ = longest_row(cfg)
    for role in ("actor", "critic", "ref"):
        section = getattr(cfg, role)
        if section.max_tokens_per_microbatch == "auto":
            budget = section.micro_batch_size * longest
            if role == "ref":
                budget = max(budget, cfg.actor.forward_tokens_per_microbatch)
            setattr(cfg, role, dataclasses.replace(section, max_tokens_per_microbatch=budget))
    if cfg.reward.model_max_tokens_per_microbatch == "auto":
        cfg.reward = dataclasses.replace(cfg.reward, model_max_tokens_per_microbatch=cfg.reward.model_micro_batch_size
                                         * longest)
