"""The native engine's routed MLP: megatron's softmax top-k router and its experts, one expert at a time.

Each expert runs once per forward on the rows routed to it (gathered by index), its output scaled by the
token's routing weight and added back in place; experts no row picked are skipped. Routing is computed in
fp32 like megatron's (`moe_router_dtype="fp32"`), so greedy choices match the training forward's. At tp > 1
every rank routes every token and holds its tp shard of each expert: the output is a partial sum the caller
all-reduces over tp, like a dense MLP's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rlhf.platform.linear import PreparedLinear, PreparedSwiGLU
from rlhf.rollout.native.params import MoeParams


class PreparedMoE:
    """y = sum over the top-k experts e of p_e(x) * expert_e(x), for x [..., hidden]."""

    def __init__(self, params: MoeParams, *, pack: bool, batch_hint: int) -> None:
        self.router_weight, self.top_k, self.pre_softmax = params.router_weight, params.top_k, params.pre_softmax
        self.experts = tuple((PreparedSwiGLU(fc1, pack=pack, batch_hint=batch_hint),
                              PreparedLinear(fc2, pack=pack, batch_hint=batch_hint))
                             for fc1, fc2 in zip(params.fc1_weights, params.fc2_weights))

    def route(self, x_nh: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [n, k] in x's dtype, expert ids [n, k]) for tokens `x_nh`."""
        logits = F.linear(x_nh.float(), self.router_weight.float())
        if self.pre_softmax:
            weights, experts = torch.softmax(logits, dim=-1).topk(self.top_k, dim=-1)
        else:
            top_logits, experts = logits.topk(self.top_k, dim=-1)
            weights = torch.softmax(top_logits, dim=-1)
        return weights.to(x_nh.dtype), experts

    def __call__(self, x: torch.Tensor, routing: list[torch.Tensor] | None = None) -> torch.Tensor:
        """`routing`, when given, gets this call's expert ids `[..., k]` (routing replay's record)."""
        x_nh = x.reshape(-1, x.shape[-1])
        weights_nk, experts_nk = self.route(x_nh)
        if routing is not None:
            routing.append(experts_nk.view(*x.shape[:-1], self.top_k))
        out_nh = torch.zeros_like(x_nh)
        for expert, (swiglu, fc2) in enumerate(self.experts):
            rows, slots = (experts_nk == expert).nonzero(as_tuple=True)
            if rows.numel():
                expert_out = fc2(swiglu(x_nh[rows])) * weights_nk[rows, slots, None]
                out_nh.index_add_(0, rows, expert_out)
        return out_nh.view_as(x)
