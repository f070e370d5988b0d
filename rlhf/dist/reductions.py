"""Grad reductions over many small tensors, as a few bucketed collectives instead of one per tensor.

Sequence-parallel params (norm weights/biases replicated across TP ranks, each rank seeing a slice of the
sequence) need their grads summed over the TP group; metrics use the same collective in `rlhf.metrics`.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

from rlhf.dist.collectives import Strategy, all_reduce


def reduce_sequence_parallel_grads(named_parameters: Iterable[tuple[str, torch.nn.Parameter]],
                                   tp_group: dist.ProcessGroup | None, *, strategy: Strategy = "bucket",
                                   min_bucket_mb: float = 1.0, verify: bool = False,
                                   timeout_s: float | None = None) -> int:
    """Sum over the TP group the grads of params marked `sequence_parallel` (`main_grad` when present).

    Returns how many grads were reduced. Parameters without a grad are skipped on this rank; `verify`
    catches ranks that disagree about which ones have grads.
    """
    grads = {}
    for name, param in named_parameters:
        grad = getattr(param, "main_grad", None)
        grad = param.grad if grad is None else grad
        if getattr(param, "sequence_parallel", False) and grad is not None:
            grads[name] = grad
    all_reduce(grads, op="sum", group=tp_group, strategy=strategy, min_bucket_mb=min_bucket_mb, verify=verify,
               timeout_s=timeout_s, name="sequence_parallel_grads")
    return len(grads)
