"""Routing replay for MoE models (R2/R3): a training forward routes each token to given experts.

Routing travels with the batch as `routed_experts_bslk`: int16 `[rows, seq, moe layers, top_k]`, the experts
each input token was sent to in each routed layer (the model's routed layers in order), `UNKNOWN` where no
routing was recorded (padding, the last token of a rollout, which the engine never feeds back). Each megatron
router gets a `RouterHook` in the slot megatron gives its own `RouterReplay` (`router.router_replay`, asked
for the top-k of every forward): it computes the router's own top-k, records it (R2) and, where a row has
known experts, returns those instead (scores gathered at them, so the router still gets gradients). Tokens
the hook sees with known experts are counted for the agreement metric (own top-k set == given set); with
`record` it keeps the experts each forward used.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Literal

import torch
import torch.distributed as dist

from rlhf.platform.compat.megatron import routers

ROUTING_DTYPE = torch.int16
UNKNOWN = -1
ReplayMode = Literal["none", "r2", "r3"]


def moe_layer_numbers(spec: Any) -> list[int]:
    """Megatron's 1-based global layer numbers of the routed layers: the `l` axis of `routed_experts_bslk`."""
    return [index + 1 for index, routed in enumerate(spec.moe.moe_layers) if routed] if spec.moe else []


@dataclass
class RouterHook:
    """Megatron's `router_replay` interface for one router: top-k replay with a per-token fallback."""

    target_nk: torch.Tensor | None = None  # int64 [tokens, k], UNKNOWN rows route freely
    record: bool = False
    recorded: list[torch.Tensor] = field(default_factory=list)
    agreed: list[torch.Tensor] = field(default_factory=list)  # bool [tokens] per forward, True where own = given
    known: list[torch.Tensor] = field(default_factory=list)

    def get_replay_topk(self, scores: torch.Tensor, topk: int, num_groups: int | None, group_topk: int | None,
                        default_compute_topk: Callable) -> tuple[torch.Tensor, torch.Tensor]:
        probs, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        if self.target_nk is None:
            chosen = own
        else:
            target = self.target_nk.to(own.device)
            known_n = target[:, 0] != UNKNOWN
            self.known.append(known_n.cpu())
            self.agreed.append(((own.sort(dim=1).values == target.sort(dim=1).values).all(dim=1) & known_n).cpu())
            chosen = torch.where(known_n[:, None], target, own)
            probs = scores.gather(1, chosen)
        if self.record:  # what this forward used
            self.recorded.append(chosen.detach().to(ROUTING_DTYPE).cpu())
        return probs, chosen


class RoutingReplay:
    """The hooks of every router of one model chunk, fed per micro-batch by `begin` (see module docstring)."""

    def __init__(self, model: torch.nn.Module) -> None:
        numbers = moe_layer_numbers(model.rlhf_spec)
        self.hooks: dict[int, RouterHook] = {}
        self.index = {number: i for i, number in enumerate(numbers)}
        self.num_layers = len(numbers)
        self.top_k = model.config.moe_router_topk
        self.record = False
        for router in routers(model):
            hook = RouterHook()
            router.router_replay = hook
            self.hooks[router.layer_number] = hook
        self.micro_batches: list[Any] = []  # since `clear`, in forward order

    def begin(self, micro_batch: Any) -> None:
        """Before a forward of `micro_batch`: its `routed_experts_bslk` (if any) become every router's targets
        (megatron's tokens are sequence-major: token s * batch + b)."""
        routed = getattr(micro_batch, "routed_experts_bslk", None)
        batch, seq = micro_batch.tokens_bs.shape
        self.micro_batches.append(micro_batch)
        if routed is not None and routed.shape[1] < seq:
            pad = routed.new_full((batch, seq - routed.shape[1], *routed.shape[2:]), UNKNOWN)
            routed = torch.cat([routed, pad], dim=1)
        for number, hook in self.hooks.items():
            hook.record = self.record
            hook.target_nk = (None if routed is None else
                              routed[:, :seq, self.index[number]].transpose(0, 1).reshape(-1, self.top_k).long())

    def clear(self) -> None:
        for hook in self.hooks.values():
            hook.target_nk, hook.recorded, hook.agreed, hook.known = None, [], [], []
        self.micro_batches = []

    def last_recorded_bslk(self, cp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
        """The experts the last forward used per routed layer `[b, s, L, k]` (recorded with `record=True`); a
        packed micro-batch's (`rlhf.models.packing`) in its rows' layout, UNKNOWN on padding, its cp ranks'
        shares gathered over `cp_group` (collective there)."""
        micro_batch = self.micro_batches[-1]
        batch, seq = micro_batch.tokens_bs.shape
        routed = torch.full((batch, seq, self.num_layers, self.top_k), UNKNOWN, dtype=ROUTING_DTYPE)
        for number, hook in self.hooks.items():
            routed[:, :, self.index[number]] = hook.recorded[-1].view(seq, batch, -1).transpose(0, 1)
        if not hasattr(micro_batch, "unpack"):
            return routed
        if cp_group is not None:  # gloo gathers no int16
            routed = micro_batch.gather_cp(routed.to(torch.int32), cp_group).to(ROUTING_DTYPE)
        return micro_batch.unpack(routed, fill=UNKNOWN)

    def agreement(self, group: dist.ProcessGroup) -> dict[str, float]:
        """Over every forward since `clear` on all ranks of `group`: the fraction of (token, layer) routing
        decisions and of tokens (all this stage's layers) where the router's own top-k set is the given one."""
        counts = torch.zeros(4, dtype=torch.float64)
        if self.hooks:
            layers = list(self.hooks.values())
            for forward in range(len(layers[0].known)):
                known_n = layers[0].known[forward]
                agreed_ln = torch.stack([hook.agreed[forward] for hook in layers])
                counts += torch.tensor([float(agreed_ln.sum()), float(known_n.sum()) * len(layers),
                                        float(agreed_ln.all(dim=0).sum()), float(known_n.sum())], dtype=torch.float64)
        dist.all_reduce(counts, group=group)
        if counts[1] == 0:
            return {}
        return {"router_agreement": float(counts[0] / counts[1]),
                "router_agreement_all_layers": float(counts[2] / counts[3])}
