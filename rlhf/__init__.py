"""rlhf: a Megatron-based SPMD RL post-training framework (PPO, GRPO, RLOO, REINFORCE++, ReMax)."""

__version__ = "0.1.0"
