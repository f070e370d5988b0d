"""Per-token entropy of the policy's categorical distribution, for the entropy bonus and metrics."""

from __future__ import annotations

import torch
from torch import Tensor


def entropy_from_logits(logits_btv: Tensor) -> Tensor:
    """H = logsumexp(z) - sum softmax(z) * z over the (full, unsharded) vocab: [B, T, V] -> [B, T]."""
    logits = logits_btv.float()
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)
