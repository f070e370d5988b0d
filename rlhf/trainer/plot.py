"""Learning-curve figure and before/after summary of a demo run (SFT then RL), from the runs' metrics.jsonl.

    python -m rlhf.trainer.plot --sft runs/demo/sft --rl runs/demo/grpo --out runs/demo
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rlhf.metrics import read_jsonl

VAL = "val/score/mean@1"
REWARD = "critic/score/mean"


def summarize(sft_rows: list[dict], rl_rows: list[dict]) -> dict:
    sft_val = [(r["step"], r[VAL]) for r in sft_rows if VAL in r]
    rl_val = [(r["step"], r[VAL]) for r in rl_rows if VAL in r]
    return {"sft_val_curve": sft_val, "rl_val_curve": rl_val,
            "sft_only_accuracy": sft_val[-1][1] if sft_val else None,
            "rl_start_accuracy": rl_val[0][1] if rl_val else None,
            "rl_final_accuracy": rl_val[-1][1] if rl_val else None,
            "rl_best_accuracy": max(v for _, v in rl_val) if rl_val else None,
            "rl_steps": max((r["step"] for r in rl_rows), default=0)}


def plot(sft_rows: list[dict], rl_rows: list[dict], out: Path) -> Path | None:
    """curve.png: train reward per RL step, and held-out accuracy across SFT then RL steps."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    rl_reward = [(r["step"], r[REWARD]) for r in rl_rows if REWARD in r]
    if rl_reward:
        left.plot(*zip(*rl_reward), color="tab:blue")
    left.set(title="RL: train reward (exact match)", xlabel="RL step", ylabel="mean reward")
    sft_steps = max((r["step"] for r in sft_rows), default=0)
    sft_val = [(r["step"], r[VAL]) for r in sft_rows if VAL in r]
    rl_val = [(sft_steps + r["step"], r[VAL]) for r in rl_rows if VAL in r]
    if sft_val:
        right.plot(*zip(*sft_val), "o-", color="tab:gray", label="SFT (labelled answers)")
    if rl_val:
        right.plot(*zip(*rl_val), "o-", color="tab:red", label="GRPO (reward only)")
    right.axvline(sft_steps, color="k", lw=0.5, ls="--")
    right.set(title="held-out accuracy (greedy, mean@1)", xlabel="step (SFT, then RL)", ylabel="accuracy")
    right.legend()
    fig.tight_layout()
    path = out / "curve.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sft", required=True)
    parser.add_argument("--rl", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    sft_rows = read_jsonl(Path(args.sft) / "metrics.jsonl")
    rl_rows = read_jsonl(Path(args.rl) / "metrics.jsonl")
    out = Path(args.out)
    summary = summarize(sft_rows, rl_rows)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    figure = plot(sft_rows, rl_rows, out)
    print(f"held-out accuracy after SFT only : {summary['sft_only_accuracy']:.3f}")
    print(f"held-out accuracy after GRPO     : {summary['rl_final_accuracy']:.3f} "
          f"(best {summary['rl_best_accuracy']:.3f}, {summary['rl_steps']} RL steps)")
    print(f"curve: {figure or 'matplotlib not installed, no figure'}; summary: {out / 'summary.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
