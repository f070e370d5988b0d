"""`rlhf <command>`: dispatch to the subcommand modules; an rlhf error ends in one line and an exit code by
class (`rlhf.cli.failure`: 2 bad input, 3 checkpoint, 4 training stopped, 5 ranks, 1 anything else)."""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import os
import sys
import warnings
from pathlib import Path

from rlhf.cli.failure import ERROR_DIR_ENV, exit_code, report
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
        report(f"rlhf {args.command}: error: {err}", exit_code(err))
        return exit_code(err)
    except Exception as err:
        if os.environ.get(ERROR_DIR_ENV):  # the launcher's last line points at the traceback
            first = (str(err).strip().splitlines() or [""])[0]
            report(f"rlhf {args.command}: failed: {type(err).__name__}: {first} (traceback above and in the "
                   "run folder's rank<k>.log)", 1)
        raise
