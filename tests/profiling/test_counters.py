"""Collective counter and phase memory on a 2-rank gloo world: nested calls count once, bytes are payloads."""

from __future__ import annotations

import torch
import torch.distributed as dist

from rlhf.metrics import StepMetrics
from rlhf.profiling.comm import CollectiveCounter
from rlhf.profiling.phases import PhaseMemory
from rlhf.testing.distributed import run_distributed


def _count() -> dict:
    original = dist.all_reduce
    memory = PhaseMemory()
    counter = CollectiveCounter(memory.current_phase)
    metrics = StepMetrics()
    with memory.active(), counter.active():
        with metrics.timer("step"):
            with metrics.timer("a"):
                dist.all_reduce(torch.ones(10, dtype=torch.float32))
                dist.all_reduce(torch.ones(3, dtype=torch.float64))
            dist.all_gather_object([None, None], {"x": 1})
            with metrics.timer("b"):
                out = torch.empty(8, dtype=torch.int64)
                dist.all_gather_into_tensor(out, torch.ones(4, dtype=torch.int64))
    dist.all_reduce(torch.ones(1))  # after the block: not counted, the function is restored
    return {"rows": counter.rows(), "memory": memory.peak_bytes, "open": memory.open,
            "restored": dist.all_reduce is original}


def test_counts_calls_bytes_and_phases():
    results = run_distributed(_count, 2, timeout_s=60)
    for result in results:
        rows = {(r["phase"], r["op"]): (r["calls"], r["bytes"]) for r in result["rows"]}
        assert rows == {("a", "all_reduce"): (2, 40 + 24), ("step", "all_gather_object"): (1, 0),
                        ("b", "all_gather_into_tensor"): (1, 32)}
        assert set(result["memory"]) == {"step", "a", "b"} and min(result["memory"].values()) > 0
        assert result["open"] == [] and result["restored"]
