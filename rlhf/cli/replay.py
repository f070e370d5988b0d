"""`rlhf replay`: train offline from saved rollouts (`trainer.dump_rollouts`), no generation; `replay.reward_norm`
scales rewards by their running std (RunningMeanStd)."""

from __future__ import annotations

import argparse

from rlhf.cli.common import add_config_args, config_from_args, run_in_world


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("replay", help="train from a run's rollout dumps (run under torchrun for several "
                                                  "ranks)")
    parser.add_argument("--rollouts", default=None,
                        help="folder of step_<N>.parquet dumps (a run's rollouts/, written with "
                             "trainer.dump_rollouts=true); sets replay.rollouts")
    add_config_args(parser)
    return parser


def run(args: argparse.Namespace) -> int:
    from rlhf.orchestration.replay import Replayer, replay_config, replay_preflight

    if args.rollouts is not None:
        args.overrides = [*args.overrides, f"replay.rollouts={args.rollouts}"]
    cfg = replay_config(config_from_args(args))
    run_in_world(cfg, "replay", lambda cfg, run_dir: Replayer(cfg, run_dir).fit(), replay_preflight,
                 defer_config=True)
    return 0
