"""Learning-curve figures from runs' metrics.jsonl: `curve.png` of every RL run (`trainer.plot`), and the demo's
before/after summary (SFT then RL, beside SFT continued for as many optimizer steps as RL: the equal-compute arm).

    python -m rlhf.orchestration.plot --rl runs/demo/grpo --out runs/demo [--sft runs/demo/sft] [--sft-more runs/demo/sft_more]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rlhf.metrics import read_jsonl

VAL = "val/score/mean@1"
REWARD = "critic/score/mean"
STEP_TIME = "timing_s/step"
# The run curve's panels: a title and the metrics it draws (those a run logged; KL is the loss term or the penalty).
RUN_PANELS = (("train reward", (REWARD,)), ("validation score", ("val/score/mean@",)),
              ("KL to the reference", ("actor/kl_loss", "actor/reward_kl_penalty")),
              ("response length (tokens)", ("response_length/mean",)))


def _arm(prefix: str, rows: list[dict]) -> dict:
    """One arm after the SFT policy: its validation curve, final and best accuracy, steps and step time."""
    val = [(r["step"], r[VAL]) for r in rows if VAL in r]
    return {f"{prefix}_val_curve": val, f"{prefix}_final_accuracy": val[-1][1] if val else None,
            f"{prefix}_best_accuracy": max(v for _, v in val) if val else None,
            f"{prefix}_steps": max((r["step"] for r in rows), default=0),
            f"{prefix}_step_time_s": sum(r.get(STEP_TIME, 0.0) for r in rows)}


def summarize(sft_rows: list[dict], rl_rows: list[dict], sft_more_rows: list[dict] = ()) -> dict:
    """The SFT policy's accuracy, then the RL arm's and (when run) the equal-compute SFT arm's."""
    sft_val = [(r["step"], r[VAL]) for r in sft_rows if VAL in r]
    rl_val = [(r["step"], r[VAL]) for r in rl_rows if VAL in r]
    summary = {"sft_val_curve": sft_val, "sft_only_accuracy": sft_val[-1][1] if sft_val else None,
               "rl_start_accuracy": rl_val[0][1] if rl_val else None, **_arm("rl", rl_rows)}
    if sft_more_rows:
        summary.update(_arm("sft_more", sft_more_rows))
    return summary


def _pyplot():
    """matplotlib's pyplot on the file-only backend, or None where matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def _series(rows: list[dict], prefixes: tuple[str, ...]) -> dict[str, list[tuple[int, float]]]:
    """Each logged metric whose name starts with one of `prefixes`, as (step, value) points."""
    names = sorted({k for r in rows for k in r if k.startswith(prefixes)})
    return {n: [(r["step"], r[n]) for r in rows if n in r] for n in names}


def plot_run(rows: list[dict], out: Path) -> Path | None:
    """out/curve.png of one RL run: train reward, validation, KL and response length per step (None: no matplotlib)."""
    plt = _pyplot()
    if plt is None:
        return None
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    for ax, (title, prefixes) in zip(axes.flat, RUN_PANELS):
        series = _series(rows, prefixes)
        for name, points in series.items():
            ax.plot(*zip(*points), "o-" if name.startswith("val/") else "-", label=name, markersize=3)
        if series:
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, "not logged by this run", ha="center", va="center", transform=ax.transAxes)
        ax.set(title=title, xlabel="RL step")
    fig.tight_layout()
    path = out / "curve.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot(sft_rows: list[dict], rl_rows: list[dict], out: Path, sft_more_rows: list[dict] = ()) -> Path | None:
    """curve.png: train reward per RL step, and held-out accuracy across SFT then RL steps (and then SFT steps
    of the equal-compute arm)."""
    plt = _pyplot()
    if plt is None:
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
    more_val = [(sft_steps + r["step"], r[VAL]) for r in sft_more_rows if VAL in r]
    if more_val:
        start = sft_val[-1:] if sft_val else []
        right.plot(*zip(*(start + more_val)), "s--", color="tab:green", label="SFT continued (same optimizer steps)")
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
    parser.add_argument("--sft", help="the SFT run before RL (its validation curve comes first)")
    parser.add_argument("--rl", required=True)
    parser.add_argument("--sft-more", help="SFT continued from the SFT policy for the RL run's optimizer steps")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    sft_rows = read_jsonl(Path(args.sft) / "metrics.jsonl") if args.sft else []
    rl_rows = read_jsonl(Path(args.rl) / "metrics.jsonl")
    more_rows = read_jsonl(Path(args.sft_more) / "metrics.jsonl") if args.sft_more else []
    out = Path(args.out)
    summary = summarize(sft_rows, rl_rows, more_rows)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    figure = plot(sft_rows, rl_rows, out, more_rows)
    if summary["sft_only_accuracy"] is not None:
        print(f"held-out accuracy after SFT only : {summary['sft_only_accuracy']:.3f}")
    if summary["rl_final_accuracy"] is not None:
        print(f"held-out accuracy after GRPO     : {summary['rl_final_accuracy']:.3f} "
              f"(best {summary['rl_best_accuracy']:.3f}, {summary['rl_steps']} RL steps, "
              f"{summary['rl_step_time_s']:.0f} s of steps)")
    if summary.get("sft_more_final_accuracy") is not None:
        print(f"held-out accuracy after more SFT : {summary['sft_more_final_accuracy']:.3f} "
              f"(best {summary['sft_more_best_accuracy']:.3f}, {summary['sft_more_steps']} more SFT steps, "
              f"{summary['sft_more_step_time_s']:.0f} s of steps)")
    print(f"curve: {figure or 'matplotlib not installed, no figure'}; summary: {out / 'summary.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
