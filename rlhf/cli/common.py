"""Arguments shared by commands that take a config: `--config FILE` plus dotted `key=value` overrides."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from typing import Any

from rlhf.config import load_config
from rlhf.orchestration.schema import RlhfConfig

DEFAULT_CONFIG = "configs/tiny_cpu.yaml"


def add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=None,
                        help=f"YAML config (default: dataclass defaults; the CPU demo uses {DEFAULT_CONFIG})")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="dotted overrides, e.g. mesh.rollout.tp=2 comm.verify=true")


def config_from_args(args: argparse.Namespace) -> RlhfConfig:
    return load_config(RlhfConfig, args.config, args.overrides)


def diagnostic_config(cfg: RlhfConfig, command: str) -> RlhfConfig:
    """`doctor`, `profile` and `bench` given a training config write to `<run.name>-<command>`, never into the
    training run's folder (they used to overwrite its config.yaml); they neither resume nor save checkpoints, and
    serve no Prometheus endpoint (the training run may hold its port)."""
    name = f"{cfg.run.name}-{command}" if cfg.run.name else ""
    checkpoint = dataclasses.replace(cfg.checkpoint, resume="none", every=0, save_at_end=False)
    return dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, name=name), checkpoint=checkpoint,
                               metrics=dataclasses.replace(cfg.metrics, prometheus_port=0))


def run_in_world(cfg: RlhfConfig, prefix: str, body: Callable[[RlhfConfig, Any], Any],
                 preflight: Callable[[RlhfConfig, int], list[str] | None] | None = None,
                 defer_config: bool = False) -> None:
    """Start the world, check inputs (before any folder exists), open the run folder, log the preflight's notes,
    run `body(cfg, run_dir)`; a failure's traceback goes to every rank's log file (not the console: `rlhf.cli.main`
    ends it with one line) before it propagates. With `defer_config` the body writes config.yaml itself."""
    from rlhf.parallel.runtime import distributed
    from rlhf.run_dir import FILE_ONLY, close_run, get_logger, setup_run

    with distributed(cfg.dist.backend, timeout_s=cfg.dist.timeout_s, seed=cfg.dist.seed) as runtime:
        notes = (preflight(cfg, runtime.world_size) or []) if preflight is not None else []
        run_dir = setup_run(cfg.run, cfg, prefix=prefix, defer_config=defer_config)
        for note in notes:
            get_logger(prefix).warning(note)
        try:
            body(cfg, run_dir)
        except Exception:
            get_logger(prefix).exception("%s failed", prefix, extra={FILE_ONLY: True})
            raise
        finally:
            close_run()
