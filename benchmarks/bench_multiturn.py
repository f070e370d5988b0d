"""Multi-turn rollouts vs single-turn at equal sampled tokens, and the share of rollout time the engine sits idle
waiting for tools, on 2 gloo ranks (colocated, dp2, native engine).

Three arms are built side by side in one 2-rank world and stepped alternately; each samples `turns x tokens`
tokens per trajectory (ignore_eos, so every arm samples exactly as many):
- `single`: one response of `turns x tokens` tokens (the ordinary GRPO step);
- `calculator`: an agent of `turns` turns of `tokens` tokens with a calculator call between them (in-process);
- `python`: the same with the Python tool between them (a resource-limited subprocess per call).
Multi-turn rows also hold the tool results' tokens (observations, not trained on), so their sequences are longer.
Rows: medians over the steps after warm-up of the step time, the generation phase, the engine's share of it and
`multiturn/engine_idle_share` (the share of the multi-turn phase the engine was not generating: tools,
rendering, scheduling). Writes benchmarks/results/multiturn.json; summary `single_vs_<arm>` is single-turn
s/step over the arm's (< 1: multi-turn is slower) and `idle_share_<arm>` its idle share.
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

RESULTS = Path(__file__).resolve().parent / "results" / "multiturn.json"
DIMS = dict(hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=4, intermediate_size=512)  # the CPU demo's
ARMS = ("single", "calculator", "python")

AGENT = '''
from rlhf.agents.tool_calls import ToolCall
from rlhf.agents.trajectory import Termination, TrajectoryBuilder

TURNS, TOKENS = {turns}, {tokens}
CALLS = {{"calculator": ("calculator", {{"expression": "6*7+1"}}), "python": ("python", {{"code": "print(6*7+1)"}})}}


async def _run(ctx, sample, tool):
    """TURNS turns of TOKENS sampled tokens, a `tool` call and its result between them."""
    messages = list(sample.prompt)
    builder = TrajectoryBuilder(prompt=ctx.renderer.prompt(messages), token_budget=ctx.limits.token_budget)
    for turn in range(TURNS):
        generation = await ctx.generate(builder.tokens, TOKENS)
        builder.add_sampled(generation.token_ids, generation.logprobs, generation.policy_version)
        if turn < TURNS - 1:
            name, arguments = CALLS[tool]
            result = await ctx.call_tool(ToolCall(name, arguments), {{}})
            messages.append({{"role": "assistant", "content": ctx.renderer.tokenizer.decode(generation.token_ids)}})
            ctx.advance(builder, messages, [{{"role": "tool", "content": result}}])
    return ctx.finish(builder, Termination.MAX_TURNS, TURNS)


async def calculator(ctx, sample):
    return await _run(ctx, sample, "calculator")


async def python(ctx, sample):
    return await _run(ctx, sample, "python")
'''


def _setup(root: Path, turns: int, tokens: int) -> dict:
    from rlhf.data.char_tokenizer import build_chat_char_tokenizer
    from rlhf.models.init import InitModelConfig, init_hf_model

    model = init_hf_model(InitModelConfig(max_position_embeddings=512, **DIMS), build_chat_char_tokenizer(),
                          root / "model")
    with open(root / "train.jsonl", "w") as f:
        for i in range(512):
            row = {"prompt": [{"role": "user", "content": f"{i}+{i % 7}"}], "data_source": "tool/sum",
                   "reward_model": {"ground_truth": str(i + i % 7)}}
            f.write(json.dumps(row) + "\n")
    (root / "agent.py").write_text(AGENT.format(turns=turns, tokens=tokens))
    (root / "tools.yaml").write_text("tools:\n  - class_name: calculator\n  - class_name: python\n")
    return {"model": str(model), "train": str(root / "train.jsonl"), "agent": str(root / "agent.py"),
            "tools": str(root / "tools.yaml")}


def _trainer(paths: dict, root: str, arm: str, args: argparse.Namespace):
    from rlhf.config import from_dict
    from rlhf.orchestration.loop import Trainer
    from rlhf.orchestration.schema import RlhfConfig
    from rlhf.run_dir import setup_run

    single = arm == "single"
    batch = args.prompts * args.n
    data = {"dist": {"backend": "gloo"}, "run": {"output_dir": root, "name": arm}, "model": {"path": paths["model"]},
            "data": {"train_files": [paths["train"]], "prompts_per_step": args.prompts, "max_prompt_length": 32},
            "sampling": {"n": args.n, "max_new_tokens": args.turns * args.tokens if single else args.tokens,
                         "ignore_eos": True},
            "reward": {"by_source": {"tool/*": "reasoning_gym_exact"}},
            "actor": {"micro_batch_size": batch // 2, "optim": {"lr": 1e-4}},
            "rollout": {"native": {"max_batch_size": batch, "max_seq_len": 512}},
            "multiturn": {} if single else {"enable": True, "agent": f"{paths['agent']}:{arm}",
                                            "tool_config": paths["tools"], "list_tools": False,
                                            "limits": {"token_budget": 480, "max_turns": args.turns}},
            "trainer": {"total_steps": args.steps, "tensorboard": False, "plot": False}}
    cfg = from_dict(RlhfConfig, data)
    return Trainer(cfg, setup_run(cfg.run, cfg))


def arm_rows(root: str, args: argparse.Namespace) -> list[dict]:
    """Collective body (2 ranks): every arm built, then stepped alternately; rank 0's wall times, medians."""
    paths = _setup(Path(root), args.turns, args.tokens) if torch.distributed.get_rank() == 0 else None
    torch.distributed.barrier()
    paths = paths or {name: str(Path(root) / file) for name, file in (
        ("model", "model"), ("train", "train.jsonl"), ("agent", "agent.py"), ("tools", "tools.yaml"))}
    trainers = {arm: _trainer(paths, root, arm, args) for arm in ARMS}
    seen: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    for step in range(1, args.steps + 1):
        for arm, trainer in trainers.items():
            start = time.perf_counter()
            values = trainer.boundary.reduce(trainer.run_step(step))
            if step > args.warmup:
                seen[arm].append({"s_per_step": time.perf_counter() - start, **values})
    rows = []
    for arm, steps in seen.items():
        median = lambda key: statistics.median(s.get(key, 0.0) for s in steps)  # noqa: E731
        rows.append({"arm": arm, "s_per_step": median("s_per_step"), "gen_s": median("timing_s/gen"),
                     "update_actor_s": median("timing_s/update_actor"),
                     "engine_idle_share": median("multiturn/engine_idle_share"),
                     "tool_latency_s_mean": median("multiturn/tool_latency_s_mean"),
                     "generate_calls": median("multiturn/generate_calls") if arm != "single" else 1.0,
                     "sampled_tokens_per_row": float(args.turns * args.tokens),
                     "tokens_per_step": median("perf/total_num_tokens")})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step")
    parser.add_argument("--n", type=int, default=4, help="trajectories per prompt")
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=16, help="sampled tokens per turn")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from rlhf.testing.distributed import run_distributed

    with tempfile.TemporaryDirectory() as root:
        rows = run_distributed(arm_rows, 2, root, args, timeout_s=3600)[0]
    for row in rows:
        print("  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
    by_arm = {row["arm"]: row for row in rows}
    summary = {}
    for arm in ARMS[1:]:
        summary[f"single_vs_{arm}"] = by_arm["single"]["s_per_step"] / by_arm[arm]["s_per_step"]
        summary[f"idle_share_{arm}"] = by_arm[arm]["engine_idle_share"]
    print(json.dumps(summary, indent=1))
    now = datetime.datetime.now(datetime.timezone.utc).isoformat()
    config = {key: getattr(args, key) for key in ("steps", "warmup", "prompts", "n", "turns", "tokens")}
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps({"name": "multiturn", "date": now, "machine": machine_info(),
                                   "config": config | {"model": DIMS, "world": 2, "placement": "colocated"},
                                   "rows": rows, "summary": summary}, indent=1) + "\n")


if __name__ == "__main__":
    main()
