"""`rlhf train`: the RL loop (GRPO, PPO, RLOO, REINFORCE++, ReMax) on the configured meshes."""

from __future__ import annotations

import argparse

from rlhf.cli.common import add_config_args, config_from_args
from rlhf.dist.runtime import distributed
from rlhf.run_dir import close_run, get_logger, setup_run


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("train", help="run RL training (run under torchrun/srun for several ranks)")
    add_config_args(parser)
    return parser


def run(args: argparse.Namespace) -> int:
    from rlhf.trainer.loop import Trainer, preflight

    cfg = config_from_args(args)
    with distributed(cfg.dist.backend, timeout_s=cfg.dist.timeout_s, seed=cfg.dist.seed) as runtime:
        preflight(cfg, runtime.world_size)
        run_dir = setup_run(cfg.run, cfg, prefix="train")
        try:
            Trainer(cfg, run_dir).fit()
        except Exception:
            get_logger("train").exception("training failed")  # the traceback lands in rank<k>.log too
            raise
        finally:
            close_run()
    return 0
