"""`rlhf plan --world N`: lay a job out for N ranks on this one host (fake process groups) and report this
rank's meshes, memory per role and weight-sync plan, before anyone books N GPUs."""

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
    parser.add_argument("--json", default=None, help="also write the report to this JSON file")
    return parser


def run(args: argparse.Namespace) -> int:
    if args.world < 1 or not 0 <= args.as_rank < args.world:
        raise ConfigError(f"--world={args.world} must be >= 1 and --as-rank={args.as_rank} in "
                          f"[0, {args.world})")
    cfg = config_from_args(args)  # config errors come before torch and megatron are imported
    from rlhf.profiling.dry_run import dry_run, format_report
    from rlhf.orchestration.preflight import build_meshes, check_layouts

    check_layouts(cfg, args.world)
    report = dry_run(cfg, args.world, args.as_rank, lambda: build_meshes(cfg))
    print(format_report(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0
