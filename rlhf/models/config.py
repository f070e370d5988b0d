"""Config sections of the model: MoE router losses (owner: routing.py) and LoRA adapters (owner: lora.py); free
of torch."""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any, Literal

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


LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")  # HF q/k/v/o_proj, gate/up/down_proj of dense MLPs
LORA_MOE_TARGETS = ("experts", "router")  # accepted names, not built yet (rlhf.models.lora refuses them)
LORA_SYNCS = ("merged", "adapter")
LORA_DTYPES = ("fp32", "base")


@dataclass(kw_only=True)
class LoraConfig:
    """Low-rank adapters on the actor (PEFT's LoRA: W x + (alpha / rank) B A dropout(x), A random, B zero); off
    unless `enabled`. `sync`: the rollout engine gets the merged weights (any engine) or the adapters only."""

    enabled: bool = False  # off: full fine-tuning
    rank: int = 8  # adapter rank r
    alpha: float = 16.0  # scaling numerator: the adapter's output is scaled by alpha / rank
    dropout: float = 0.0  # dropout on the adapter's input (training forwards only)
    targets: tuple[str, ...] = ("q", "k", "v", "o", "gate", "up", "down")  # which linears get an adapter
    sync: Literal["merged", "adapter"] = "merged"  # what the rollout engine receives each weight sync
    seed: int = 0  # seeds every A's PEFT (kaiming-uniform) init, the same on every layout
    adapter_path: str = ""  # a PEFT adapter folder to start from (its r, alpha and targets must match); empty: init
    dtype: Literal["fp32", "base"] = "fp32"  # the adapters and their optimizer state: fp32 on any base, or the base's
    critic: bool = False  # the critic trains adapters on its frozen base too (its value head stays fully trained)

    def __post_init__(self) -> None:
        self.targets = tuple(self.targets)
        if self.rank <= 0:
            raise ConfigError(f"lora.rank={self.rank} must be > 0 (lora.enabled=false switches LoRA off)")
        if self.alpha <= 0:
            raise ConfigError(f"lora.alpha={self.alpha} must be > 0 (the adapter is scaled by alpha / rank)")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"lora.dropout={self.dropout} must be in [0, 1)")
        if self.dtype not in LORA_DTYPES:
            raise ConfigError(f"lora.dtype={self.dtype!r} is not one of {', '.join(LORA_DTYPES)}")
        if self.sync not in LORA_SYNCS:
            raise ConfigError(f"lora.sync={self.sync!r} is not one of {', '.join(LORA_SYNCS)}")
        if not self.targets:
            raise ConfigError("lora.targets is empty; name at least one of " + ", ".join(LORA_TARGETS))
        for target in self.targets:
            if target not in LORA_TARGETS + LORA_MOE_TARGETS:
                close = difflib.get_close_matches(target, LORA_TARGETS + LORA_MOE_TARGETS, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise ConfigError(f"lora.targets has unknown target {target!r}{hint}; choose from "
                                  f"{', '.join(LORA_TARGETS + LORA_MOE_TARGETS)}")

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def peft_config(self, base_path: str) -> dict[str, Any]:
        """PEFT's `adapter_config.json` for these adapters on `base_path` (targets as HF module names)."""
        return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_path, "r": self.rank,
                "lora_alpha": self.alpha, "lora_dropout": self.dropout, "bias": "none", "fan_in_fan_out": False,
                "target_modules": sorted(f"{target}_proj" for target in self.targets), "inference_mode": True,
                "init_lora_weights": True, "use_rslora": False, "modules_to_save": None}
