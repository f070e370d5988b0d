"""Actor update on variable-length responses: padded vs length-sorted, trimmed vs packed (THD) micro-batches.

One rank, one actor (`PolicyRole.update`), a fixed batch of `--rows` (32) rows whose response lengths are uniform in
[1, max] after a 6-token prompt, for each spread max in `--spreads` (default 128 and 2048). Three variants of
the same code, alternating repeats: `padded` (micro-batches of 8 rows at the step's width), `sorted` (rows sorted
by length, each micro-batch cut to its longest row; the row-count default) and `packed` (rows bin-packed into
micro-batches of at most `--budget` tokens; default: the tokens of 8 rows at the mean length). Reports the
useful-token fraction (real tokens / tokens the model computes), median wall and CPU s/update (CPU time is
steadier on a shared host, and at OMP_NUM_THREADS=1 free of spinning workers) and ratios, with the 1-minute load
at each spread's start and end; writes benchmarks/results/packing.json. `--model tiny` runs in a minute.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _machine import machine_info  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "packing.json"
ROWS, PROMPT = 32, 6


def variable_length_batch(vocab: int, max_response: int, rows: int = ROWS):
    from rlhf.stages.batch import ScoredBatch

    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, max_response + 1, (rows,), generator=gen)
    mask = torch.arange(max_response)[None] < lengths[:, None]
    zeros_bt = torch.zeros(mask.shape)
    return ScoredBatch(tokens_bs=torch.randint(3, vocab, (rows, PROMPT + max_response), generator=gen),
                       prompt_lengths_b=torch.full((rows,), PROMPT), response_lengths_b=lengths,
                       response_mask_bt=mask, loss_mask_bt=mask, group_index_b=torch.arange(rows) // 4,
                       sample_index_b=torch.arange(rows) // 4, trajectory_index_b=None,
                       rollout_logprobs_bt=zeros_bt,
                       policy_version_bt=torch.zeros(mask.shape, dtype=torch.int32),
                       truncated_b=torch.zeros(rows, dtype=torch.bool), scores_b=torch.zeros(rows),
                       baseline_scores_b=None, reward_components_bk=None, routed_experts_bslk=None, pad_token_id=0,
                       old_logprobs_bt=None,
                       ref_logprobs_bt=None, values_bt=None, token_rewards_bt=zeros_bt,
                       advantages_bt=torch.randn(mask.shape, generator=gen) * mask, returns_bt=None,
                       is_weights_bt=None, teacher_logprobs_bt=None, cov_selected_bt=None)


def computed_tokens(role, batch, budget: int, padded: bool) -> int:
    """Tokens the model runs over in one update of `batch` (padding and filler included)."""
    if padded:
        return batch.tokens_bs.numel()
    _, micro = role._split(batch, (budget, "--budget"), role.update_config.micro_batch_size)
    return sum(mb.tokens_bs.numel() for mb in micro)


def run_spread(role, batch, budget: int, repeats: int) -> dict:
    """Median s/update and useful-token fraction of each variant on one batch."""
    from rlhf.stages.config import AlgoConfig

    algo = AlgoConfig()
    algo = dataclasses.replace(algo, rollout_correction=algo.rollout_correction.resolved(weights_shared=True))
    rows_cfg = role.update_config
    split = role._micro_batches
    variants = {"padded": (rows_cfg, lambda shard, size, ragged=False: shard.chunks(size)),
                "sorted": (rows_cfg, split),
                "packed": (dataclasses.replace(rows_cfg, max_tokens_per_microbatch=budget), split)}
    times: dict[str, list[float]] = {name: [] for name in variants}
    cpu: dict[str, list[float]] = {name: [] for name in variants}  # CPU seconds: steadier on a shared host
    load_start = os.getloadavg()[0]
    for repeat in range(repeats + 1):  # the first round warms up
        for name, (cfg, micro_split) in variants.items():
            role.update_config, role._micro_batches = cfg, micro_split
            start, start_cpu = time.perf_counter(), time.process_time()
            role.update(batch, algo)
            if repeat:
                times[name].append(time.perf_counter() - start)
                cpu[name].append(time.process_time() - start_cpu)
    role.update_config, role._micro_batches = rows_cfg, split
    real = int((batch.prompt_lengths_b + batch.response_lengths_b).sum())
    useful = {name: real / computed_tokens(role, batch, budget if name == "packed" else 0, name == "padded")
              for name in variants}
    median = {name: statistics.median(values) for name, values in times.items()}
    cpu_median = {name: statistics.median(values) for name, values in cpu.items()}
    return {"budget": budget, "real_tokens": real, "load_avg_1m": [load_start, os.getloadavg()[0]],  # start, end
            "useful_fraction": useful, "seconds": times, "median_s": median,
            "cpu_seconds": cpu, "median_cpu_s": cpu_median,
            "sorted_over_packed_cpu": cpu_median["sorted"] / cpu_median["packed"],
            "padded_over_packed_cpu": cpu_median["padded"] / cpu_median["packed"],
            "padded_over_sorted": median["padded"] / median["sorted"],
            "padded_over_packed": median["padded"] / median["packed"],
            "sorted_over_packed": median["sorted"] / median["packed"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2", choices=["tiny", "smollm2"])
    parser.add_argument("--spreads", type=int, nargs="+", default=[128, 2048])
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--budget", type=int, default=0, help="tokens per packed micro-batch (0: see docstring)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rows", type=int, default=ROWS, help="rows of the batch (fewer: a long spread fits)")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    from transformers import AutoConfig

    from rlhf.parallel.groups import build_layout_groups
    from rlhf.parallel.layout import ParallelLayout
    from rlhf.parallel.meshes import RoleMesh
    from rlhf.stages.config import UpdateConfig
    from rlhf.stages.policy_role import PolicyRole
    from rlhf.testing.distributed import free_port
    from rlhf.train.config import OptimConfig

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    results = {}
    with tempfile.TemporaryDirectory() as workdir:
        if args.model == "smollm2":
            from rlhf.models.smollm2 import smollm2_hf_folder

            path = str(smollm2_hf_folder())
        else:
            from bench_e2e_vs_trl import tiny_model_folder

            path = tiny_model_folder(Path(workdir), max_position_embeddings=PROMPT + max(args.spreads))
        layout = ParallelLayout()
        role = PolicyRole("actor", RoleMesh("actor", layout, build_layout_groups(layout)), path,
                          total_steps=1000, update=UpdateConfig(micro_batch_size=args.micro_batch,
                                                                max_tokens_per_microbatch=0,  # the row variants
                                                                optim=OptimConfig(lr=1e-6)))
        vocab = AutoConfig.from_pretrained(path).vocab_size
        for spread in args.spreads:
            budget = args.budget or max(args.micro_batch * (PROMPT + (spread + 1) // 2), PROMPT + spread)
            results[f"1-{spread}"] = run_spread(role, variable_length_batch(vocab, spread, args.rows), budget,
                                                 args.repeats)
    print(f"{'spread':8} {'variant':8} {'useful':>7} {'s/update':>9} {'padded/variant':>15} {'cpu s':>8} "
          f"{'padded/variant':>15}")
    for spread, res in results.items():
        for name, seconds in res["median_s"].items():
            cpu_s = res["median_cpu_s"][name]
            print(f"{spread:8} {name:8} {res['useful_fraction'][name]:7.3f} {seconds:9.3f} "
                  f"{res['median_s']['padded'] / seconds:14.2f}x {cpu_s:8.2f} "
                  f"{res['median_cpu_s']['padded'] / cpu_s:14.2f}x")
        print(f"{spread:8} sorted/packed {res['sorted_over_packed']:.2f}x wall, {res['sorted_over_packed_cpu']:.2f}x "
              f"CPU (budget {res['budget']} tokens)")
    result = {"name": "packing", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": machine_info(), "config": {**vars(args), "prompt": PROMPT},
              "rows": [{"spread": spread, "variant": name, "useful_fraction": res["useful_fraction"][name],
                        "median_s": seconds, "median_cpu_s": res["median_cpu_s"][name]}
                       for spread, res in results.items() for name, seconds in res["median_s"].items()],
              "summary": {key: value for spread, res in results.items() for key, value in (
                  (f"useful_fraction_packed_{spread}", res["useful_fraction"]["packed"]),
                  (f"packed_speedup_over_sorted_{spread}", res["sorted_over_packed"]),
                  (f"packed_speedup_over_padded_{spread}", res["median_s"]["padded"] / res["median_s"]["packed"]))},
              "spreads": results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
