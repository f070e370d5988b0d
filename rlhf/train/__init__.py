"""The megatron training engine the RL roles (actor, critic) and SFT train with."""
