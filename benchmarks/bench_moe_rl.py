"""GRPO on a tiny Qwen3-MoE on the CPU demo task at expert parallelism 2, and routing replay (issue 16, item 4).

The demo's chain_sum data; a char-level Qwen3-MoE (4 layers, hidden 64, 4 experts, top-2) SFT'd briefly on
2,000 labelled problems (2 ranks, ep=1); then RL arms from that policy through `rlhf train` on `--nproc` gloo
ranks with the actor at ep=2 (the rollout engine at ep=1 gets the experts by resharding):
  grpo_ep2          fp32 engine (rollout = train numerics up to fp32 rounding)
  grpo_ep2_bf16     a bf16 engine vs the fp32 trainer, no routing replay: logprob diff from numerics + routing
  grpo_ep2_bf16_r3  the same engine with R3: the rollout's routing replayed in every training forward;
                    rollout/router_agreement = how often the trainer's own router picked the engine's experts
Prints a table; writes benchmarks/results/moe_rl.json. No timing assertions anywhere.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _machine import machine_info  # noqa: E402
from bench_rollout_corr import TASK, _rlhf, _run, _torchrun  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "moe_rl.json"
COMMON = ["mesh.actor.ep=2", "actor.recompute_old_logprobs=true"]
ARMS = {
    "grpo_ep2": COMMON,
    "grpo_ep2_bf16": COMMON + ["rollout.dtype=bfloat16"],
    "grpo_ep2_bf16_r3": COMMON + ["rollout.dtype=bfloat16", "algo.routing_replay=r3"],
}
PER_STEP = ["critic/score/mean", "rollout/logprob_diff_mean", "rollout/logprob_diff_max", "rollout/router_agreement",
            "rollout/router_agreement_all_layers", "rollout/routing_bytes_per_token", "actor/moe/aux_loss",
            "actor/moe/load_imbalance", "timing_s/step"]


def prepare(out: Path, sft_steps: int, env: dict) -> Path:
    """Data as launch/demo.sh makes it, a tiny Qwen3-MoE and its SFT policy (reused when present)."""
    sft_model = out / "sft_model"
    if (sft_model / "config.json").is_file():
        return sft_model
    data = out / "data"
    data.mkdir(parents=True, exist_ok=True)
    _run(_rlhf("data", "make", *TASK, "--num-prompts", "10000", "--seed", "1", "--out", str(data / "rl.parquet")), env)
    _run(_rlhf("data", "make", *TASK, "--num-prompts", "2000", "--seed", "20000000", "--out",
               str(data / "sft.parquet")), env)
    _run(_rlhf("data", "make", *TASK, "--num-prompts", "500", "--seed", "10000000", "--exclude",
               str(data / "rl.parquet"), "--exclude", str(data / "sft.parquet"), "--out", str(data / "val.parquet")),
         env)
    _run(_rlhf("init-model", "--arch", "qwen3_moe", "--out", str(out / "model0"), "--hidden", "64", "--layers", "4",
               "--heads", "4", "--kv-heads", "4", "--experts", "4", "--experts-per-token", "2", "--expert-ffn",
               "128", "--max-positions", "64"), env)
    _run(_torchrun(2, "sft", "--config", str(REPO / "configs/demo_cpu.yaml"), f"run.output_dir={out}",
                   "run.name=sft", f"data.val_files=[{data / 'val.parquet'}]", f"model.path={out / 'model0'}",
                   f"data.train_files=[{data / 'sft.parquet'}]", f"sft.out_dir={sft_model}", f"sft.steps={sft_steps}",
                   "actor.optim.lr=3.0e-3", "actor.optim.warmup_steps=20", "actor.micro_batch_size=64"), env)
    return sft_model


def run_arm(name: str, out: Path, sft_model: Path, nproc: int, steps: int, env: dict) -> list[dict]:
    if not (out / name / "metrics.jsonl").is_file():
        data = out / "data"
        _run(_torchrun(nproc, "train", "--config", str(REPO / "configs/demo_cpu.yaml"), f"run.output_dir={out}",
                       f"run.name={name}", f"model.path={sft_model}", f"data.train_files=[{data / 'rl.parquet'}]",
                       f"data.val_files=[{data / 'val.parquet'}]", f"trainer.total_steps={steps}",
                       f"trainer.val_every={max(steps // 4, 1)}", "trainer.tensorboard=false", "trainer.plot=false",
                       "checkpoint.save_at_end=false", *ARMS[name]), env)
    return [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines() if line.strip()]


def summarize(name: str, history: list[dict]) -> dict:
    """Per arm: each metric's mean and peak over the steps, the validation and reward curves."""
    steps = [r for r in history if r["step"] > 0]
    row: dict = {"arm": name, "overrides": ARMS[name],
                 "val_curve": [(r["step"], r["val/score/mean@1"]) for r in history if "val/score/mean@1" in r],
                 "reward_curve": [r.get("critic/score/mean") for r in steps]}
    for key in PER_STEP:
        values = [r[key] for r in steps if key in r]
        if values:
            row[f"{key}:mean"], row[f"{key}:peak"] = statistics.fmean(values), max(values)
    rewards = row["reward_curve"]
    quarter = max(len(rewards) // 4, 1)
    row["reward_first_quarter"] = statistics.fmean(rewards[:quarter])
    row["reward_last_quarter"] = statistics.fmean(rewards[-quarter:])
    row["val_before"], row["val_after"] = row["val_curve"][0][1], row["val_curve"][-1][1]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/bench_moe_rl")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--sft-steps", type=int, default=300)
    parser.add_argument("--arms", nargs="*", default=list(ARMS))
    args = parser.parse_args()
    out = (REPO / args.out).resolve()
    env = os.environ | {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHON": sys.executable}
    sft_model = prepare(out, args.sft_steps, env)
    rows = [summarize(name, run_arm(name, out, sft_model, args.nproc, args.steps, env)) for name in args.arms]
    columns = ["val_before", "val_after", "reward_first_quarter", "reward_last_quarter",
               "rollout/logprob_diff_mean:mean", "rollout/logprob_diff_max:peak", "rollout/router_agreement:mean",
               "rollout/router_agreement_all_layers:mean", "rollout/routing_bytes_per_token:mean",
               "actor/moe/load_imbalance:mean", "timing_s/step:mean"]
    print(f"\n{'metric':42s} " + " ".join(f"{row['arm']:>17s}" for row in rows))
    for column in columns:
        cells = [row.get(column) for row in rows]
        print(f"{column:42s} " + " ".join(f"{c:17.4g}" if isinstance(c, float) else f"{'-':>17s}" for c in cells))
    by_arm = {row["arm"]: row for row in rows}
    summary = {f"{arm}_{key}": row[key] for arm, row in by_arm.items()
               for key in ("val_after", "reward_first_quarter", "reward_last_quarter")}
    for arm, row in by_arm.items():
        for key in ("rollout/logprob_diff_mean:mean", "rollout/logprob_diff_max:peak",
                    "rollout/router_agreement:mean", "rollout/routing_bytes_per_token:mean"):
            if key in row:
                summary[f"{arm}_{key.split('/')[1].split(':')[0]}"] = row[key]
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({
        "name": "moe_rl", "date": datetime.date.today().isoformat(), "machine": machine_info(),
        "config": {"steps": args.steps, "nproc": args.nproc, "sft_steps": args.sft_steps, "arms": ARMS},
        "rows": rows, "summary": summary}, indent=1))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
