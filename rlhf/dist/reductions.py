"""rlhf's own many-small-tensor reductions, each a few bucketed collectives instead of one per tensor.

Metrics (dozens of scalars per step) and sequence-parallel grads (norm weights/biases replicated across TP
ranks, whose grads must be summed over the TP group) both go through `rlhf.dist.collectives.all_reduce`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Literal

import torch
import torch.distributed as dist

from rlhf.dist.collectives import Strategy, all_reduce
from rlhf.errors import ConfigError

MetricReduce = Literal["mean", "sum", "max", "min"]
_METRIC_OPS = {"mean": "avg", "sum": "sum", "max": "max", "min": "min"}


def reduce_metrics(values: Mapping[str, float | torch.Tensor],
                   reduce: MetricReduce | Mapping[str, MetricReduce] = "mean", *,
                   group: dist.ProcessGroup | None = None, strategy: Strategy = "bucket",
                   min_bucket_mb: float = 1.0, verify: bool = False,
                   timeout_s: float | None = None) -> dict[str, float]:
    """Reduce scalar metrics across `group` in float64 with one collective per reduction kind.

    `reduce` is one kind for all metrics or a kind per metric name. Every kind's collective is issued
    on every rank (even when empty), so ranks whose metric sets differ fail the `verify` check, not hang.
    """
    kinds = {name: reduce if isinstance(reduce, str) else reduce.get(name) for name in values}
    for name, kind in kinds.items():
        if kind not in _METRIC_OPS:
            raise ConfigError(f"metric {name!r} reduce={kind!r} is not one of {', '.join(_METRIC_OPS)}")
    reduced: dict[str, float] = {}
    for kind, op in _METRIC_OPS.items():
        scalars = {name: torch.as_tensor(value, dtype=torch.float64).detach().reshape(())
                   for name, value in values.items() if kinds[name] == kind}
        all_reduce(scalars, op=op, group=group, strategy=strategy, min_bucket_mb=min_bucket_mb,
                   verify=verify, timeout_s=timeout_s, name=f"metrics/{kind}")
        reduced.update({name: scalar.item() for name, scalar in scalars.items()})
    return {name: reduced[name] for name in values}


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
