"""What sleeping the native engine between RL steps costs: KV-cache release + re-allocation, alone and in a step.

Part 1: `KVCache.release()` + `allocate()` per step for three cache shapes (the CPU demo's, the native
default on the demo model, and a SmolLM2-135M-shaped cache at the native default), median of repeats.
Part 2: rl_step on 1 rank with the CPU demo's shape (1M-param Llama, 64 prompts x 8 samples x 5 tokens), arms
`rollout.sleep=none` and `kv_cache` + `actor.optim.offload` built side by side and stepped alternately;
median s/step and the offload/reload times. (Phase memory is not compared here: on CPU it is the process RSS,
shared by both arms and dominated by the imports at this size.) Writes benchmarks/results/memphase.json.
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

RESULTS = Path(__file__).resolve().parent / "results" / "memphase.json"
# (name, layers, kv heads, head_dim, slots, positions)
CACHES = [("demo_cpu (1M model, 512 x 24)", 4, 4, 32, 512, 24),
          ("demo model, native default (64 x 1024)", 4, 4, 32, 64, 1024),
          ("SmolLM2-135M shape, native default (64 x 1024)", 30, 3, 64, 64, 1024)]
ARMS = {"sleep none": ["rollout.sleep=none"], "sleep kv_cache + offload": ["rollout.sleep=kv_cache",
                                                                            "actor.optim.offload=true"]}


def kv_cycle_rows(repeats: int) -> list[dict]:
    from rlhf.rollout.native.kv_cache import KVCache

    rows = []
    for name, layers, heads, head_dim, slots, positions in CACHES:
        cache = KVCache(num_layers=layers, num_slots=slots, num_kv_heads=heads, max_seq_len=positions,
                        head_dim=head_dim, dtype=torch.float32, device=torch.device("cpu"))
        seconds = []
        for _ in range(repeats):
            start = time.perf_counter()
            cache.release()
            cache.allocate()
            seconds.append(time.perf_counter() - start)
        rows.append({"part": "kv_cycle", "cache": name, "mib": cache.num_bytes / 2**20,
                     "cycle_ms": 1e3 * statistics.median(seconds)})
    return rows


def _setup(root: Path) -> dict:
    from rlhf.data.char_tokenizer import build_char_tokenizer
    from rlhf.data.make import MakeConfig, make_dataset
    from rlhf.models.init import InitModelConfig, init_hf_model

    tokenizer = build_char_tokenizer()
    model = init_hf_model(InitModelConfig(hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=4,
                                          intermediate_size=512, max_position_embeddings=64), tokenizer,
                          root / "model")
    task = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}
    make_dataset(MakeConfig(task="chain_sum", num_samples=2048, seed=1, prompt_format="expression",
                            task_config=task), root / "train.jsonl")
    return {"model": str(model), "train": str(root / "train.jsonl")}


def _trainer(paths: dict, root: str, name: str, overrides: list[str], steps: int):
    from rlhf.config import from_dict
    from rlhf.orchestration.schema import RlhfConfig
    from rlhf.config.loader import apply_overrides
    from rlhf.run_dir import setup_run
    from rlhf.orchestration.loop import Trainer

    data = {"dist": {"backend": "gloo"}, "run": {"output_dir": root, "name": name},
            "model": {"path": paths["model"]},
            "data": {"train_files": [paths["train"]], "prompts_per_step": 64, "max_prompt_length": 16},
            "sampling": {"n": 8, "max_new_tokens": 5}, "reward": {"by_source": {"reasoning_gym/*": "reasoning_gym_exact"}},
            "actor": {"micro_batch_size": 128, "recompute_old_logprobs": False, "optim": {"lr": 2e-4}},
            "rollout": {"native": {"max_batch_size": 512, "max_seq_len": 24}},
            "trainer": {"total_steps": steps + 1, "tensorboard": False}}
    cfg = from_dict(RlhfConfig, apply_overrides(data, overrides))
    return Trainer(cfg, setup_run(cfg.run, cfg))


def step_rows(root: str, steps: int) -> list[dict]:
    """Collective body (1 rank): both arms built, then stepped alternately; the first step of each is warm-up."""
    paths = _setup(Path(root))
    trainers = {arm: _trainer(paths, root, arm.replace(" ", "_"), overrides, steps)
                for arm, overrides in ARMS.items()}
    seconds: dict[str, list[float]] = {arm: [] for arm in ARMS}
    last: dict[str, dict] = {}
    for index in range(1, steps + 1):
        for arm, trainer in trainers.items():
            start = time.perf_counter()
            last[arm] = trainer.boundary.reduce(trainer.run_step(index))
            if index > 1:
                seconds[arm].append(time.perf_counter() - start)
    return [{"part": "rl_step", "arm": arm, "s_per_step": statistics.median(seconds[arm]),
             **{k: v for k, v in last[arm].items() if k in ("timing_s/offload", "timing_s/reload")}}
            for arm in ARMS]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from rlhf.testing.distributed import run_distributed

    rows = kv_cycle_rows(args.repeats)
    with tempfile.TemporaryDirectory() as root:
        rows += run_distributed(step_rows, 1, root, args.steps, timeout_s=1800)[0]
    for row in rows:
        print("  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
    steps = {row["arm"]: row["s_per_step"] for row in rows if row["part"] == "rl_step"}
    kv = {row["cache"]: row["cycle_ms"] for row in rows if row["part"] == "kv_cycle"}
    summary = {"demo_step_overhead_ratio": steps["sleep kv_cache + offload"] / steps["sleep none"],
               "kv_cycle_ms_demo": kv[CACHES[0][0]], "kv_cycle_ms_smollm2_shape": kv[CACHES[2][0]]}
    print(json.dumps(summary, indent=1))
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps({"name": "memphase", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                                   "machine": machine_info(), "config": {"repeats": args.repeats, "steps": args.steps,
                                                                         "arms": ARMS}, "rows": rows,
                                   "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
