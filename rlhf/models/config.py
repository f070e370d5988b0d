"""Config section of MoE models, free of torch (the owner: routing.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rlhf.errors import ConfigError


DISPATCHERS = ("allgather", "alltoall")


@dataclass(kw_only=True)
class MoeConfig:
    """Router losses of a trained MoE model (megatron's switch load-balancing loss and ST-MoE z-loss, both
    added to the gradients only) and the token dispatcher that moves tokens between expert-parallel ranks."""

    aux_loss_coeff: float = 0.0  # switch load-balancing loss weight; 0 is off
    z_loss_coeff: float = 0.0  # ST-MoE router z-loss weight; 0 is off
    token_dispatcher: Literal["allgather", "alltoall"] = "allgather"  # how tokens reach expert-parallel ranks

    def __post_init__(self) -> None:
        for name in ("aux_loss_coeff", "z_loss_coeff"):
            if getattr(self, name) < 0:
                raise ConfigError(f"moe.{name}={getattr(self, name)} must be >= 0 (0 switches the loss off)")
        if self.token_dispatcher not in DISPATCHERS:
            raise ConfigError(f"moe.token_dispatcher={self.token_dispatcher!r} is not one of {', '.join(DISPATCHERS)}")

    def build_kwargs(self) -> dict:
        """The `moe_kwargs` of `rlhf.models.builder.build_gpt`."""
        return dict(aux_loss_coeff=self.aux_loss_coeff, z_loss_coeff=self.z_loss_coeff,
                    token_dispatcher=self.token_dispatcher)


REPLAY_MODES = ("none", "r2", "r3")  # MoE routing replay (rlhf.models.routing_replay)


def check_replay_mode(mode: str) -> None:
    if mode not in REPLAY_MODES:
        raise ConfigError(f"algo.routing_replay={mode!r} is not one of {', '.join(REPLAY_MODES)} (r3: replay the "
                          f"rollout's routing in every training forward; r2: the old-logprob forward's in the update)")
