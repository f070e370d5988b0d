"""Per-step traffic on 4 gloo ranks: the cross-mesh batch exchange and the metric reduction, pickled objects
(what rlhf did before, and what `all_gather_object` stacks do) vs rlhf's tensor collectives, side by side.

Exchange: a GRPO step's RolloutBatch (64 rollouts x 256 response tokens, 512-token sequences) from the 2 DP
contributors of a tp2 x dp2 layout to every rank. Metrics: 120 metrics per rank, one reported by rank 0 only.
Bytes are what one rank receives; times are the slowest rank's, medians over alternating repeats.
Writes benchmarks/results/exchange.json (summary: pickled / tensor time and bytes).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pickle
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from rlhf.parallel.layout import ParallelLayout
from rlhf.metrics import MetricReducer, StepMetrics
from rlhf.testing.distributed import run_distributed
from rlhf.stages.batch import RolloutBatch
from rlhf.stages.exchange import concat_batches, gather_global_batch, is_contributor

WORLD, LAYOUT = 4, ParallelLayout(tp=2, dp=2)
ROWS, SEQ, RESP, NUM_METRICS = 32, 512, 256, 120  # rows per contributor


def _batch(replica: int) -> RolloutBatch:
    gen = torch.Generator().manual_seed(replica)
    mask = torch.ones(ROWS, RESP, dtype=torch.bool)
    return RolloutBatch(tokens_bs=torch.randint(0, 50_000, (ROWS, SEQ), generator=gen),
                        prompt_lengths_b=torch.full((ROWS,), SEQ - RESP), response_lengths_b=torch.full((ROWS,), RESP),
                        response_mask_bt=mask, loss_mask_bt=mask, group_index_b=torch.arange(ROWS) // 8,
                        sample_index_b=torch.arange(ROWS) // 8, trajectory_index_b=None,
                        rollout_logprobs_bt=-torch.rand(ROWS, RESP, generator=gen),
                        policy_version_bt=torch.zeros(ROWS, RESP, dtype=torch.int32),
                        truncated_b=torch.zeros(ROWS, dtype=torch.bool), scores_b=torch.rand(ROWS, generator=gen),
                        baseline_scores_b=None, reward_components_bk=None, routed_experts_bslk=None,
                        pad_token_id=0)


def _pickled_exchange(local: RolloutBatch | None) -> RolloutBatch:
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, local)
    parts = [part for part in everyone if part is not None]
    return concat_batches(parts, [ROWS // 8] * len(parts))


def _metrics(rank: int) -> StepMetrics:
    metrics = StepMetrics()
    for index in range(NUM_METRICS):
        metrics.add(f"group{index // 10}/metric{index}", rank + index, ("mean", "sum", "max")[index % 3])
    metrics.add_global("training/lr", 1e-6)
    return metrics


def _pickled_metrics(metrics: StepMetrics) -> None:
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, metrics.entries())


def _slowest(seconds: float) -> float:
    value = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return value.item()


def _bench_rank(repeats: int) -> dict:
    torch.set_num_threads(1)
    rank = dist.get_rank()
    local = _batch(LAYOUT.coords(rank).dp_rank) if is_contributor(LAYOUT, rank) else None
    reducer, metrics = MetricReducer(), _metrics(rank)
    cases = {"exchange_pickled": lambda: _pickled_exchange(local),
             "exchange_tensor": lambda: gather_global_batch(local, ROWS // 8, LAYOUT),
             "metrics_pickled": lambda: _pickled_metrics(metrics),
             "metrics_tensor": lambda: reducer.reduce(metrics)}
    times: dict[str, list[float]] = {name: [] for name in cases}
    for repeat in range(repeats + 1):
        for name, case in cases.items():
            dist.barrier()
            start = time.perf_counter()
            case()
            elapsed = _slowest(time.perf_counter() - start)
            if repeat:
                times[name].append(elapsed)
    return {name: statistics.median(values) for name, values in times.items()}


def received_bytes() -> dict[str, int]:
    """Payload bytes one rank receives per call: all_gather_object pads each rank's pickle to the longest and
    every rank gets all of them; the tensor exchange broadcasts each contributor's fields once; the metric
    reduction is two float64 all-reduces of the layout's size (their ring traffic is about twice that)."""
    batches = [_batch(0), _batch(1)]
    pickled = max(len(pickle.dumps(b)) for b in batches)  # all_gather_object pads every rank to the longest
    tensor_bytes = sum(t.numel() * t.element_size() for b in batches for t in vars(b).values()
                       if isinstance(t, torch.Tensor))
    metrics = max(len(pickle.dumps(_metrics(rank).entries())) for rank in range(WORLD))
    layout = NUM_METRICS + 1  # the metric layout: every metric plus rank 0's global one
    return {"exchange_pickled": WORLD * pickled, "exchange_tensor": tensor_bytes,
            "metrics_pickled": WORLD * metrics, "metrics_tensor": 8 * ((1 + 2 * layout) + (2 * layout + 2))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "exchange.json"))
    args = parser.parse_args()
    times = run_distributed(_bench_rank, WORLD, args.repeats, timeout_s=600)[0]
    sizes = received_bytes()
    rows = [{"case": name, "median_s": times[name], "received_bytes_per_rank": sizes[name]} for name in times]
    print(f"{'case':18} {'median ms':>10} {'KiB received/rank':>18}")
    for row in rows:
        print(f"{row['case']:18} {row['median_s'] * 1e3:>10.2f} {row['received_bytes_per_rank'] / 1024:>18.1f}")
    summary = {f"{what}_pickled_over_tensor_time": times[f"{what}_pickled"] / times[f"{what}_tensor"]
               for what in ("exchange", "metrics")}
    summary |= {f"{what}_pickled_over_tensor_bytes": sizes[f"{what}_pickled"] / sizes[f"{what}_tensor"]
                for what in ("exchange", "metrics")}
    print("  ".join(f"{k}={v:.2f}" for k, v in summary.items()))
    result = {"name": "exchange", "date": datetime.date.today().isoformat(),
              "machine": {"cores": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version()},
              "config": {"world": WORLD, "layout": LAYOUT.describe(), "rows_per_contributor": ROWS, "seq": SEQ,
                         "response": RESP, "metrics": NUM_METRICS, "repeats": args.repeats},
              "rows": rows, "summary": summary}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
