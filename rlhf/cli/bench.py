"""`rlhf bench`: rollout tokens/s vs training tokens/s for a config, and what their ratio suggests."""

from __future__ import annotations

import argparse
import json

from rlhf.cli.common import add_config_args, config_from_args, diagnostic_config, run_in_world
from rlhf.cli.profile import check_steps


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("bench", help="rollout vs training throughput of a config")
    add_config_args(parser)
    parser.add_argument("--steps", type=int, default=3, help="timed steps (default 3)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first (default 1)")
    return parser


def advice(gen_over_train: float, placement: str) -> str:
    """What to change, from the time the step spends generating vs training and how the roles are placed."""
    if gen_over_train > 1.5:
        if placement == "split":
            return "rollout-bound: generation takes longer than training; give rollout more ranks (or a faster engine)"
        return ("rollout-bound: generation takes longer than training; every role already spans every rank, so "
                "try a faster engine (rollout.engine=vllm), a larger rollout.native.max_batch_size or mesh.rollout.tp")
    if gen_over_train < 1 / 1.5:
        if placement == "split":
            return "training-bound: training takes longer than generation; give the trained roles more ranks"
        return ("training-bound: training takes longer than generation; try a larger actor.micro_batch_size, "
                "model.recompute=false, or fewer actor.epochs / actor.mini_batches")
    return "balanced: generation and training take similar time"


def run(args: argparse.Namespace) -> int:
    check_steps(args.steps, args.warmup)
    cfg = diagnostic_config(config_from_args(args), "bench")  # config errors before torch is imported
    import torch.distributed as dist

    from rlhf.profiling.runner import run_profiled_steps, throughput
    from rlhf.orchestration.preflight import preflight

    def body(cfg, run_dir) -> None:
        profile = run_profiled_steps(cfg, run_dir, steps=args.steps, warmup=args.warmup, counters=False)
        if run_dir.is_rank0:
            rollouts = cfg.data.prompts_per_step * cfg.sampling.n
            result = throughput(profile.steps, rollouts, dist.get_world_size())
            result["advice"] = advice(result["gen_over_train_time"], cfg.mesh.placement)
            (run_dir.path / "bench.json").write_text(json.dumps(result, indent=1) + "\n")
            print(format_result(result))
            print(f"wrote {run_dir.path / 'bench.json'}")

    run_in_world(cfg, "bench", body, preflight)
    return 0


def format_result(r: dict) -> str:
    return "\n".join([
        f"{'':10} {'tokens/s':>10} {'s/step':>8}  (world {r['world_size']})",
        f"{'rollout':10} {r['rollout_tok_s']:10.0f} {r['gen_s']:8.3f}  ({r['generated_tokens_per_step']:.0f} generated)",
        f"{'training':10} {r['train_tok_s']:10.0f} {r['train_s']:8.3f}  ({r['total_tokens_per_step']:.0f} prompt+response)",
        f"rollout/training time ratio {r['gen_over_train_time']:.2f}: {r['advice']}"])
