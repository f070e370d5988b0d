"""Context parallelism on gloo: an actor update at CP=2 (2 ranks) vs CP=1 (1 rank) on the same long rows.

Tiny model, `--rows` rows of `--length` tokens (6-token prompt), one packed micro-batch of them all. Each layout
runs in its own 2-rank world (at CP=1 rank 1 idles) so a process's peak RSS is that layout's: the peak growth
over the RSS after building the model is the update's activation (and gather) memory per rank. Reports median
wall and CPU s/update, peak growth, and the CP=2 / CP=1 ratios; writes benchmarks/results/context_parallel.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _machine import machine_info  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "context_parallel.json"


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _update_world(path: str, cp: int, rows: int, length: int, repeats: int) -> dict:
    from transformers import AutoConfig

    from bench_packing import PROMPT, variable_length_batch
    from rlhf.parallel.groups import build_layout_groups
    from rlhf.parallel.layout import ParallelLayout
    from rlhf.parallel.meshes import RoleMesh
    from rlhf.stages.config import AlgoConfig, UpdateConfig
    from rlhf.stages.policy_role import PolicyRole
    from rlhf.train.config import OptimConfig

    layout = ParallelLayout(cp=cp)
    update = UpdateConfig(micro_batch_size=rows, max_tokens_per_microbatch=rows * length,
                          optim=OptimConfig(lr=1e-6))
    role = PolicyRole("actor", RoleMesh("actor", layout, build_layout_groups(layout)), path, total_steps=1000,
                      update=update)
    batch = variable_length_batch(AutoConfig.from_pretrained(path).vocab_size, length - PROMPT)
    batch = batch.select(torch.arange(rows))
    full_b = torch.full((rows,), length - PROMPT)
    batch = dataclasses.replace(batch, response_lengths_b=full_b, response_mask_bt=torch.ones_like(batch.loss_mask_bt),
                                loss_mask_bt=torch.ones_like(batch.loss_mask_bt))
    algo = AlgoConfig()
    algo = dataclasses.replace(algo, rollout_correction=algo.rollout_correction.resolved(weights_shared=True))
    built_mib = _peak_mib()
    wall, cpu = [], []
    for repeat in range(repeats + 1):  # the first warms up
        torch.distributed.barrier()
        start, start_cpu = time.perf_counter(), time.process_time()
        role.update(batch, algo)
        torch.distributed.barrier()
        if repeat:
            wall.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
    return {"median_s": statistics.median(wall), "median_cpu_s": statistics.median(cpu),
            "peak_growth_mib": _peak_mib() - built_mib, "member": role.mesh.is_member}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    from bench_e2e_vs_trl import tiny_model_folder
    from rlhf.testing.distributed import run_distributed

    results = {}
    with tempfile.TemporaryDirectory() as workdir:
        path = str(tiny_model_folder(Path(workdir), max_position_embeddings=args.length))
        for cp in (1, 2):
            per_rank = run_distributed(_update_world, 2, path, cp, args.rows, args.length, args.repeats,
                                       timeout_s=1800)
            results[f"cp{cp}"] = per_rank[0] | {"peak_growth_mib_per_rank": [r["peak_growth_mib"] for r in per_rank]}
    cp1, cp2 = results["cp1"], results["cp2"]
    summary = {"cp2_over_cp1_wall": cp2["median_s"] / cp1["median_s"],
               "cp2_over_cp1_cpu_per_rank": cp2["median_cpu_s"] / cp1["median_cpu_s"],
               "cp2_over_cp1_peak_growth": cp2["peak_growth_mib"] / max(cp1["peak_growth_mib"], 1e-9)}
    print(f"{'layout':7} {'s/update':>9} {'cpu s':>8} {'peak growth MiB/rank':>21}")
    for name, res in results.items():
        print(f"{name:7} {res['median_s']:9.3f} {res['median_cpu_s']:8.2f} {res['peak_growth_mib']:21.1f}")
    print(f"CP=2 / CP=1: {summary['cp2_over_cp1_wall']:.2f}x wall, {summary['cp2_over_cp1_cpu_per_rank']:.2f}x CPU "
          f"per rank, {summary['cp2_over_cp1_peak_growth']:.2f}x peak growth per rank ({args.rows} x {args.length} "
          f"tokens)")
    result = {"name": "context_parallel",
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": machine_info(), "config": vars(args),
              "rows": [{"layout": name, **res} for name, res in results.items()], "summary": summary}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
