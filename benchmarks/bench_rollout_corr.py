"""Rollout correction and DAPO on the CPU demo task (issue 17, item 4): what a mismatched rollout does to GRPO.

Setup as launch/demo.sh (chain_sum data, a 1M-param char Llama SFT'd on 2,000 labelled problems), then RL arms
from the same SFT policy through `rlhf train` on 2 gloo ranks, each `--steps` steps:
  grpo_shared      the demo: native engine on the actor's own fp32 weights (rollout = train)
  grpo_bf16        a bf16 engine copy (resharded each step) vs the fp32 trainer, no correction (metrics only)
  grpo_bf16_tis    the same engine, token TIS at 2 (what `auto` picks for an engine with its own weights)
  grpo_bf16_icepop the same engine, IcePop: tokens with a ratio outside [0.5, 2] leave the loss
  dapo_shared      configs/dapo_cpu.yaml (clip-higher, dynamic sampling, overlong shaping) at equal steps
Prints a table; writes benchmarks/results/rollout_corr.json. No timing assertions anywhere.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _machine import machine_info  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "rollout_corr.json"
TASK = ["--task", "chain_sum", "--prompt-format", "expression", "--task-option", "min_terms=2", "--task-option",
        "max_terms=3", "--task-option", "min_digits=1", "--task-option", "max_digits=2"]
BF16 = ["rollout.dtype=bfloat16", "actor.recompute_old_logprobs=true"]
ARMS = {
    "grpo_shared": ("demo_cpu.yaml", ["actor.recompute_old_logprobs=true"]),
    "grpo_bf16": ("demo_cpu.yaml", BF16 + ["algo.rollout_correction.enable=true",
                                           "algo.rollout_correction.rollout_is=null"]),
    "grpo_bf16_tis": ("demo_cpu.yaml", BF16),
    "grpo_bf16_icepop": ("demo_cpu.yaml", BF16 + ["algo.rollout_correction.rollout_is=null",
                                                 "algo.rollout_correction.rollout_rs=token",
                                                 "algo.rollout_correction.rollout_rs_threshold=2.0"]),
    "dapo_shared": ("dapo_cpu.yaml", []),
}
PER_STEP = ["critic/score/mean", "rollout/logprob_diff_mean", "rollout/logprob_diff_max", "rollout_corr/kl",
            "rollout_corr/k3_kl", "rollout_corr/is_weight_mean", "rollout_corr/is_weight_max",
            "rollout_corr/is_weight_min", "rollout_corr/is_truncated_fraction", "rollout_corr/rs_masked_fraction",
            "dynamic_sampling/gen_rounds", "dynamic_sampling/kept_fraction", "timing_s/step"]


def _run(cmd: list[str], env: dict) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=REPO, env=env, stdout=subprocess.DEVNULL)


def _rlhf(*args: str) -> list[str]:
    return [sys.executable, "-m", "rlhf", *args]


def _torchrun(nproc: int, *args: str) -> list[str]:
    return ["bash", str(REPO / "launch/torchrun.sh"), str(nproc), *args]


def prepare(out: Path, nproc: int, sft_steps: int, env: dict) -> Path:
    """Data, initial model and the SFT policy, exactly as launch/demo.sh makes them (reused when present)."""
    sft_model = out / "sft_model"
    if (sft_model / "config.json").is_file():
        return sft_model
    data = out / "data"
    data.mkdir(parents=True, exist_ok=True)
    _run(_rlhf("data", "make", *TASK, "--n", "10000", "--seed", "1", "--out", str(data / "rl.parquet")), env)
    _run(_rlhf("data", "make", *TASK, "--n", "2000", "--seed", "20000000", "--out", str(data / "sft.parquet")), env)
    _run(_rlhf("data", "make", *TASK, "--n", "500", "--seed", "10000000", "--exclude", str(data / "rl.parquet"),
               "--exclude", str(data / "sft.parquet"), "--out", str(data / "val.parquet")), env)
    _run(_rlhf("init-model", "--out", str(out / "model0"), "--hidden", "128", "--layers", "4", "--heads", "4",
               "--kv-heads", "4", "--ffn", "512", "--max-positions", "64"), env)
    _run(_torchrun(nproc, "sft", "--config", str(REPO / "configs/demo_cpu.yaml"), f"run.output_dir={out}",
                   "run.name=sft", f"data.val_files=[{data / 'val.parquet'}]", f"model.path={out / 'model0'}",
                   f"data.train_files=[{data / 'sft.parquet'}]", f"sft.out_dir={sft_model}", f"sft.steps={sft_steps}",
                   "actor.optim.lr=3.0e-3", "actor.optim.warmup_steps=20", "actor.micro_batch_size=64"), env)
    return sft_model


def run_arm(name: str, seed: int, out: Path, sft_model: Path, nproc: int, steps: int, env: dict) -> list[dict]:
    config, overrides = ARMS[name]
    run_name = f"{name}_s{seed}"
    if not (out / run_name / "metrics.jsonl").is_file():
        data = out / "data"
        _run(_torchrun(nproc, "train", "--config", str(REPO / "configs" / config), f"run.output_dir={out}",
                       f"run.name={run_name}", f"model.path={sft_model}", f"data.train_files=[{data / 'rl.parquet'}]",
                       f"data.val_files=[{data / 'val.parquet'}]", f"trainer.total_steps={steps}",
                       f"trainer.val_every={max(steps // 4, 1)}", "trainer.tensorboard=false",
                       "checkpoint.save_at_end=false", f"data.seed={seed}", f"sampling.seed={seed}", *overrides), env)
    return [json.loads(line) for line in (out / run_name / "metrics.jsonl").read_text().splitlines() if line.strip()]


def summarize(name: str, histories: list[list[dict]]) -> dict:
    """Per arm: the seeds' mean of each metric's per-step mean / peak, validation curve and reward curve."""
    row: dict = {"arm": name, "seeds": len(histories)}
    per_seed = []
    for history in histories:
        steps = [r for r in history if r["step"] > 0]
        stats = {"val_curve": [(r["step"], r["val/score/mean@1"]) for r in history if "val/score/mean@1" in r],
                 "reward_curve": [r.get("critic/score/mean") for r in steps]}
        for key in PER_STEP:
            values = [r[key] for r in steps if key in r]
            if values:
                stats[f"{key}:mean"] = statistics.fmean(values)
                stats[f"{key}:peak"] = max(values)
        per_seed.append(stats)
    for key in per_seed[0]:
        if key.endswith((":mean", ":peak")):
            row[key] = statistics.fmean(s[key] for s in per_seed if key in s)
    row["val_before"] = statistics.fmean(s["val_curve"][0][1] for s in per_seed)
    row["val_after"] = statistics.fmean(s["val_curve"][-1][1] for s in per_seed)
    row["val_after_per_seed"] = [s["val_curve"][-1][1] for s in per_seed]
    row["val_curves"] = [s["val_curve"] for s in per_seed]
    row["reward_curve_mean"] = [statistics.fmean(c) for c in zip(*(s["reward_curve"] for s in per_seed))]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/bench_rollout_corr")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--sft-steps", type=int, default=300)
    parser.add_argument("--arms", nargs="*", default=list(ARMS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    args = parser.parse_args()
    out = (REPO / args.out).resolve()
    env = os.environ | {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHON": sys.executable}
    sft_model = prepare(out, args.nproc, args.sft_steps, env)
    rows = [summarize(name, [run_arm(name, seed, out, sft_model, args.nproc, args.steps, env) for seed in args.seeds])
            for name in args.arms]
    columns = ["val_before", "val_after", "critic/score/mean:mean", "rollout/logprob_diff_mean:mean",
               "rollout/logprob_diff_max:peak", "rollout_corr/k3_kl:mean", "rollout_corr/is_weight_max:peak",
               "rollout_corr/is_weight_min:mean",
               "rollout_corr/is_truncated_fraction:mean", "rollout_corr/rs_masked_fraction:mean",
               "dynamic_sampling/gen_rounds:mean", "timing_s/step:mean"]
    print(f"\n{'metric':38s} " + " ".join(f"{row['arm']:>16s}" for row in rows))
    for column in columns:
        cells = [row.get(column) for row in rows]
        print(f"{column:38s} " + " ".join(f"{c:16.4g}" if isinstance(c, float) else f"{'-':>16s}" for c in cells))
    by_arm = {row["arm"]: row for row in rows}
    summary = {f"{arm}_val_after": row["val_after"] for arm, row in by_arm.items()}
    if "grpo_bf16" in by_arm:
        summary["bf16_logprob_diff_max"] = by_arm["grpo_bf16"].get("rollout/logprob_diff_max:peak")
        summary["bf16_k3_kl_mean"] = by_arm["grpo_bf16"].get("rollout_corr/k3_kl:mean")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({
        "name": "rollout_corr", "date": datetime.date.today().isoformat(), "machine": machine_info(),
        "config": {"steps": args.steps, "nproc": args.nproc, "sft_steps": args.sft_steps, "seeds": args.seeds,
                   "arms": {arm: ARMS[arm] for arm in args.arms}},
        "rows": rows, "summary": summary}, indent=1))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
