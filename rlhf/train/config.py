"""Optimizer, LR schedule, clipping and non-finite policy of one trained role, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass

from rlhf.errors import ConfigError

DECAY_STYLES = ("constant", "linear", "cosine")
NAN_POLICIES = ("skip", "abort")
AUTOCASTS = ("none", "bfloat16")


@dataclass(kw_only=True)
class OptimConfig:
    """AdamW + warmup/decay LR schedule. `total_steps=0` means the trainer supplies the step count."""

    lr: float = 1e-6  # peak learning rate (AdamW)
    min_lr: float = 0.0  # learning rate at the end of the decay
    weight_decay: float = 0.01  # AdamW weight decay
    betas: tuple[float, float] = (0.9, 0.999)  # AdamW betas
    eps: float = 1e-8  # AdamW epsilon
    warmup_steps: int = 0  # linear warmup steps (optimizer steps)
    decay_style: str = "constant"  # learning-rate decay after warmup
    total_steps: int = 0  # schedule length in optimizer steps; 0: the trainer's count
    clip_grad: float = 1.0  # global gradient-norm clip; 0 is off
    nan_policy: str = "skip"  # a non-finite gradient: skip the step or abort the run
    use_distributed_optimizer: bool = False  # shard optimizer state over DP ranks (megatron's distributed optimizer)
    offload: bool = False  # move params, grads and optimizer state to the host outside this role's phase
    autocast: str = "none"  # bfloat16: the model's matmuls in bf16 autocast (fp32 weights, grads, Adam, loss)

    def __post_init__(self) -> None:
        self.betas = tuple(self.betas)
        if not self.lr > 0:
            raise ConfigError(f"optim.lr={self.lr} must be > 0")
        if not 0 <= self.min_lr <= self.lr:
            raise ConfigError(f"optim.min_lr={self.min_lr} must be in [0, optim.lr={self.lr}]")
        if self.weight_decay < 0:
            raise ConfigError(f"optim.weight_decay={self.weight_decay} must be >= 0")
        if len(self.betas) != 2 or not all(0 <= beta < 1 for beta in self.betas):
            raise ConfigError(f"optim.betas={list(self.betas)} must be two numbers in [0, 1)")
        if not self.eps > 0:
            raise ConfigError(f"optim.eps={self.eps} must be > 0")
        if self.warmup_steps < 0:
            raise ConfigError(f"optim.warmup_steps={self.warmup_steps} must be >= 0")
        if self.decay_style not in DECAY_STYLES:
            raise ConfigError(f"optim.decay_style={self.decay_style!r} is not one of {', '.join(DECAY_STYLES)}")
        if self.total_steps < 0:
            raise ConfigError(f"optim.total_steps={self.total_steps} must be >= 0 (0: the trainer's step count)")
        if self.total_steps and self.warmup_steps >= self.total_steps:
            raise ConfigError(f"optim.warmup_steps={self.warmup_steps} must be < optim.total_steps="
                              f"{self.total_steps}")
        if self.clip_grad < 0:
            raise ConfigError(f"optim.clip_grad={self.clip_grad} must be >= 0 (0 disables clipping)")
        if self.autocast not in AUTOCASTS:
            raise ConfigError(f"optim.autocast={self.autocast!r} is not one of {', '.join(AUTOCASTS)}")
        if self.nan_policy not in NAN_POLICIES:
            raise ConfigError(f"optim.nan_policy={self.nan_policy!r} is not one of {', '.join(NAN_POLICIES)}")

    def resolved_total_steps(self, trainer_total_steps: int | None) -> int:
        """The schedule length: `total_steps`, else the trainer's count (one of them must be set)."""
        total = self.total_steps or (trainer_total_steps or 0)
        if total <= 0:
            raise ConfigError("optim.total_steps=0 and the trainer gave no step count; set optim.total_steps")
        if self.warmup_steps >= total:
            raise ConfigError(f"optim.warmup_steps={self.warmup_steps} must be < the {total} total steps")
        return total
