"""`rlhf plan --world N`: lay a job out for N ranks on this one host (fake process groups) and report this
rank's meshes, memory per role (state and activations at `--seq-len`) and weight-sync plan, before anyone
books N GPUs; `--fit` lists the layouts of N ranks whose training roles fit `--memory-gib` per device."""

from __future__ import annotations

import argparse
import json

from rlhf.cli.common import add_config_args, config_from_args
from rlhf.errors import ConfigError


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("plan", help="dry run at a given world size: meshes, memory, weight-sync plan")
    add_config_args(parser)
    parser.add_argument("--world", type=int, required=True, help="number of ranks to plan for")
    parser.add_argument("--as-rank", type=int, default=0, help="report from this rank's point of view (default 0)")
    parser.add_argument("--seq-len", type=int, default=None,
                        help="response length to plan activations for (default: sampling.max_new_tokens; rows are "
                             "data.max_prompt_length + this; auto token budgets are sized for it)")
    parser.add_argument("--memory-gib", type=float, default=None, help="memory per device to check the peak against")
    parser.add_argument("--recompute", default=None,
                        help="plan the trained roles with none, full or selective recompute (default: the config's)")
    parser.add_argument("--sequence-parallel", action="store_true", help="plan with sequence parallelism on")
    parser.add_argument("--fit", action="store_true",
                        help="list every tp x cp x pp x dp layout of --world ranks and whether it fits --memory-gib")
    parser.add_argument("--json", default=None, help="also write the report to this JSON file")
    return parser


def run(args: argparse.Namespace) -> int:
    if args.world < 1 or not 0 <= args.as_rank < args.world:
        raise ConfigError(f"--world={args.world} must be >= 1 and --as-rank={args.as_rank} in "
                          f"[0, {args.world})")
    if args.seq_len is not None and args.seq_len < 1:
        raise ConfigError(f"--seq-len={args.seq_len} must be >= 1 (response tokens to plan for)")
    if args.memory_gib is not None and not args.memory_gib > 0:
        raise ConfigError(f"--memory-gib={args.memory_gib:g} must be > 0 (GiB per device)")
    if args.fit and args.memory_gib is None:
        raise ConfigError("--fit needs --memory-gib (the memory per device the layouts must fit)")
    if args.seq_len is not None:  # the planned rows are the run's longest, so `auto` budgets are sized for them
        args.overrides = [*args.overrides, f"sampling.max_new_tokens={args.seq_len}"]
    cfg = config_from_args(args)  # config errors come before torch and megatron are imported
    from rlhf.profiling.dry_run import MemoryPlan, dry_run, fit_layouts, format_fit, format_report
    from rlhf.orchestration.preflight import build_meshes, check_layouts

    memory = None if args.memory_gib is None else round(args.memory_gib * 1024 ** 3)
    plan = MemoryPlan(response_length=args.seq_len, recompute=args.recompute,
                      sequence_parallel=args.sequence_parallel, memory_bytes=memory)
    if args.fit:
        report = fit_layouts(cfg, args.world, plan)
        print(format_fit(report, plan))
    else:
        check_layouts(cfg, args.world)
        report = dry_run(cfg, args.world, args.as_rank, lambda: build_meshes(cfg), plan)
        print(format_report(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0
