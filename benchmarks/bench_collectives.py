"""Many small tensors all-reduced on 4 gloo ranks: per-tensor vs bucketed vs reduce_scatter+all_gather.

Peer: a loop of synchronous `torch.distributed.all_reduce` calls (what most RL stacks do). rlhf: `plain`
(one async collective per tensor), `bucket`, `bucket` with `verify=True`, `rs_ag`. Strategies alternate
within each repeat; a call's time is the slowest rank's; the table shows medians over repeats.
Writes benchmarks/results/collectives.json (summary: plain time / strategy time).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from rlhf.parallel.collectives import all_reduce
from rlhf.testing.distributed import run_distributed

STRATEGIES = ("torch_loop", "plain", "bucket", "bucket_verify", "rs_ag")
MIN_BYTES, MAX_BYTES = 64, 64 * 1024


def make_tensors(num_tensors: int, rank: int) -> list[torch.Tensor]:
    """Bias/norm-like tensors: sizes log-uniform in 64 B..64 KiB, half fp32 and half bf16 (same on every rank)."""
    shapes_gen = torch.Generator().manual_seed(num_tensors)
    log_lo, log_hi = torch.log2(torch.tensor(MIN_BYTES)), torch.log2(torch.tensor(MAX_BYTES))
    tensors = []
    for index in range(num_tensors):
        dtype = torch.float32 if index % 2 == 0 else torch.bfloat16
        num_bytes = 2 ** (log_lo + (log_hi - log_lo) * torch.rand((), generator=shapes_gen))
        tensors.append(torch.full((max(1, int(num_bytes) // dtype.itemsize),), float(rank + 1), dtype=dtype))
    return tensors


def _run_strategy(strategy: str, tensors: list[torch.Tensor], min_bucket_mb: float) -> None:
    if strategy == "torch_loop":
        for tensor in tensors:
            dist.all_reduce(tensor)
    elif strategy == "bucket_verify":
        all_reduce(tensors, strategy="bucket", min_bucket_mb=min_bucket_mb, verify=True)
    else:
        all_reduce(tensors, strategy=strategy, min_bucket_mb=min_bucket_mb)


def strategies_for(num_tensors: int, peer_max_n: int) -> tuple[str, ...]:
    return STRATEGIES if num_tensors <= peer_max_n else tuple(s for s in STRATEGIES if s != "torch_loop")


def _bench_rank(sizes: list[int], repeats: dict[int, int], min_bucket_mb: float, peer_max_n: int) -> list[dict]:
    """Runs on every rank; returns this rank's time per (n, strategy, repeat). Repeat -1 (warm-up) is dropped."""
    torch.set_num_threads(1)
    rank = dist.get_rank()
    records = []
    for num_tensors in sizes:
        inputs = make_tensors(num_tensors, rank)
        strategies = strategies_for(num_tensors, peer_max_n)
        first = -1 if num_tensors == sizes[0] else 0
        for repeat in range(first, repeats[num_tensors]):
            shift = repeat % len(strategies)
            for strategy in strategies[shift:] + strategies[:shift]:
                tensors = [t.clone() for t in inputs]
                dist.barrier()
                started = time.perf_counter()
                _run_strategy(strategy, tensors, min_bucket_mb)
                elapsed_s = time.perf_counter() - started
                assert tensors[-1][0].item() == sum(range(1, dist.get_world_size() + 1)), strategy
                if repeat >= 0:
                    records.append({"n": num_tensors, "strategy": strategy, "repeat": repeat, "time_s": elapsed_s})
    return records


def summarize(per_rank: list[list[dict]], sizes: list[int]) -> tuple[list[dict], dict]:
    slowest: dict[tuple[int, str], list[float]] = {}
    for records in zip(*per_rank):
        key = (records[0]["n"], records[0]["strategy"])
        slowest.setdefault(key, []).append(max(r["time_s"] for r in records))
    total_bytes = {n: sum(t.numel() * t.element_size() for t in make_tensors(n, 0)) for n in sizes}
    rows = [{"n": n, "strategy": strategy, "total_bytes": total_bytes[n], "median_s": statistics.median(times),
             "min_s": min(times), "times_s": times} for (n, strategy), times in slowest.items()]
    median = {(row["n"], row["strategy"]): row["median_s"] for row in rows}
    for row in rows:
        row["speedup_vs_plain"] = median[(row["n"], "plain")] / row["median_s"]
    summary = {f"bucket_vs_plain_n{n}": median[(n, "plain")] / median[(n, "bucket")] for n in sizes}
    summary.update({f"rs_ag_vs_plain_n{n}": median[(n, "plain")] / median[(n, "rs_ag")] for n in sizes})
    summary.update({f"bucket_vs_torch_loop_n{n}": median[(n, "torch_loop")] / median[(n, "bucket")]
                    for n in sizes if (n, "torch_loop") in median})
    return rows, summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[50, 500, 5000])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--large-n", type=int, default=5000, help="sizes from here on use --large-repeats")
    parser.add_argument("--large-repeats", type=int, default=3, help="per-tensor runs take ~1 min at n=5000")
    parser.add_argument("--peer-max-n", type=int, default=500, help="largest n that also runs torch_loop")
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--min-bucket-mb", type=float, default=1.0)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "collectives.json"))
    args = parser.parse_args()
    repeats = {n: args.large_repeats if n >= args.large_n else args.repeats for n in args.sizes}
    per_rank = run_distributed(_bench_rank, args.world_size, args.sizes, repeats, args.min_bucket_mb,
                               args.peer_max_n, timeout_s=3600)
    rows, summary = summarize(per_rank, args.sizes)
    print(f"{'n':>6} {'strategy':>14} {'KiB':>8} {'median ms':>10} {'min ms':>9} {'vs plain':>9}")
    for row in rows:
        print(f"{row['n']:>6} {row['strategy']:>14} {row['total_bytes'] / 1024:>8.0f} {row['median_s'] * 1e3:>10.2f} "
              f"{row['min_s'] * 1e3:>9.2f} {row['speedup_vs_plain']:>8.1f}x")
    for key, value in summary.items():
        print(f"{key}: {value:.1f}")
    result = {"name": "collectives", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
              "machine": {"cores": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
                          "processor": platform.processor() or platform.machine()},
              "config": {"world_size": args.world_size, "backend": "gloo", "sizes": args.sizes,
                         "repeats": {str(n): r for n, r in repeats.items()},
                         "peer_max_n": args.peer_max_n, "min_bucket_mb": args.min_bucket_mb,
                         "tensor_bytes": [MIN_BYTES, MAX_BYTES], "dtypes": ["float32", "bfloat16"],
                         "op": "sum", "timing": "slowest rank per call, median over repeats"},
              "rows": rows, "summary": summary}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
