"""Scalar head for critic and reward models: replaces GPTModel's LM head, same call signature."""

from __future__ import annotations

import torch
from torch import nn


class ValueHead(nn.Module):
    """hidden [s, b, h] -> values [s, b, 1]; replicated on every tp rank (its input is replicated too).

    Megatron's GPTModel calls its `output_layer` as `(hidden, weight=..., runtime_gather_output=...)` and
    expects `(output, bias)`, so this module keeps that contract. Initialised from a local generator seeded
    with `seed`, hence identical on every rank.
    """

    def __init__(self, hidden_size: int, *, init_std: float, seed: int, dtype: torch.dtype) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        weight = torch.randn(1, hidden_size, generator=generator, dtype=torch.float32) * init_std
        self.weight = nn.Parameter(weight.to(dtype))

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor | None = None,
                runtime_gather_output: bool | None = None) -> tuple[torch.Tensor, None]:
        return torch.matmul(hidden, self.weight.t()), None
