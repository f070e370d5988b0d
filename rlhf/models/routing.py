"""MoE routing: a recorder of the router's choices (the router-loss config, `MoeConfig`, is in rlhf.models.config).

`RoutingRecorder` hooks every megatron router of a model and keeps, per MoE layer (megatron's 1-based global
layer number), the experts each token was sent to (`[tokens, top_k]`, ascending ids) plus the load and the
router entropy. It only observes: the forward is unchanged. Its records are the hook routing replay builds on
(megatron's own `RouterReplay`, switched on by `moe_enable_routing_replay`, replays such per-layer top-k ids).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F


@dataclass
class LayerRouting:
    """One MoE layer's forwards since the last `clear`: chosen experts, load and summed router entropy."""

    experts_nk: list[torch.Tensor] = field(default_factory=list)
    tokens_per_expert: torch.Tensor | None = None
    entropy_sum: float = 0.0
    num_tokens: int = 0


class RoutingRecorder:
    """Records every router's choices of `model` while open (`with RoutingRecorder(model) as routing:`)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.routers = [m for m in model.modules() if type(m).__name__ == "TopKRouter"]
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
        hidden = inputs[0].reshape(-1, router.weight.shape[1])
        _, routing_map = outputs
        logprobs = F.log_softmax(F.linear(hidden.float(), router.weight.float()), dim=-1)
        layer = self.layers.setdefault(router.layer_number, LayerRouting())
        layer.experts_nk.append(routing_map.nonzero()[:, 1].view(routing_map.shape[0], -1).cpu())
        load = routing_map.sum(dim=0).cpu()
        layer.tokens_per_expert = load if layer.tokens_per_expert is None else layer.tokens_per_expert + load
        layer.entropy_sum += float(-(logprobs.exp() * logprobs).sum())
        layer.num_tokens += routing_map.shape[0]

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
