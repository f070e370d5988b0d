"""`rlhf config`: print or check the resolved config tree (YAML), or render the config reference page.

`rlhf config --print --config FILE key=value...` shows exactly what a run with those arguments would use, with
every default filled in; `rlhf config --check --world N ...` runs every check `rlhf train` runs before it starts
(files, model folders, layouts against the model, batch splits, lengths) and lists all problems at once;
`rlhf config --reference [FILE]` renders the config reference page from the config
dataclasses to stdout, or to FILE (`rlhf config --reference docs/config.md` regenerates the repository's page).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import yaml

from rlhf.cli.common import add_config_args, config_from_args
from rlhf.config import to_dict
from rlhf.errors import ConfigError
from rlhf.orchestration.schema import RlhfConfig


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("config", help="print or check the resolved config, or render the config reference")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--print", action="store_true", help="print the resolved tree as YAML (the default)")
    mode.add_argument("--check", action="store_true",
                      help="run rlhf train's whole preflight (no process group) and list every problem at once")
    mode.add_argument("--reference", nargs="?", const="-", default=None, metavar="FILE",
                      help="render the config reference page to stdout, or to FILE (e.g. docs/config.md)")
    parser.add_argument("--world", type=int, default=1, metavar="N",
                        help="with --check: the number of ranks the run will launch (default 1)")
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
    cfg = config_from_args(args)
    if args.check:
        return check(cfg, args.world)
    print(yaml.safe_dump(to_dict(cfg), sort_keys=False), end="")
    return 0


def check(cfg: RlhfConfig, world_size: int) -> int:
    """Preflight in this one process; problems raise (one ConfigError listing all), notes are printed."""
    if world_size < 1:
        raise ConfigError(f"--world {world_size} must be >= 1")
    from rlhf.orchestration.preflight import preflight
    from rlhf.orchestration.previous_run import previous_run_notice

    notice = previous_run_notice(cfg)
    if notice is not None:
        print(f"note: {notice}")
    for note in preflight(cfg, world_size):
        print(f"note: {note}")
    print(f"config OK for {world_size} rank{'s' if world_size > 1 else ''}: every check rlhf train runs before "
          "it starts passed")
    return 0
