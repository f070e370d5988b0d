"""Arguments shared by commands that take a config: `--config FILE` plus dotted `key=value` overrides."""

from __future__ import annotations

import argparse

from rlhf.config import RlhfConfig, load_config

DEFAULT_CONFIG = "configs/tiny_cpu.yaml"


def add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=None,
                        help=f"YAML config (default: dataclass defaults; the CPU demo uses {DEFAULT_CONFIG})")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="dotted overrides, e.g. mesh.rollout.tp=2 comm.verify=true")


def config_from_args(args: argparse.Namespace) -> RlhfConfig:
    return load_config(RlhfConfig, args.config, args.overrides)
