"""Weight resharding on 4 gloo ranks: rlhf's planned, bucketed transfer vs the naive gather-everything-then-slice.

Peer ("naive", what per-tensor sync stacks do): every training shard of every parameter is broadcast to every
rank (one collective per shard), each rank rebuilds the full tensors (HF form) and cuts its rollout shard.
rlhf: the plan's slices only, one message per (src, dst) pair and bucket, as `shm` (same-host shared-memory
segments: what `WeightSync(method="auto")` picks on one CPU host), `p2p` (gloo isend/irecv) and `all_to_all`
(one gloo all_to_all_single per round). Methods alternate within each repeat; a sync's time is the slowest
rank's; medians over repeats. Each rank's rollout shards are checked bitwise equal across methods.
Writes benchmarks/results/reshard.json (summary per pair: bytes_vs_min_<pair> and speedup_vs_naive_<pair> for
the default transport, plus speedup_vs_naive_p2p_<pair> for gloo point-to-point).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import time
import zlib
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import LlamaConfig

from rlhf.parallel.layout import ParallelLayout
from rlhf.models.param_specs import param_specs
from rlhf.models.shard_rules import merge_shards, read_shard
from rlhf.models.spec import ModelSpec
from rlhf.reshard.apply import allocate_dst
from rlhf.reshard.planner import min_received_numel, plan
from rlhf.reshard.schedule import build_schedule
from rlhf.reshard.shm import SharedMemoryTransport
from rlhf.reshard.transport import execute
from rlhf.testing.distributed import run_distributed

PAIRS = {
    "tp2pp2_to_tp1dp4": (ParallelLayout(tp=2, pp=2), ParallelLayout(dp=4)),
    "tp4_to_tp2dp2": (ParallelLayout(tp=4), ParallelLayout(tp=2, dp=2)),
    "tp1dp4_to_tp2dp2": (ParallelLayout(dp=4), ParallelLayout(tp=2, dp=2)),
    "tp2_to_tp1dp2_split": (ParallelLayout(tp=2), ParallelLayout(dp=2, first_rank=2)),
}
METHODS = ("naive", "shm", "p2p", "all_to_all")
RLHF_METHODS = METHODS[1:]
WORLD_SIZE = 4
ITEMSIZE = 4  # fp32


def model_config(args: argparse.Namespace) -> LlamaConfig:
    return LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.ffn,
                       num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                       max_position_embeddings=128, tie_word_embeddings=False)


def training_shards(config, layout: ParallelLayout, rank: int) -> dict[str, torch.Tensor]:
    """This rank's training shards, random but identical on DP replicas (seeded by name and tp rank)."""
    if not layout.contains(rank):
        return {}
    tp_rank, _, pp_rank, _ = layout.coords(rank)
    spec, shards = ModelSpec.from_hf(config), {}
    per_stage = spec.num_layers // layout.pp
    for param in param_specs(config, layout):
        if param.pp_stage != pp_rank:
            continue
        seed = zlib.crc32(f"{param.name}/{tp_rank if param.partition_dim is not None else 0}".encode())
        shape = param.shard_shape(layout.tp)
        shards[param.local_name(per_stage)] = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    return shards


def naive_sync(config, src: ParallelLayout, dst: ParallelLayout, sources: dict[str, torch.Tensor]
               ) -> tuple[dict[str, torch.Tensor], int, int]:
    """Broadcast every training shard to every rank, rebuild full HF tensors, cut the rollout shard.

    Returns (this rank's rollout shards, bytes it received, number of collectives).
    """
    rank, spec = dist.get_rank(), ModelSpec.from_hf(config)
    per_stage = spec.num_layers // src.pp
    full, received, calls = {}, 0, 0
    for param in param_specs(config, src):
        if param.tied_copy:
            continue
        shards = []
        for tp_rank in range(1 if param.partition_dim is None else src.tp):
            root = src.rank_of(tp_rank, 0, param.pp_stage)
            local_name = param.local_name(per_stage)
            buffer = sources[local_name] if rank == root else torch.empty(param.shard_shape(src.tp))
            dist.broadcast(buffer, root)
            calls += 1
            received += 0 if rank == root else buffer.numel() * ITEMSIZE
            shards.append(buffer)
        full.update(merge_shards(param, shards, spec))
    out = {}
    if dst.contains(rank):
        tp_rank = dst.coords(rank).tp_rank
        out = {p.name: read_shard(p, full.__getitem__, spec, tp_rank, dst.tp) for p in param_specs(config, dst)}
    return out, received, calls


def _timed(fn):
    dist.barrier()
    started = time.perf_counter()
    value = fn()
    elapsed = torch.tensor([time.perf_counter() - started], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return value, float(elapsed)


def _bench_pair(config, src: ParallelLayout, dst: ParallelLayout, repeats: int, max_bucket_mb: float) -> dict:
    rank = dist.get_rank()
    sources = training_shards(config, src, rank)
    src_specs, dst_specs = param_specs(config, src), param_specs(config, dst)
    planned, plan_s = _timed(lambda: plan(src, dst, src_specs, dst_specs, vocab_size=config.vocab_size))
    schedule = build_schedule(planned, max_bucket_numel=int(max_bucket_mb * 2**20) // ITEMSIZE)
    shm, shm_setup_s = _timed(lambda: SharedMemoryTransport(schedule, dtype=torch.float32))
    times = {method: [] for method in METHODS}
    record = {"plan_s": plan_s, "shm_setup_s": shm_setup_s, "rounds": len(schedule.rounds),
              "p2p_messages": schedule.num_messages,
              "min_bytes": min_received_numel(src, dst, src_specs, dst_specs, vocab_size=config.vocab_size,
                                              rank=rank) * ITEMSIZE}
    for repeat in range(-1, repeats):  # repeat -1 warms up and checks results
        shift = repeat % len(METHODS)
        results = {}
        for method in METHODS[shift:] + METHODS[:shift]:
            if method == "naive":
                (shards, received, calls), elapsed = _timed(lambda: naive_sync(config, src, dst, sources))
                record.update(naive_bytes=received, naive_collectives=calls)
            else:
                shards = allocate_dst(planned, rank, dtype=torch.float32)
                if method == "shm":
                    stats, elapsed = _timed(lambda: shm.execute(sources, shards))
                else:
                    stats, elapsed = _timed(lambda: execute(schedule, sources, shards, dtype=torch.float32,
                                                            device=torch.device("cpu"), method=method))
                record[f"{method}_bytes"] = stats.bytes_received
            results[method] = shards
            if repeat >= 0:
                times[method].append(elapsed)
        if repeat == -1:
            for name, tensor in results["naive"].items():
                for method in RLHF_METHODS:
                    assert torch.equal(results[method][name], tensor), (method, name)
        del results, shards
    record["times"] = times
    return record


def _bench_rank(args: argparse.Namespace) -> dict:
    torch.set_num_threads(1)
    config = model_config(args)
    return {pair: _bench_pair(config, *PAIRS[pair], args.repeats, args.max_bucket_mb) for pair in args.pairs}


def summarize(per_rank: list[dict], pairs: list[str]) -> tuple[list[dict], dict]:
    rows, summary = [], {}
    for pair in pairs:
        records = [r[pair] for r in per_rank]
        medians = {m: statistics.median(records[0]["times"][m]) for m in METHODS}
        ratios = [1.0 if r["min_bytes"] == 0 and r["shm_bytes"] == 0 else r["shm_bytes"] / max(1, r["min_bytes"])
                  for r in records]
        row = {"pair": pair, "median_s": medians,
               "speedup_vs_naive": {m: medians["naive"] / medians[m] for m in RLHF_METHODS},
               "bytes_received_per_rank": {m: [r[f"{m}_bytes"] for r in records] for m in METHODS},
               "min_bytes_per_rank": [r["min_bytes"] for r in records], "bytes_vs_min": max(ratios),
               "collectives": {"naive": records[0]["naive_collectives"], "p2p_messages": records[0]["p2p_messages"],
                               "all_to_all": records[0]["rounds"]},
               "plan_s": records[0]["plan_s"], "shm_setup_s": records[0]["shm_setup_s"],
               "times_s": records[0]["times"]}
        rows.append(row)
        summary[f"bytes_vs_min_{pair}"] = row["bytes_vs_min"]
        summary[f"speedup_vs_naive_{pair}"] = row["speedup_vs_naive"]["shm"]
        summary[f"speedup_vs_naive_p2p_{pair}"] = row["speedup_vs_naive"]["p2p"]
    return rows, summary


def print_table(rows: list[dict]) -> None:
    header = (f"{'pair':<22}{'naive s':>9}{'shm s':>8}{'p2p s':>8}{'a2a s':>8}{'x shm':>7}{'x p2p':>7}"
              f"{'MB recv max':>12}{'min MB max':>11}{'naive MB max':>13}{'#naive':>7}{'#p2p':>5}{'#a2a':>5}")
    print(header)
    for row in rows:
        received, naive = row["bytes_received_per_rank"], row["bytes_received_per_rank"]["naive"]
        times, speedup = row["median_s"], row["speedup_vs_naive"]
        print(f"{row['pair']:<22}{times['naive']:>9.3f}{times['shm']:>8.3f}{times['p2p']:>8.3f}"
              f"{times['all_to_all']:>8.3f}{speedup['shm']:>7.2f}{speedup['p2p']:>7.2f}"
              f"{max(received['shm']) / 2**20:>12.1f}{max(row['min_bytes_per_rank']) / 2**20:>11.1f}"
              f"{max(naive) / 2**20:>13.1f}{row['collectives']['naive']:>7}{row['collectives']['p2p_messages']:>5}"
              f"{row['collectives']['all_to_all']:>5}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--ffn", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=16003)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-bucket-mb", type=float, default=16.0)
    parser.add_argument("--pairs", nargs="+", default=list(PAIRS), choices=list(PAIRS))
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "reshard.json"))
    args = parser.parse_args()
    per_rank = run_distributed(_bench_rank, WORLD_SIZE, args, timeout_s=3000)
    rows, summary = summarize(per_rank, args.pairs)
    print_table(rows)
    config = vars(args) | {"world_size": WORLD_SIZE, "backend": "gloo", "dtype": "float32",
                           "num_params": sum(torch.Size(p.full_shape).numel()
                                             for p in param_specs(model_config(args), ParallelLayout())),
                           "timing": "slowest rank per sync, median over repeats (methods alternate)"}
    result = {"name": "reshard", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
              "machine": {"cores": os.cpu_count(),
                          "torch": torch.__version__, "python": platform.python_version(),
                          "processor": platform.machine()},
              "config": config, "rows": rows, "summary": summary}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
