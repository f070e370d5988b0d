"""`rlhf sft`: supervised warm-start on (prompt, answer) records, exported as an HF folder (`sft.out_dir`)."""

from __future__ import annotations

import argparse

from rlhf.cli.common import add_config_args, config_from_args
from rlhf.dist.runtime import distributed
from rlhf.run_dir import close_run, get_logger, setup_run


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("sft", help="supervised fine-tuning on ground-truth answers, then HF export")
    add_config_args(parser)
    return parser


def run(args: argparse.Namespace) -> int:
    from rlhf.trainer.sft import run_sft

    cfg = config_from_args(args)
    with distributed(cfg.dist.backend, timeout_s=cfg.dist.timeout_s, seed=cfg.dist.seed):
        run_dir = setup_run(cfg.run, cfg, prefix="sft")
        try:
            run_sft(cfg, cfg.sft, run_dir)
        except Exception:
            get_logger("sft").exception("sft failed")
            raise
        finally:
            close_run()
    return 0
