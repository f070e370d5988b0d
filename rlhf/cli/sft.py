"""`rlhf sft`: supervised warm-start on (prompt, answer) records, exported as an HF folder (`sft.out_dir`); a run of
the trainer (preflight, watchdog, checkpoints, `checkpoint.resume: auto`)."""

from __future__ import annotations

import argparse

from rlhf.cli.common import add_config_args, config_from_args, run_in_world


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("sft", help="supervised fine-tuning on ground-truth answers, then HF export")
    add_config_args(parser)
    return parser


def run(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)  # config errors come before torch and megatron are imported
    from rlhf.orchestration.sft import run_sft, sft_preflight

    run_in_world(cfg, "sft", lambda cfg, run_dir: run_sft(cfg, cfg.sft, run_dir), sft_preflight,
                 defer_config=True)
    return 0
