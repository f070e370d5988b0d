"""Checkpoint cost: bytes per checkpoint at DP1/DP2/DP4, save and verified-load time, the step-time cost of a
checkpoint every step (none vs sync vs async_save, at DP2), and the resume time of SmolLM2-135M on 2 ranks.

A 4-layer, hidden-256 Llama (char vocab), GRPO, plain and distributed optimizer: weights and Adam moments are
stored once as full tensors (model + 2 moments = 3x the fp32 model, whatever the DP size). Medians of
`--repeats`. Resume: a fresh 2-rank launch resumes a SmolLM2 checkpoint; launch -> first new step done (wall
clock, processes started by the harness). Writes benchmarks/results/checkpoint.json.
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

from rlhf.profiling.ops import median_seconds  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "checkpoint.json"
STEPS = 4  # per timed fit, for the step-time cost


def _setup(root: Path) -> dict:
    from rlhf.data.char_tokenizer import build_char_tokenizer
    from rlhf.data.make import MakeConfig, make_dataset
    from rlhf.models.init import InitModelConfig, init_hf_model

    model = init_hf_model(InitModelConfig(hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=4,
                                          intermediate_size=1024, max_position_embeddings=64),
                          build_char_tokenizer(), root / "model")
    task = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
    make_dataset(MakeConfig(task="chain_sum", num_samples=64, seed=1, prompt_format="expression",
                            task_config=task), root / "train.jsonl")
    return {"model": str(model), "train": str(root / "train.jsonl")}


def _config(paths: dict, root: str, name: str, *, distributed_optimizer: bool = False, steps: int = 1,
            checkpoint: dict | None = None, sampling: dict | None = None):
    from rlhf.config import from_dict
    from rlhf.orchestration.schema import RlhfConfig

    return from_dict(RlhfConfig, {
        "dist": {"backend": "gloo"}, "run": {"output_dir": root, "name": name},
        "model": {"path": paths["model"]},
        "data": {"train_files": [paths["train"]], "prompts_per_step": 8, "max_prompt_length": 16},
        "sampling": sampling or {"n": 2, "max_new_tokens": 4},
        "reward": {"by_source": {"reasoning_gym/*": "reasoning_gym_exact"}},
        "actor": {"micro_batch_size": 4, "optim": {"use_distributed_optimizer": distributed_optimizer}},
        "rollout": {"native": {"max_batch_size": 16, "max_seq_len": 48}},
        "trainer": {"total_steps": steps, "tensorboard": False, "val_before_train": False},
        "checkpoint": checkpoint or {"every": 1, "keep_last": 1}})


def _trainer(cfg):
    from rlhf.run_dir import setup_run
    from rlhf.orchestration.loop import Trainer

    return Trainer(cfg, setup_run(cfg.run, cfg))


def size_rows(root: str, repeats: int) -> list[dict]:
    """Collective body: per optimizer kind, the bytes of one checkpoint and its save / verified-load time."""
    import torch.distributed as dist

    from rlhf.checkpoint import read_manifest, tensor_folders

    paths = _setup(Path(root) / "setup")  # rank 0 writes the model folder
    dist.barrier()
    rows = []
    for distributed_optimizer in (False, True):
        trainer = _trainer(_config(paths, root, f"distopt{int(distributed_optimizer)}",
                                   distributed_optimizer=distributed_optimizer))
        trainer.fit()
        checkpoints = trainer.checkpoints
        manager = checkpoints.manager
        save_s = median_seconds(lambda: manager.save(1, checkpoints.state(1), meta=checkpoints.meta(),
                                                tensors=checkpoints.tensors()), repeats)
        path = manager.root / "step_1"

        def load():
            state, manifest = manager.load(path)
            trainer.train_side.actor.load_state_dict(state["actor"], tensor_folders(path, manifest, "actor"))

        load_s = median_seconds(load, repeats)
        files = read_manifest(path)["files"]
        rows.append({"dp": dist.get_world_size(), "distributed_optimizer": distributed_optimizer,
                     "bytes": sum(entry["size"] for entry in files.values()), "files": len(files),
                     "hf_model_bytes": (Path(paths["model"]) / "model.safetensors").stat().st_size,
                     "save_s": save_s, "verified_load_s": load_s})
    return rows


def step_cost_rows(root: str, repeats: int) -> list[dict]:
    """Collective body: wall time per step of `STEPS`-step fits with no checkpoint, sync and async every step
    (alternating, medians; the last step's save is always sync, so it is left out of every arm)."""
    import torch.distributed as dist

    paths = _setup(Path(root) / "setup")
    dist.barrier()
    arms = {"none": {"every": 0, "save_at_end": False}, "sync": {"every": 1, "keep_last": 1},
            "async": {"every": 1, "keep_last": 1, "async_save": True}}
    seconds: dict[str, list[float]] = {arm: [] for arm in arms}
    for repeat in range(repeats):
        for arm, checkpoint in arms.items():
            cfg = _config(paths, root, f"{arm}{repeat}", steps=STEPS, distributed_optimizer=True,
                          checkpoint={**checkpoint, "save_at_end": False})
            trainer = _trainer(cfg)
            start = time.perf_counter()
            trainer.fit()
            seconds[arm].append((time.perf_counter() - start) / STEPS)
    step_s = {arm: statistics.median(values) for arm, values in seconds.items()}
    return [{"dp": dist.get_world_size(), "arm": arm, "step_s": step_s[arm],
             "checkpoint_cost_s": step_s[arm] - step_s["none"]} for arm in arms]


def _smollm2_paths(root: Path) -> dict:
    from rlhf.data.make import MakeConfig, make_dataset
    from rlhf.models.smollm2 import smollm2_hf_folder

    task = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
    make_dataset(MakeConfig(task="chain_sum", num_samples=64, seed=1, prompt_format="expression",
                            task_config=task), root / "train.jsonl")
    return {"model": str(smollm2_hf_folder()), "train": str(root / "train.jsonl")}


def _smollm2_train(paths: dict, root: str, steps: int, resume: bool) -> dict:
    """Collective body: a SmolLM2 GRPO run to `steps` (a checkpoint at every step); wall clock marks."""
    started = time.time()
    cfg = _config(paths, root, "smollm2", steps=steps, sampling={"n": 2, "max_new_tokens": 8},
                  checkpoint={"every": 0 if resume else 1, "keep_last": 1, "resume": "auto" if resume else "none",
                              "save_at_end": not resume})
    trainer = _trainer(cfg)
    built = time.time()
    load = trainer.checkpoints.resume
    marks = {}

    def timed_resume() -> int:
        start = time.perf_counter()
        step = load()
        marks["resume_s"] = time.perf_counter() - start
        return step

    trainer.checkpoints.resume = timed_resume
    history = trainer.fit()
    return {"started": started, "built": built, "done": time.time(), "steps": [row["step"] for row in history],
            "step_s": history[-1]["timing_s/step"], **marks}


def resume_row() -> dict:
    """SmolLM2 on 2 ranks: train one step (checkpointed), then a fresh launch resumes and runs step 2."""
    from rlhf.checkpoint import read_manifest
    from rlhf.testing.distributed import run_distributed

    with tempfile.TemporaryDirectory() as root:
        paths = _smollm2_paths(Path(root))
        run_distributed(_smollm2_train, 2, paths, root, 1, False, timeout_s=1800)
        manifest = read_manifest(Path(root) / "smollm2" / "checkpoints" / "step_1")
        launched = time.time()
        marks = run_distributed(_smollm2_train, 2, paths, root, 2, True, timeout_s=1800)[0]
    assert marks["steps"] == [2], marks
    return {"model": "SmolLM2-135M", "ranks": 2, "checkpoint_bytes": sum(e["size"] for e in manifest["files"].values()),
            "launch_to_first_new_step_s": marks["done"] - launched, "launch_to_python_s": marks["started"] - launched,
            "build_s": marks["built"] - marks["started"], "resume_s": marks["resume_s"],
            "resume_and_step_s": marks["done"] - marks["built"], "step_s": marks["step_s"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--skip-resume", action="store_true", help="leave out the SmolLM2 resume time")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from rlhf.testing.distributed import run_distributed

    rows = []
    for world in args.worlds:
        with tempfile.TemporaryDirectory() as root:
            rows += run_distributed(size_rows, world, root, args.repeats, timeout_s=1800)[0]
    with tempfile.TemporaryDirectory() as root:
        cost = run_distributed(step_cost_rows, 2, root, args.repeats, timeout_s=1800)[0]
    resume = [] if args.skip_resume else [resume_row()]
    for row in rows + cost + resume:
        print("  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
    by = {(row["dp"], row["distributed_optimizer"]): row for row in rows}
    summary = {f"bytes_dp{world}_{kind}": by[(world, flag)]["bytes"] for world in args.worlds
               for kind, flag in (("plain", False), ("distopt", True))}
    summary.update({f"step_checkpoint_cost_s_{row['arm']}": row["checkpoint_cost_s"] for row in cost[1:]})
    summary.update({key: row[key] for row in resume for key in ("launch_to_first_new_step_s", "resume_s")})
    print(json.dumps(summary, indent=1))
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps({"name": "checkpoint", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                                   "machine": machine_info(), "config": {"repeats": args.repeats, "steps": STEPS,
                                                                         "model": "llama h256 l4 i1024 char vocab"},
                                   "rows": rows + cost + resume, "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
