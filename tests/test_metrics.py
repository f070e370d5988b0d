"""`MetricReducer` on 3 gloo ranks: exact mean/sum/max/min over the ranks that report each metric, two
all-reduces per step once the layout is agreed, re-agreement when a rank reports a new metric, and a clear
error when ranks disagree on a metric's reduction."""

from __future__ import annotations

import math

import pytest
import torch.distributed as dist

from rlhf.metrics import MetricReducer, StepMetrics
from rlhf.testing.distributed import DistributedTestError, run_distributed


def _step(rank: int, step: int) -> StepMetrics:
    metrics = StepMetrics()
    metrics.add("loss", rank + step, "mean")  # every rank
    if rank < 2:
        metrics.add("actor/pg_loss", 10 * (rank + 1) + step, "sum")  # the two "contributors"
    metrics.add("timing_s/gen", [0.5, 2.0, 1.0][rank] * step, "max")
    metrics.add("response_length/min", [7.0, 3.0, 5.0][rank], "min")
    metrics.add_global("training/lr", 0.1 * step)  # rank 0 only
    if step == 3 and rank == 2:
        metrics.add("late/new", 42.0, "sum")
    return metrics


def _reduce_steps() -> dict:
    rank = dist.get_rank()
    calls = {"all_reduce": 0}
    real_all_reduce = dist.all_reduce

    def counting_all_reduce(*args, **kwargs):
        calls["all_reduce"] += 1
        return real_all_reduce(*args, **kwargs)

    dist.all_reduce = counting_all_reduce
    reducer = MetricReducer(verify=True)
    results, counts = [], []
    for step in (1, 2, 3):
        before = dict(calls)
        results.append(reducer.reduce(_step(rank, step)))
        counts.append({k: calls[k] - before[k] for k in calls})
    dist.all_reduce = real_all_reduce
    nan_step = StepMetrics()  # a NaN on one rank survives max/min reductions (alerts read it)
    nan_step.add_global("critic/score/mean", math.nan)
    nan_step.add("actor/grad_norm", math.nan if rank == 1 else 1.0, "max")
    nan_step.add("response_length/min", math.nan if rank == 2 else 3.0, "min")
    nan_step.add("timing_s/gen", 1.0 + rank, "max")
    nans = {name: repr(value) for name, value in MetricReducer().reduce(nan_step).items()}
    return {"results": results, "relayouts": reducer.num_relayouts, "counts": counts, "nans": nans}


def test_reduced_values_and_collectives_per_step():
    outs = run_distributed(_reduce_steps, 3, timeout_s=120)
    assert all(out["results"] == outs[0]["results"] for out in outs)
    step1, step2, step3 = outs[0]["results"]
    assert step1 == {"actor/pg_loss": 32.0, "loss": 2.0, "response_length/min": 3.0, "timing_s/gen": 2.0,
                     "training/lr": 0.1}
    assert step2 == {"actor/pg_loss": 34.0, "loss": 3.0, "response_length/min": 3.0, "timing_s/gen": 4.0,
                     "training/lr": 0.2}
    assert step3["late/new"] == 42.0 and step3["loss"] == 4.0
    assert outs[0]["relayouts"] == 2  # step 1 (empty layout) and step 3 (a new metric on rank 2)
    assert all(out["nans"] == {"actor/grad_norm": "nan", "critic/score/mean": "nan", "response_length/min": "nan",
                               "timing_s/gen": "3.0"} for out in outs)
    counts = outs[0]["counts"]
    # steady state: one bucketed SUM and one MAX all-reduce; with comm.verify each is preceded by a fingerprint
    # exchange (which is what turns a layout mismatch into an error instead of a hang)
    assert counts[1]["all_reduce"] == 2, counts


def _conflict() -> None:
    metrics = StepMetrics()
    metrics.add("actor/entropy", 1.0, "mean" if dist.get_rank() == 0 else "sum")
    MetricReducer().reduce(metrics)


def test_a_metric_reduced_two_ways_is_named():
    with pytest.raises(DistributedTestError, match=r"metric 'actor/entropy' is reduced as mean on one rank, "
                                                   r"sum on another"):
        run_distributed(_conflict, 2, timeout_s=120)
