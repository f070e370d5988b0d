"""`rlhf data make` writes a verl-schema prompt dataset from a reasoning-gym task (`rlhf data tasks` lists them);
`rlhf data check` reads one back, as the trainer would, and summarises it."""

from __future__ import annotations

import argparse
import statistics
from collections import Counter

from rlhf.cli.failure import exit_code, report
from rlhf.data.make import PROMPT_FORMATS, MakeConfig, make_dataset, offered_tasks, parse_task_options
from rlhf.data.records import PromptRecord, read_records
from rlhf.data.config import TRUNCATIONS, DataConfig
from rlhf.data.tokenize import tokenize_records
from rlhf.errors import ConfigError, DataError


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `data` with its `make` and `check` subcommands on the main CLI's subparsers."""
    parser = subparsers.add_parser("data", help="make and check prompt datasets")
    commands = parser.add_subparsers(dest="data_command", required=True)
    make = commands.add_parser(
        "make", help="write a dataset from a reasoning-gym task",
        description="Write N prompts of a reasoning-gym task as verl-schema JSONL or parquet. Items come from "
                    "seed, seed+1, ...: give a held-out set a far-away --seed and --exclude the training files.")
    make.add_argument("--task", required=True,
                      help="reasoning-gym task, e.g. chain_sum, countdown, gsm_symbolic (`rlhf data tasks` lists all)")
    make.add_argument("--num-prompts", type=int, required=True, help="number of prompts")
    make.add_argument("--out", required=True, help="output file, .parquet or .jsonl")
    make.add_argument("--seed", type=int, default=0, help="seed of item 0 (default 0)")
    make.add_argument("--prompt-format", choices=PROMPT_FORMATS, default="chat",
                      help="chat: one user message; text: the question; expression: '12+3=' (arithmetic tasks)")
    make.add_argument("--task-option", action="append", default=[], metavar="KEY=VALUE",
                      help="task config option, repeatable, e.g. --task-option max_terms=3")
    make.add_argument("--exclude", action="append", default=[], metavar="FILE",
                      help="dataset whose questions must not appear (repeatable); output questions are distinct")
    commands.add_parser("tasks", help="list the reasoning-gym tasks `data make` writes, one per line")
    check = commands.add_parser("check", help="validate a dataset and summarise it",
                                description="Read a dataset as training would; with --tokenizer, also tokenize "
                                            "it under the length policy and report prompt lengths.")
    check.add_argument("path", help=".parquet or .jsonl dataset")
    check.add_argument("--tokenizer", help="local HF tokenizer folder")
    check.add_argument("--max-prompt-length", type=int, default=1024)
    check.add_argument("--truncation", choices=TRUNCATIONS, default="error")
    return parser


def run(args: argparse.Namespace) -> int:
    """Run `rlhf data <command>`; a bad input prints one line to stderr and returns non-zero, writing nothing."""
    try:
        if args.data_command == "tasks":
            print("\n".join(offered_tasks()))
            return 0
        return _make(args) if args.data_command == "make" else _check(args)
    except (ConfigError, DataError) as error:
        report(f"rlhf data {args.data_command}: error: {error}", exit_code(error))
        return exit_code(error)


def _make(args: argparse.Namespace) -> int:
    config = MakeConfig(task=args.task, num_samples=args.num_prompts, seed=args.seed, prompt_format=args.prompt_format,
                        task_config=parse_task_options(args.task_option), exclude=list(args.exclude))
    records = make_dataset(config, args.out)
    print(f"wrote {len(records)} prompts of reasoning-gym {args.task!r} (seed {args.seed}) to {args.out}")
    return 0


def _check(args: argparse.Namespace) -> int:
    records = read_records(args.path)
    sources = Counter(record.data_source for record in records)
    print(f"{args.path}: {len(records)} prompts; data sources: "
          + ", ".join(f"{source} ({count})" for source, count in sorted(sources.items())))
    if args.tokenizer:
        _report_lengths(records, args)
    return 0


def _report_lengths(records: list[PromptRecord], args: argparse.Namespace) -> None:
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    except (OSError, ValueError) as error:
        raise ConfigError(f"--tokenizer {args.tokenizer!r} is not a loadable tokenizer folder: "
                          f"{' '.join(str(error).split())[:200]}") from None
    config = DataConfig(max_prompt_length=args.max_prompt_length, truncation=args.truncation)
    prompts = tokenize_records(records, tokenizer, config)
    print(f"prompt tokens: min {min(prompts.lengths)}, mean {statistics.fmean(prompts.lengths):.1f}, "
          f"max {max(prompts.lengths)}; kept {len(prompts.records)}, filtered {prompts.num_filtered}, "
          f"truncated {prompts.num_truncated} (max_prompt_length {args.max_prompt_length}, {args.truncation})")
