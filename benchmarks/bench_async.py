"""Step time of one-step-off async RL vs the synchronous loop, on 2 ranks (1 rollout + 1 train, one thread each).

Split placement: rank 0 holds the actor, rank 1 the native rollout engine. Synchronous, each rank idles while
the other works; one-step-off, rank 1 generates batch k+1 while rank 0 updates on batch k, so a step costs
max(gen, train) + exchange + weight push instead of their sum. Four shapes: the tiny test model, the CPU demo's
1M-parameter model, that model with 40-token responses, and a generation-heavy one (few long rollouts). Each
with two PPO anchors: old logprobs recomputed by the actor (a training-side forward per step) or the rollout's
own logprobs (rollout_correction.bypass_mode). Both arms are built side by side in one 2-rank world and
stepped alternately; the first steps (warm-up, async pipeline fill) are dropped; medians. Writes
benchmarks/results/async.json with summary `async_vs_sync` (sync s/step over async s/step on the tiny shape,
recomputed anchor: > 1 means async is faster) and `async_vs_sync_<shape>[_rollout_anchor]` for the others.
Learning curves at equal steps: the tiny model on a dense digit-share reward, and the CPU demo's task from its
SFT policy (exact-match reward, held-out accuracy before and after). Curves do not depend on the machine's load;
a part not run this time (`--shapes` with none, `--curve-steps 0`) keeps the last run's figures and date.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _machine import machine_info  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "async.json"
# name -> (model dims, data/sampling/actor overrides)
SHAPES = {
    "tiny": (dict(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64),
             {"prompts_per_step": 8, "n": 4, "max_new_tokens": 48, "micro_batch_size": 32}),
    "demo": (dict(hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=4, intermediate_size=512),
             {"prompts_per_step": 64, "n": 8, "max_new_tokens": 5, "micro_batch_size": 128}),
    # the demo model with long responses: generation and training take similar time, the case async is for
    "demo_long": (dict(hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=4, intermediate_size=512),
                  {"prompts_per_step": 16, "n": 8, "max_new_tokens": 40, "micro_batch_size": 128}),
    # generation-heavy: few long rollouts, so one side's work no longer dwarfs the other's
    "demo_gen": (dict(hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=4, intermediate_size=512),
                 {"prompts_per_step": 2, "n": 2, "max_new_tokens": 160, "micro_batch_size": 4}),
}
ARMS = {"sync": "off", "async": "one_step_off"}
# PPO's anchor: the actor recomputes old logprobs (a forward on the training side every step, as verl's
# one-step-off), or the rollout's own logprobs are the anchor (rollout_correction.bypass_mode: no forward)
ANCHORS = {"recompute": {}, "rollout": {"rollout_correction": {"bypass_mode": True, "rollout_is": None}}}
PHASES = ("gen", "old_log_prob", "update_actor", "gather", "update_weights")


def _setup(root: Path, dims: dict) -> dict:
    from rlhf.data.char_tokenizer import build_char_tokenizer
    from rlhf.data.make import MakeConfig, make_dataset
    from rlhf.models.init import InitModelConfig, init_hf_model

    model = init_hf_model(InitModelConfig(max_position_embeddings=64, **dims), build_char_tokenizer(),
                          root / "model")
    task = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}
    make_dataset(MakeConfig(task="chain_sum", num_samples=2048, seed=1, prompt_format="expression",
                            task_config=task), root / "train.jsonl")
    return {"model": str(model), "train": str(root / "train.jsonl")}


# The learning-curve reward: the share of digits in the response (dense, so a random tiny model learns it).
DIGITS_REWARD = "def score(data_source, solution, ground_truth, extra_info):\n" \
                "    return sum(c.isdigit() for c in solution) / max(len(solution), 1)\n"


def _trainer(paths: dict, root: str, name: str, shape: dict, async_mode: str, steps: int,
             reward: str | None = None, anchor: str = "recompute"):
    from rlhf.config import from_dict
    from rlhf.orchestration.schema import RlhfConfig
    from rlhf.run_dir import setup_run
    from rlhf.orchestration.loop import Trainer

    batch = shape["prompts_per_step"] * shape["n"]
    data = {"dist": {"backend": "gloo"}, "run": {"output_dir": root, "name": name},
            "model": {"path": paths["model"]},
            "mesh": {"placement": "split", "actor": {"ranks": [0, 1]}, "rollout": {"ranks": [1, 2]}},
            "data": {"train_files": [paths["train"]], "prompts_per_step": shape["prompts_per_step"],
                     "max_prompt_length": 16},
            "sampling": {"n": shape["n"], "max_new_tokens": shape["max_new_tokens"], "ignore_eos": True},
            "reward": ({"function": f"{reward}:score"} if reward else
                       {"by_source": {"reasoning_gym/*": "reasoning_gym_exact"}}),
            "actor": {"micro_batch_size": shape["micro_batch_size"], "optim": {"lr": 2e-4}},
            "algo": ANCHORS[anchor],
            "rollout": {"native": {"max_batch_size": batch, "max_seq_len": 16 + shape["max_new_tokens"]}},
            "trainer": {"total_steps": steps, "tensorboard": False, "async_mode": async_mode}}
    cfg = from_dict(RlhfConfig, data)
    return Trainer(cfg, setup_run(cfg.run, cfg))


def shape_rows(root: str, shape_name: str, anchor: str, steps: int, warmup: int) -> list[dict]:
    """Collective body (2 ranks): both arms built, then stepped alternately; rank 0's wall times."""
    dims, shape = SHAPES[shape_name]
    paths = _setup(Path(root) / f"{shape_name}_{anchor}", dims)
    trainers = {arm: _trainer(paths, root, f"{shape_name}_{anchor}_{arm}", shape, mode, steps, anchor=anchor)
                for arm, mode in ARMS.items()}
    seconds: dict[str, list[float]] = {arm: [] for arm in ARMS}
    phases: dict[str, dict[str, list[float]]] = {arm: {p: [] for p in PHASES} for arm in ARMS}
    for step in range(1, steps + 1):
        for arm, trainer in trainers.items():
            start = time.perf_counter()
            values = trainer.boundary.reduce(trainer.run_step(step))
            if step > warmup:
                seconds[arm].append(time.perf_counter() - start)
                for phase in PHASES:
                    phases[arm][phase].append(values.get(f"timing_s/{phase}", 0.0))
    return [{"shape": shape_name, "anchor": anchor, "arm": arm, "s_per_step": statistics.median(seconds[arm]),
             **{f"{phase}_s": statistics.median(phases[arm][phase]) for phase in PHASES}} for arm in ARMS]


def curve_rows(root: str, steps: int) -> list[dict]:
    """Collective body (2 ranks): sync and async GRPO on the tiny shape with the digits reward, step by step."""
    dims, shape = SHAPES["tiny"]
    paths = _setup(Path(root) / "curve", dims)
    reward = Path(root) / "digits_reward.py"
    reward.write_text(DIGITS_REWARD)
    trainers = {arm: _trainer(paths, root, f"curve_{arm}", shape, mode, steps, str(reward))
                for arm, mode in ARMS.items()}
    rows = []
    for step in range(1, steps + 1):
        row = {"step": step}
        for arm, trainer in trainers.items():
            row[f"{arm}_reward"] = trainer.boundary.reduce(trainer.run_step(step))["critic/score/mean"]
        rows.append(row)
    return rows


def summary_key(shape: str, anchor: str) -> str:
    """async_vs_sync for the tiny shape with recomputed old logprobs; suffixes name the others."""
    return "async_vs_sync" + ("" if shape == "tiny" else f"_{shape}") + ("" if anchor == "recompute" else
                                                                         f"_{anchor}_anchor")


VAL_KEY = "val/score/mean@1"  # held-out accuracy (greedy, exact match)
DEMO_TASK = {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 2}  # launch/demo.sh's chain_sum


def _sft_demo_policy(root: Path) -> dict:
    """Collective body (2 ranks): the CPU demo's data, model and 300-step SFT policy (launch/demo.sh's stages)."""
    from rlhf.cli.main import main
    from rlhf.data.char_tokenizer import build_char_tokenizer
    from rlhf.data.make import MakeConfig, make_dataset
    from rlhf.models.init import InitModelConfig, init_hf_model

    paths = {name: str(root / f"{name}.jsonl") for name in ("rl", "sft", "val")}
    if torch.distributed.get_rank() == 0:
        init_hf_model(InitModelConfig(max_position_embeddings=64, **SHAPES["demo"][0]), build_char_tokenizer(),
                      root / "model0")
        for name, count, seed in (("rl", 10000, 1), ("sft", 2000, 20000000), ("val", 500, 10000000)):
            make_dataset(MakeConfig(task="chain_sum", num_samples=count, seed=seed, prompt_format="expression",
                                    task_config=DEMO_TASK, exclude=[paths["rl"], paths["sft"]] if name == "val" else []), Path(paths[name]))
    torch.distributed.barrier()
    config = Path(__file__).resolve().parents[1] / "configs" / "demo_cpu.yaml"
    assert main(["sft", "--config", str(config), f"run.output_dir={root}", "run.name=sft",
                 f"model.path={root / 'model0'}", f"data.train_files=[{paths['sft']}]",
                 f"data.val_files=[{paths['val']}]", f"sft.out_dir={root / 'sft_model'}", "actor.optim.lr=3.0e-3",
                 "actor.optim.warmup_steps=20", "actor.micro_batch_size=64"]) == 0
    return {"model": str(root / "sft_model"), "train": paths["rl"], "val": paths["val"]}


def demo_curve_rows(root: str, steps: int) -> list[dict]:
    """Collective body (2 ranks): sync and async GRPO on the CPU demo's task from its SFT policy, exact-match
    reward, stepped alternately; held-out accuracy before and after."""
    import yaml

    from rlhf.config import from_dict
    from rlhf.orchestration.loop import Trainer
    from rlhf.orchestration.schema import RlhfConfig
    from rlhf.run_dir import setup_run

    paths = _sft_demo_policy(Path(root) / "demo_curve")
    base = yaml.safe_load((Path(__file__).resolve().parents[1] / "configs" / "demo_cpu.yaml").read_text())
    trainers = {}
    for arm, mode in ARMS.items():
        data = {**base, "dist": {"backend": "gloo"}, "run": {"output_dir": root, "name": f"demo_curve_{arm}"},
                "model": {"path": paths["model"]},
                "mesh": {"placement": "split", "actor": {"ranks": [0, 1]}, "rollout": {"ranks": [1, 2]}},
                "data": {**base["data"], "train_files": [paths["train"]], "val_files": [paths["val"]]},
                "trainer": {"total_steps": steps, "tensorboard": False, "async_mode": mode}}
        cfg = from_dict(RlhfConfig, data)
        trainers[arm] = Trainer(cfg, setup_run(cfg.run, cfg))
        trainers[arm].push_initial_weights()
    rows = [{"step": 0, **{f"{arm}_val": t.validate(0).get(VAL_KEY) for arm, t in trainers.items()}}]
    for step in range(1, steps + 1):
        row = {"step": step}
        for arm, trainer in trainers.items():
            row[f"{arm}_reward"] = trainer.boundary.reduce(trainer.run_step(step))["critic/score/mean"]
        rows.append(row)
    rows[-1].update({f"{arm}_val": t.validate(steps).get(VAL_KEY) for arm, t in trainers.items()})
    return rows


def _quarters(rows: list[dict], key: str) -> tuple[float, float]:
    quarter = max(len(rows) // 4, 1)
    return (statistics.mean(r[key] for r in rows[:quarter]), statistics.mean(r[key] for r in rows[-quarter:]))


def _summaries(parts: dict[str, list[dict]]) -> dict[str, dict]:
    """Each part's summary figures: step-time ratios; mean reward in the first and last quarter (equal steps)."""
    per_step = {(row["shape"], row["anchor"], row["arm"]): row["s_per_step"] for row in parts["rows"]}
    timed = {summary_key(shape, anchor): per_step[(shape, anchor, "sync")] / per_step[(shape, anchor, "async")]
             for shape, anchor, arm in per_step if arm == "sync"}
    curve, demo = {}, {}
    for arm in ARMS if parts["curve"] else ():
        curve[f"curve_{arm}_reward_first_quarter"], curve[f"curve_{arm}_reward_last_quarter"] = _quarters(
            parts["curve"], f"{arm}_reward")
    for arm in ARMS if parts["demo_curve"] else ():
        first, last = _quarters(parts["demo_curve"][1:], f"{arm}_reward")
        demo.update({f"demo_curve_{arm}_reward_first_quarter": first, f"demo_curve_{arm}_reward_last_quarter": last,
                     f"demo_curve_{arm}_val_before": parts["demo_curve"][0][f"{arm}_val"],
                     f"demo_curve_{arm}_val_after": parts["demo_curve"][-1][f"{arm}_val"]})
    return {"rows": timed, "curve": curve, "demo_curve": demo}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES),
                        help="shapes to time (none: keep the last run's step times)")
    parser.add_argument("--anchors", nargs="+", default=list(ANCHORS), choices=list(ANCHORS),
                        help="PPO anchors to time (both arms use the same one)")
    parser.add_argument("--curve-steps", type=int, default=120,
                        help="steps of the sync-vs-async learning curve (tiny shape, digits reward); 0: keep the "
                             "last run's")
    parser.add_argument("--demo-curve-steps", type=int, default=120,
                        help="steps of the sync-vs-async curve on the CPU demo's task from its SFT policy; 0: keep "
                             "the last run's")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from rlhf.testing.distributed import run_distributed

    parts: dict[str, list[dict]] = {"rows": [], "curve": [], "demo_curve": []}
    with tempfile.TemporaryDirectory() as root:
        for shape in args.shapes:
            for anchor in args.anchors:
                parts["rows"] += run_distributed(shape_rows, 2, root, shape, anchor, args.steps, args.warmup,
                                                 timeout_s=3600)[0]
        if args.curve_steps:
            parts["curve"] = run_distributed(curve_rows, 2, root, args.curve_steps, timeout_s=3600)[0]
        if args.demo_curve_steps:
            parts["demo_curve"] = run_distributed(demo_curve_rows, 2, root, args.demo_curve_steps, timeout_s=3600)[0]
    for row in parts["rows"]:
        print("  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
    now = datetime.datetime.now(datetime.timezone.utc).isoformat()
    previous = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    dates = {name: now for name, rows in parts.items() if rows}
    for name in [name for name, rows in parts.items() if not rows and previous.get("dates", {}).get(name)]:
        parts[name], dates[name] = previous[name], previous["dates"][name]  # not rerun: the last run's figures
    summary = {key: value for part in _summaries(parts).values() for key, value in part.items()}
    print(json.dumps(summary, indent=1))
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps({"name": "async", "date": now, "dates": dates, "machine": machine_info(),
                                   "config": {"steps": args.steps, "warmup": args.warmup,
                                              "ranks": "1 rollout + 1 train, 1 thread each", "anchors": ANCHORS,
                                              "shapes": SHAPES},
                                   **parts, "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
