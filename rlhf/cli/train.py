"""`rlhf train`: the RL loop (GRPO, PPO, RLOO, REINFORCE++, ReMax) on the configured meshes.

A relaunch first reads its run folder (`rlhf.orchestration.previous_run`): a finished run says so in about a
second, before torch is imported; a folder of another experiment is refused.
"""

from __future__ import annotations

import argparse

from rlhf.cli.common import add_config_args, config_from_args, run_in_world
from rlhf.cli.failure import launch_rank


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("train", help="run RL training (run under torchrun/srun for several ranks)")
    add_config_args(parser)
    return parser


def run(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)  # config errors come before torch and megatron are imported
    from rlhf.orchestration.previous_run import previous_run_notice

    notice = previous_run_notice(cfg)
    if notice is not None:
        if launch_rank() == 0:
            print(notice, flush=True)
        return 0
    from rlhf.orchestration.loop import Trainer
    from rlhf.orchestration.preflight import preflight

    run_in_world(cfg, "train", lambda cfg, run_dir: Trainer(cfg, run_dir).fit(), preflight,
                 defer_config=True)
    return 0
