"""`rlhf config`: print the resolved config tree (YAML), or regenerate the config reference page.

`rlhf config --print --config FILE key=value...` shows exactly what a run with those arguments would use, with
every default filled in; `rlhf config --reference` rewrites docs/config.md from the config dataclasses.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import yaml

from rlhf.cli.common import add_config_args, config_from_args
from rlhf.config import to_dict
from rlhf.orchestration.schema import RlhfConfig

REFERENCE_PAGE = Path(__file__).resolve().parents[2] / "docs" / "config.md"


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("config", help="print the resolved config, or regenerate docs/config.md")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--print", action="store_true", help="print the resolved tree as YAML (the default)")
    mode.add_argument("--reference", nargs="?", const=str(REFERENCE_PAGE), default=None, metavar="FILE",
                      help=f"write the config reference page (default {REFERENCE_PAGE})")
    add_config_args(parser)
    return parser


def run(args: argparse.Namespace) -> int:
    if args.reference is not None:
        from rlhf.config.reference import render

        Path(args.reference).write_text(render(RlhfConfig))
        print(f"wrote {args.reference}")
        return 0
    print(yaml.safe_dump(to_dict(config_from_args(args)), sort_keys=False), end="")
    return 0
