"""`rlhf <command>`: dispatch to the subcommand modules; user errors print one line and exit 2."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
import warnings

from rlhf.errors import RlhfError

# Subcommand -> module; modules not present in this build are simply not offered.
COMMANDS = {
    "train": "rlhf.cli.train",
    "sft": "rlhf.cli.sft",
    "init-model": "rlhf.cli.init_model",
    "export": "rlhf.cli.export",
    "doctor": "rlhf.cli.doctor",
    "data": "rlhf.cli.data",
    "convert": "rlhf.cli.convert",
    "generate": "rlhf.cli.generate",
    "profile": "rlhf.cli.profile",
    "bench": "rlhf.cli.bench",
    "plan": "rlhf.cli.plan",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlhf", description="SPMD RL post-training on megatron-core.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="command")
    for name, module_name in COMMANDS.items():
        if importlib.util.find_spec(module_name) is None:
            continue
        module = importlib.import_module(module_name)
        sub = module.add_parser(subparsers)
        sub.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    # megatron-core warns on every import that the optional GPU extras are absent; doctor reports that once.
    warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine).*not installed")
    args = build_parser().parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except RlhfError as err:
        print(f"rlhf {args.command}: error: {err}", file=sys.stderr)
        return 2
