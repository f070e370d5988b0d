"""`rlhf config`: print the resolved config tree (YAML), or regenerate the config reference page.

`rlhf config --print --config FILE key=value...` shows exactly what a run with those arguments would use, with
every default filled in; `rlhf config --reference [FILE]` renders the config reference page from the config
dataclasses to stdout, or to FILE (`rlhf config --reference docs/config.md` regenerates the repository's page).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import yaml

from rlhf.cli.common import add_config_args, config_from_args
from rlhf.config import to_dict
from rlhf.orchestration.schema import RlhfConfig


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("config", help="print or check the resolved config, or render the config reference")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--print", action="store_true", help="print the resolved tree as YAML (the default)")
    mode.add_argument("--reference", nargs="?", const="-", default=None, metavar="FILE",
                      help="render the config reference page to stdout, or to FILE (e.g. docs/config.md)")
    add_config_args(parser)
    return parser


def run(args: argparse.Namespace) -> int:
    if args.reference is not None:
        from rlhf.config.reference import render

        page = render(RlhfConfig)
        if args.reference == "-":
            print(page, end="")
        else:
            Path(args.reference).write_text(page)
            print(f"wrote {args.reference}")
        return 0
    print(yaml.safe_dump(to_dict(config_from_args(args)), sort_keys=False), end="")
    return 0
