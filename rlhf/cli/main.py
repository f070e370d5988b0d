"""`rlhf <command>`: dispatch to the subcommand modules; user errors print one line and exit 2."""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import os
import sys
import warnings
from pathlib import Path

from rlhf.errors import RlhfError

# Subcommand -> module; modules not present in this build are simply not offered.
COMMANDS = {
    "train": "rlhf.cli.train",
    "replay": "rlhf.cli.replay",
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
    "config": "rlhf.cli.config",
}


def _summary(origin: str) -> str:
    """A command's one-line help from its module docstring, read without importing the module (torch & co.)."""
    doc = ast.get_docstring(ast.parse(Path(origin).read_text())) or ""
    first = doc.split("\n\n")[0].replace("\n", " ")
    return first.split(": ", 1)[1] if first.startswith("`rlhf") and ": " in first else first


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """Every subcommand's full parser; with `command`, only that one is imported (the rest are listed by their
    docstrings), so `rlhf --help` and `rlhf <command> ...` never import what other commands need."""
    parser = argparse.ArgumentParser(prog="rlhf", description="SPMD RL post-training on megatron-core.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="command")
    for name, module_name in COMMANDS.items():
        spec = importlib.util.find_spec(module_name)
        if spec is None:
            continue
        if command is not None and name != command:
            subparsers.add_parser(name, help=_summary(spec.origin))
            continue
        module = importlib.import_module(module_name)
        sub = module.add_parser(subparsers)
        sub.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    # megatron-core warns on every import that the optional GPU extras are absent; doctor reports that once.
    warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine).*not installed")
    if not (sys.stdout.isatty() and sys.stderr.isatty()):  # a log file or pipe: no `\r` progress bars in it
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # transformers' and the Hub's bars
    argv = sys.argv[1:] if argv is None else argv
    command = next((arg for arg in argv if not arg.startswith("-")), "")
    args = build_parser(command if command in COMMANDS else "").parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except RlhfError as err:
        print(f"rlhf {args.command}: error: {err}", file=sys.stderr)
        return 2
