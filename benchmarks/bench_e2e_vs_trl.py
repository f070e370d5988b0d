"""End-to-end GRPO step time: rlhf (1 rank, native rollout) vs TRL `GRPOTrainer` (CPU, no vLLM), one process.

Same weights, same prompts (reasoning-gym chain_sum), 8 prompts x 4 samples per step, 32 new tokens with EOS
suppressed, one optimizer step per batch, micro-batch = the whole batch. TRL runs `train()`; a callback hands
control to rlhf after every `--steps-per-round` TRL steps, so the two arms alternate under the same load.
Reports median s/step, generated tokens/s and TRL s/step / rlhf s/step; writes benchmarks/results/e2e.json
(rows of other models already in that file are kept, so `--model smollm2` adds its row).
`--bf16`: both arms in bf16 on a CPU with bf16 matmuls (AVX-512-BF16 / AMX): TRL with `bf16=True` (accelerate's
autocast, fp32 weights and AdamW), rlhf with `actor.optim.autocast=bfloat16` (fp32 master weights, grads and Adam)
and `rollout.dtype=bfloat16` (the native engine's bf16 copy of the weights); rollout correction off, as TRL has none
(the update's own logprobs are the old ones in both).
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
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _machine import machine_info  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "e2e.json"
PROMPTS, GROUP, NEW_TOKENS = 8, 4, 32


def tiny_model_folder(root: Path, **config_overrides) -> str:
    """Tiny Qwen2-style model (h64, 2 layers, 4 heads / 2 kv) over the char tokenizer, saved with it;
    `config_overrides` (e.g. max_position_embeddings) go into its saved config."""
    from rlhf.data.char_tokenizer import build_char_tokenizer
    from rlhf.testing.tiny_models import tiny_hf_model

    tokenizer = build_char_tokenizer()
    model = tiny_hf_model("qwen2", seed=0, vocab_size=len(tokenizer))
    model.config.update({**config_overrides, "bos_token_id": tokenizer.bos_token_id,
                         "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id})
    model.generation_config.update(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                   pad_token_id=tokenizer.pad_token_id)
    path = root / "tiny"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def model_folder(name: str, root: Path) -> str:
    if name == "smollm2":
        from rlhf.models.smollm2 import smollm2_hf_folder

        return str(smollm2_hf_folder())
    return tiny_model_folder(root)


def prompt_file(root: Path, count: int) -> Path:
    from rlhf.data.make import MakeConfig, make_dataset

    path = root / "prompts.jsonl"
    make_dataset(MakeConfig(task="chain_sum", num_samples=count, seed=1, prompt_format="expression",
                            task_config={"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 2}), path)
    return path


def init_world() -> None:
    """A 1-rank gloo world via a tcp:// address, so accelerate (TRL) still sees a plain single process."""
    from rlhf.testing.distributed import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)


class RlhfArm:
    """rlhf's Trainer driven one step (`Trainer.run_step`) at a time."""

    def __init__(self, model_path: str, prompts: Path, beta: float, lr: float, run_root: Path,
                 bf16: bool = False) -> None:
        from rlhf.config import from_dict
        from rlhf.orchestration.schema import RlhfConfig
        from rlhf.run_dir import setup_run
        from rlhf.orchestration.loop import Trainer
        from rlhf.orchestration.preflight import preflight

        cfg = from_dict(RlhfConfig, rlhf_config(model_path, prompts, beta, lr, run_root, bf16))
        preflight(cfg, 1)
        self.trainer = Trainer(cfg, setup_run(cfg.run, cfg, prefix="bench"))
        self.step_index = 0
        self.times: list[float] = []
        self.cpu_times: list[float] = []

    def run_steps(self, count: int) -> None:
        for _ in range(count):
            self.step_index += 1
            start, cpu_start = time.perf_counter(), time.process_time()
            self.trainer.run_step(self.step_index)
            self.times.append(time.perf_counter() - start)
            self.cpu_times.append(time.process_time() - cpu_start)


def rlhf_config(model_path: str, prompts: Path, beta: float, lr: float, run_root: Path, bf16: bool = False) -> dict:
    config = {
        "dist": {"backend": "gloo", "timeout_s": 600},
        "run": {"output_dir": str(run_root), "name": f"e2e_beta{beta}"},
        "model": {"path": model_path},
        "data": {"train_files": [str(prompts)], "prompts_per_step": PROMPTS, "max_prompt_length": 64},
        "sampling": {"n": GROUP, "max_new_tokens": NEW_TOKENS, "ignore_eos": True},
        "algo": {"advantage": {"kind": "grpo"}, "kl": {"coef": beta}},
        "reward": {"by_source": {"reasoning_gym/*": "reasoning_gym_exact"}},
        "actor": {"optim": {"lr": lr}, "micro_batch_size": PROMPTS * GROUP,
                  "recompute_old_logprobs": False},  # on-policy, as TRL with num_iterations=1
        "rollout": {"native": {"max_batch_size": PROMPTS * GROUP, "max_seq_len": 64 + NEW_TOKENS}},
        "trainer": {"total_steps": 10_000, "tensorboard": False, "val_before_train": False},
    }
    if bf16:
        config["actor"]["optim"]["autocast"] = "bfloat16"
        config["rollout"]["dtype"] = "bfloat16"
        config["algo"]["rollout_correction"] = {"enable": False}
    return config


def exact_reward(prompts, completions, ground_truth, **_) -> list[float]:
    return [float(c.strip() == g) for c, g in zip(completions, ground_truth)]


def trl_trainer(model_path: str, prompts: Path, beta: float, lr: float, out: Path, total_steps: int, callback,
                bf16: bool = False):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    rows = [json.loads(line) for line in prompts.read_text().splitlines()]
    data = Dataset.from_list([{"prompt": r["prompt"], "ground_truth": r["reward_model"]["ground_truth"]}
                              for r in rows])
    args = GRPOConfig(output_dir=str(out), use_cpu=True, bf16=bf16, beta=beta, learning_rate=lr,
                      num_generations=GROUP, per_device_train_batch_size=PROMPTS * GROUP,
                      gradient_accumulation_steps=1, num_iterations=1, max_completion_length=NEW_TOKENS,
                      generation_kwargs={"min_new_tokens": NEW_TOKENS}, temperature=1.0, max_steps=total_steps,
                      logging_steps=10_000, save_strategy="no", report_to="none", seed=0,
                      dataloader_num_workers=0)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    return GRPOTrainer(model=model, reward_funcs=exact_reward, args=args, train_dataset=data,
                       processing_class=AutoTokenizer.from_pretrained(model_path), callbacks=[callback])


def alternating_callback(rlhf: RlhfArm, steps_per_round: int):
    """Times each TRL optimizer step (excluding the rlhf work it triggers) and runs rlhf between rounds."""
    from transformers import TrainerCallback

    class Alternate(TrainerCallback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.cpu_times: list[float] = []
            self.resume, self.cpu_resume = 0.0, 0.0

        def on_train_begin(self, args, state, control, **kwargs):
            self.resume, self.cpu_resume = time.perf_counter(), time.process_time()

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(time.perf_counter() - self.resume)
            self.cpu_times.append(time.process_time() - self.cpu_resume)
            if state.global_step % steps_per_round == 0:
                rlhf.run_steps(steps_per_round)
            self.resume, self.cpu_resume = time.perf_counter(), time.process_time()

    return Alternate()


def bench_variant(model: str, beta: float, args, root: Path) -> dict:
    path = model_folder(model, root)
    total = args.rounds * args.steps_per_round + args.steps_per_round  # first round is warm-up
    prompts = prompt_file(root, PROMPTS * (total + 1))
    rlhf = RlhfArm(path, prompts, beta, args.lr, root / "runs", args.bf16)
    callback = alternating_callback(rlhf, args.steps_per_round)
    trl_trainer(path, prompts, beta, args.lr, root / "trl", total, callback, args.bf16).train()
    skip = args.steps_per_round
    rlhf_s, trl_s = statistics.median(rlhf.times[skip:]), statistics.median(callback.times[skip:])
    rlhf_cpu_s, trl_cpu_s = statistics.median(rlhf.cpu_times[skip:]), statistics.median(callback.cpu_times[skip:])
    tokens = PROMPTS * GROUP * NEW_TOKENS
    return {"model": model, "beta": beta, "dtype": "bf16" if args.bf16 else "fp32", "rlhf_ranks": 1,
            "rlhf_s_step": rlhf_s, "trl_s_step": trl_s,
            "rlhf_cpu_s_step": rlhf_cpu_s, "trl_cpu_s_step": trl_cpu_s, "trl_over_rlhf_cpu": trl_cpu_s / rlhf_cpu_s,
            "rlhf_gen_tok_s": tokens / rlhf_s, "trl_gen_tok_s": tokens / trl_s, "trl_over_rlhf": trl_s / rlhf_s,
            "rlhf_times_s": rlhf.times, "trl_times_s": callback.times, "rlhf_cpu_times_s": rlhf.cpu_times,
            "trl_cpu_times_s": callback.cpu_times, "load_avg_1m_end": os.getloadavg()[0]}


def summary_of(rows: list[dict]) -> dict:
    keys = {("tiny", False): "rlhf_vs_trl_tiny_beta0", ("tiny", True): "rlhf_vs_trl_tiny_beta",
            ("smollm2", False): "rlhf_vs_trl_smollm2", ("smollm2", True): "rlhf_vs_trl_smollm2_beta"}
    return {keys[(r["model"], r["beta"] > 0)] + ("_bf16" if r.get("dtype") == "bf16" else ""): r["trl_over_rlhf"]
            for r in rows}


def print_table(rows: list[dict]) -> None:
    print(f"{'model':8} {'beta':>5} {'rlhf s/step':>12} {'TRL s/step':>11} {'rlhf tok/s':>11} {'TRL tok/s':>10} "
          f"{'TRL/rlhf':>9} {'(cpu)':>6} {'load':>5}")
    for r in rows:
        print(f"{r['model']:8} {r['beta']:5.2f} {r['rlhf_s_step']:12.3f} {r['trl_s_step']:11.3f} "
              f"{r['rlhf_gen_tok_s']:11.0f} {r['trl_gen_tok_s']:10.0f} {r['trl_over_rlhf']:8.2f}x "
              f"{r.get('trl_over_rlhf_cpu', float('nan')):5.2f}x {r['load_avg_1m_end']:5.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="tiny", choices=["tiny", "smollm2"])
    parser.add_argument("--betas", type=float, nargs="+", default=None, help="default: 0 0.04 (tiny), 0 (smollm2)")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds after one warm-up round")
    parser.add_argument("--steps-per-round", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--bf16", action="store_true", help="both arms in bf16 (see the module docstring)")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    betas = args.betas if args.betas is not None else ([0.0, 0.04] if args.model == "tiny" else [0.0])
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    init_world()
    machine = machine_info()
    with tempfile.TemporaryDirectory() as workdir:
        new_rows = [bench_variant(args.model, beta, args, Path(workdir) / f"b{beta}") for beta in betas]
    out = Path(args.out)
    old = json.loads(out.read_text()) if out.exists() else {"rows": []}
    rows = [r for r in old["rows"] if r["model"] != args.model] + new_rows
    print_table(rows)
    result = {"name": "e2e", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": machine, "config": {"prompts_per_step": PROMPTS, "group_size": GROUP,
                                             "new_tokens": NEW_TOKENS, "ignore_eos": True, **vars(args)},
              "rows": rows, "summary": summary_of(rows)}
    print(json.dumps(result["summary"], indent=1))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
