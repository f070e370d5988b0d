"""No rlhf flag may be read by torchrun: argparse lets `--run` stand for torchrun's `--run-path`, so a flag equal
to, or a prefix of, one of torchrun's options breaks `launch/torchrun.sh N <command> ...`."""

from __future__ import annotations

import argparse

from torch.distributed.run import get_args_parser

from rlhf.cli.main import build_parser


def _long_options(parser: argparse.ArgumentParser, path: str):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _long_options(sub, f"{path} {name}".strip())
        for option in action.option_strings:
            if option.startswith("--") and option != "--help":
                yield path, option


def test_no_flag_is_taken_by_torchrun():
    torchrun = [o for a in get_args_parser()._actions for o in a.option_strings if o.startswith("--")]
    clashes = [(command, option, [t for t in torchrun if t.startswith(option)])
               for command, option in _long_options(build_parser(), "")
               if any(t.startswith(option) for t in torchrun)]
    assert clashes == []
    assert sum(1 for _ in _long_options(build_parser(), "")) > 40  # the walk does see every subcommand
