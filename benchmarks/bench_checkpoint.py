"""Bytes per checkpoint and save / verified-load time at DP1 and DP2, plain and distributed optimizer.

rlhf (model and replicated optimizer written once across DP, rank files hold only rank-own state) against the
previous format (every rank `torch.save`s its whole state to a file and fsyncs it: model + optimizer + RNG),
measured on the same trainer state. rlhf's save also hashes every file and commits the manifest. A 4-layer, hidden-256 Llama (char vocab), GRPO, one step then the checkpoint. Medians of
`--repeats` saves and loads. Writes benchmarks/results/checkpoint.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _machine import machine_info  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "checkpoint.json"


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


def _trainer(paths: dict, root: str, distributed_optimizer: bool):
    from rlhf.config import RlhfConfig, from_dict
    from rlhf.run_dir import setup_run
    from rlhf.trainer.loop import Trainer

    cfg = from_dict(RlhfConfig, {
        "dist": {"backend": "gloo"}, "run": {"output_dir": root, "name": f"distopt{int(distributed_optimizer)}"},
        "model": {"path": paths["model"]},
        "data": {"train_files": [paths["train"]], "prompts_per_step": 4, "max_prompt_length": 16},
        "sampling": {"n": 2, "max_new_tokens": 4},
        "reward": {"by_source": {"reasoning_gym/*": "reasoning_gym_exact"}},
        "actor": {"micro_batch_size": 4, "optim": {"use_distributed_optimizer": distributed_optimizer}},
        "rollout": {"native": {"max_batch_size": 8, "max_seq_len": 24}},
        "trainer": {"total_steps": 1, "tensorboard": False, "val_before_train": False},
        "checkpoint": {"every": 1, "keep_last": 1}})
    return Trainer(cfg, setup_run(cfg.run, cfg))


def _median_s(call, repeats: int) -> float:
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def _old_save(state: dict, path: Path) -> None:
    """The previous format: this rank's whole state pickled by `torch.save`, fsynced."""
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


def arm_rows(root: str, repeats: int) -> list[dict]:
    """Collective body: per optimizer kind, the bytes and times of rlhf's checkpoint and the old format's."""
    import torch.distributed as dist

    from rlhf.checkpoint import read_manifest
    from rlhf.checkpoint_verify import all_gather_json

    paths = _setup(Path(root) / "setup")  # rank 0 writes the model folder
    dist.barrier()
    rows = []
    for distributed_optimizer in (False, True):
        trainer = _trainer(paths, root, distributed_optimizer)
        trainer.fit()
        state, replicated, manager = trainer._state(1), trainer._replicated(), trainer.checkpoints
        save_s = _median_s(lambda: manager.save(1, state, meta=trainer._meta(), replicated=replicated), repeats)
        path = manager.root / "step_1"
        load_s = _median_s(lambda: manager.load(path, replicated=replicated), repeats)
        old = Path(root) / f"old_rank{dist.get_rank()}.pt"
        old_save_s = _median_s(lambda: _old_save(state, old), repeats)
        old_bytes = sum(all_gather_json(old.stat().st_size))
        files = read_manifest(path)["files"]
        rows.append({"dp": dist.get_world_size(), "distributed_optimizer": distributed_optimizer,
                     "rlhf_bytes": sum(entry["size"] for entry in files.values()), "old_bytes": old_bytes,
                     "rlhf_files": len(files), "rlhf_save_s": save_s, "rlhf_verified_load_s": load_s,
                     "old_save_s_per_rank": old_save_s})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from rlhf.testing.distributed import run_distributed

    rows = []
    for world in (1, 2):
        with tempfile.TemporaryDirectory() as root:
            rows += run_distributed(arm_rows, world, root, args.repeats, timeout_s=1800)[0]
    for row in rows:
        print("  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
    by = {(row["dp"], row["distributed_optimizer"]): row for row in rows}
    summary = {f"bytes_ratio_old_over_rlhf_dp2_{kind}": by[(2, flag)]["old_bytes"] / by[(2, flag)]["rlhf_bytes"]
               for kind, flag in (("plain", False), ("distopt", True))}
    summary.update({f"rlhf_bytes_dp2_over_dp1_{kind}": by[(2, flag)]["rlhf_bytes"] / by[(1, flag)]["rlhf_bytes"]
                    for kind, flag in (("plain", False), ("distopt", True))})
    print(json.dumps(summary, indent=1))
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps({"name": "checkpoint", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                                   "machine": machine_info(), "config": {"repeats": args.repeats, "model":
                                                                         "llama h256 l4 i1024 char vocab"},
                                   "rows": rows, "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
