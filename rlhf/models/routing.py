"""MoE routing: a recorder of the router's choices (the router-loss config, `MoeConfig`, is in rlhf.models.config).

`RoutingRecorder` hooks every megatron router of a model and keeps, per MoE layer (megatron's 1-based global
layer number), the experts each token was sent to (`[tokens, top_k]`, ascending ids) plus the load and the
router entropy. It only observes: the forward is unchanged (routing replay, which changes it, is
`rlhf.models.routing_replay`); scaling megatron's router losses for a whole step patches megatron's routers, so it
is `rlhf.platform.compat.megatron.router_losses_per_token`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from rlhf.platform.compat.megatron import routers


def has_router_losses(model: torch.nn.Module) -> bool:
    """Whether `model` adds a load-balancing or z-loss to its gradients."""
    config = model.config
    return bool(routers(model)) and bool(config.moe_aux_loss_coeff or config.moe_z_loss_coeff)


@dataclass
class LayerRouting:
    """One MoE layer's forwards since the last `clear`: chosen experts, load and summed router entropy."""

    experts_nk: list[torch.Tensor] = field(default_factory=list)
    tokens_per_expert: torch.Tensor | None = None
    entropy_sum: float = 0.0
    num_tokens: int = 0
    aux_loss_sum: float = 0.0  # switch load-balancing loss of each forward times its token count


def _micro_batch_load(router: torch.nn.Module, load: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, int]:
    """The micro-batch's tokens per expert and token count: this rank's, summed over the router's cp group
    (collective there) when context parallelism splits the micro-batch's tokens."""
    cp_group = getattr(router, "cp_group", None)
    if cp_group is None or cp_group.size() == 1:
        return load, num_tokens
    counts = torch.cat([load, torch.tensor([num_tokens], dtype=load.dtype)]).to(router.weight.device)
    torch.distributed.all_reduce(counts, group=cp_group)
    counts = counts.cpu()
    return counts[:-1], int(counts[-1])


class RoutingRecorder:
    """Records every router's choices of `model` while open (`with RoutingRecorder(model) as routing:`);
    `keep_experts=False` keeps only the load and entropy sums (for metrics)."""

    def __init__(self, model: torch.nn.Module, *, keep_experts: bool = True) -> None:
        self.routers, self.keep_experts = routers(model), keep_experts
        self.layers: dict[int, LayerRouting] = {}
        self._handles: list[Any] = []

    def __enter__(self) -> "RoutingRecorder":
        self._handles = [router.register_forward_hook(self._record) for router in self.routers]
        return self

    def __exit__(self, *exc: Any) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def clear(self) -> None:
        self.layers = {}

    @torch.no_grad()
    def _record(self, router: torch.nn.Module, inputs: tuple, outputs: tuple) -> None:
        """Experts of every token; load, entropy and the switch loss over the real (unpadded) tokens only."""
        _, routing_map = outputs
        layer = self.layers.setdefault(router.layer_number, LayerRouting())
        if self.keep_experts:
            layer.experts_nk.append(routing_map.nonzero()[:, 1].view(routing_map.shape[0], -1).cpu())
        hidden = inputs[0].reshape(-1, router.weight.shape[1])
        padding = inputs[1] if len(inputs) > 1 else None
        if padding is not None:  # megatron's padding_mask: True on padding, tokens sequence-major like hidden
            real = ~padding.reshape(-1)
            hidden, routing_map = hidden[real], routing_map[real]
        logprobs = F.log_softmax(F.linear(hidden.float(), router.weight.float()), dim=-1)
        load = routing_map.sum(dim=0).cpu()
        layer.tokens_per_expert = load if layer.tokens_per_expert is None else layer.tokens_per_expert + load
        layer.entropy_sum += float(-(logprobs.exp() * logprobs).sum())
        num_tokens, num_experts = routing_map.shape
        layer.num_tokens += num_tokens
        shared_load, shared_tokens = _micro_batch_load(router, load, num_tokens)
        if shared_tokens:  # this rank's share of the micro-batch's switch loss (times its tokens)
            probs_sum = logprobs.exp().sum(0).cpu()
            layer.aux_loss_sum += num_experts / (router.topk * shared_tokens) * float((probs_sum * shared_load).sum())

    def topk_experts(self) -> dict[int, torch.Tensor]:
        """Per MoE layer: the experts of every recorded token `[tokens, top_k]`, forwards in call order."""
        return {number: torch.cat(layer.experts_nk) for number, layer in sorted(self.layers.items())}

    def metrics(self, prefix: str = "moe/") -> dict[str, float]:
        """Load (tokens per expert: max, mean, max/mean) and router entropy, averaged over this rank's layers."""
        if not self.layers:
            return {}
        loads = [layer.tokens_per_expert.float() for layer in self.layers.values()]
        return {f"{prefix}tokens_per_expert_max": sum(float(x.max()) for x in loads) / len(loads),
                f"{prefix}tokens_per_expert_mean": sum(float(x.mean()) for x in loads) / len(loads),
                f"{prefix}load_imbalance": sum(float(x.max() / x.mean()) for x in loads) / len(loads),
                f"{prefix}router_entropy": sum(layer.entropy_sum / layer.num_tokens
                                               for layer in self.layers.values()) / len(self.layers)}

    def global_metrics(self, model: torch.nn.Module, group: Any, prefix: str = "moe/") -> dict[str, float]:
        """Routing of the forwards recorded on every rank of `group` (collective; the same on each): per MoE
        layer the busiest expert's share of the routed tokens, and over layers the token-weighted switch
        load-balancing loss (coefficient-free: 1 is perfect balance), mean router entropy and load imbalance."""
        config = model.config
        rows = torch.zeros(config.num_layers, config.num_moe_experts + 3, dtype=torch.float64)
        for number, layer in self.layers.items():
            rows[number - 1, :-3] = layer.tokens_per_expert.double()
            rows[number - 1, -3:] = torch.tensor([layer.entropy_sum, layer.num_tokens, layer.aux_loss_sum])
        torch.distributed.all_reduce(rows, group=group)
        routed = rows[:, -2] > 0  # the MoE layers (every stage's, once each)
        if not bool(routed.any()):
            return {}
        numbers, rows = routed.nonzero().squeeze(1) + 1, rows[routed]
        loads, tokens = rows[:, :-3], rows[:, -2]
        metrics = {f"{prefix}max_load_fraction/layer_{int(number)}": float(row.max() / row.sum())
                   for number, row in zip(numbers.tolist(), loads)}
        metrics[f"{prefix}aux_loss"] = float((rows[:, -1] / tokens).mean())
        metrics[f"{prefix}router_entropy"] = float((rows[:, -3] / tokens).mean())
        metrics[f"{prefix}load_imbalance"] = float((loads.max(dim=1).values / loads.mean(dim=1)).mean())
        return metrics
