"""`rlhf data make`: write a verl-schema prompt dataset offline from a reasoning-gym task."""

from __future__ import annotations

import argparse
import sys

from rlhf.data.make import PROMPT_FORMATS, MakeConfig, make_dataset, parse_task_options
from rlhf.errors import ConfigError, DataError


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `data` and its `make` subcommand on the main CLI's subparsers."""
    parser = subparsers.add_parser("data", help="make and inspect prompt datasets")
    commands = parser.add_subparsers(dest="data_command", required=True)
    make = commands.add_parser(
        "make", help="write a dataset from a reasoning-gym task",
        description="Write N prompts of a reasoning-gym task as verl-schema JSONL or parquet. Items come from "
                    "seed, seed+1, ...: give a held-out set a far-away --seed and --exclude the training files.")
    make.add_argument("--task", required=True, help="reasoning-gym task, e.g. chain_sum, countdown, gsm_symbolic")
    make.add_argument("--n", type=int, required=True, help="number of prompts")
    make.add_argument("--out", required=True, help="output file, .parquet or .jsonl")
    make.add_argument("--seed", type=int, default=0, help="seed of item 0 (default 0)")
    make.add_argument("--prompt-format", choices=PROMPT_FORMATS, default="chat",
                      help="chat: one user message; text: the question; expression: '12+3=' (arithmetic tasks)")
    make.add_argument("--task-option", action="append", default=[], metavar="KEY=VALUE",
                      help="task config option, repeatable, e.g. --task-option max_terms=3")
    make.add_argument("--exclude", action="append", default=[], metavar="FILE",
                      help="dataset whose questions must not appear (repeatable); output questions are distinct")
    return parser


def run(args: argparse.Namespace) -> int:
    """Run `rlhf data <command>`; a bad input prints one line to stderr and returns non-zero, writing nothing."""
    try:
        config = MakeConfig(task=args.task, num_samples=args.n, seed=args.seed, prompt_format=args.prompt_format,
                            task_config=parse_task_options(args.task_option), exclude=list(args.exclude))
        records = make_dataset(config, args.out)
    except (ConfigError, DataError) as error:
        print(f"rlhf data make: error: {error}", file=sys.stderr)
        return 2 if isinstance(error, ConfigError) else 1
    print(f"wrote {len(records)} prompts of reasoning-gym {args.task!r} (seed {args.seed}) to {args.out}")
    return 0
