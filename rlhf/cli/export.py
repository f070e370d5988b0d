"""`rlhf export`: a trainer checkpoint's actor (or critic) as an HF folder that `transformers` loads; a LoRA run's
actor as a PEFT adapter folder or merged into its base (`--lora`)."""

from __future__ import annotations

import argparse
import logging
import sys


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("export", help="write a checkpoint's actor/critic as HF safetensors "
                                                  "(one process, whatever world size trained it)")
    parser.add_argument("--run-dir", required=True, help="the run folder (holds config.yaml and checkpoints/)")
    parser.add_argument("--checkpoint", default="latest", help="step_<N> folder name or path (default: latest)")
    parser.add_argument("--out", required=True, help="new output folder")
    parser.add_argument("--model-role", default="actor", choices=["actor", "critic"],
                        help="which trained role to export (default actor)")
    parser.add_argument("--lora", default="peft", choices=["peft", "merged"],
                        help="a LoRA run's actor: a PEFT adapter folder (default) or the base with it merged in")
    return parser


def _checkpoint(root, name: str, keep_last: int):
    """The step folder `--checkpoint` names (`latest`: the newest complete one, each newer skip logged)."""
    from rlhf.checkpoint import check_root, find_latest, step_folders
    from rlhf.errors import CheckpointError
    from rlhf.run_dir import get_logger

    check_root(root)
    console = logging.StreamHandler(sys.stderr)  # a skipped newer step is said, not silently passed over
    console.setFormatter(logging.Formatter("rlhf export: warning: %(message)s"))
    get_logger().addHandler(console)
    try:
        checkpoint = find_latest(root) if name == "latest" else root / name
    finally:
        get_logger().removeHandler(console)
    have = ", ".join(p.name for p in step_folders(root)) or "none"
    if checkpoint is None:
        raise CheckpointError(f"no complete checkpoint under {root} (step folders: {have})")
    if not checkpoint.exists():
        raise CheckpointError(f"--checkpoint {name}: no such checkpoint under {root} (it holds {have}; the run "
                              f"keeps the newest {keep_last}: checkpoint.keep_last); pass one of those or latest")
    return checkpoint


def _tokenizer_dir(model_path: str, config: str) -> str | None:
    """model.path when it is a folder from here; else a warning: the export then has no tokenizer files."""
    import os

    if os.path.isdir(model_path):
        return model_path
    print(f"rlhf export: warning: model.path={model_path!r} in {config} is not a folder from {os.getcwd()}: "
          "the export has no tokenizer files (run from the training's working directory)", file=sys.stderr)
    return None


def _write(args: argparse.Namespace, cfg, checkpoint, run_dir) -> str | None:
    """Export the checkpoint; the problem, as one line, or None."""
    from rlhf.errors import ConfigError, RlhfError
    from rlhf.orchestration.export import export_checkpoint, export_lora_checkpoint

    try:
        tokenizer_dir = _tokenizer_dir(cfg.model.path, str(run_dir / "config.yaml"))
        if cfg.lora.enabled and cfg.lora.critic and args.model_role == "critic":
            raise ConfigError("exporting a LoRA critic (lora.critic=true) is not built yet; export the "
                              "actor, or resume the run to use its critic")
        if cfg.lora.enabled and args.model_role == "actor":
            export_lora_checkpoint(checkpoint, args.out, cfg.lora, cfg.model.path,
                                   merged=args.lora == "merged", tokenizer_dir=tokenizer_dir)
        else:
            export_checkpoint(checkpoint, args.out, args.model_role, tokenizer_dir=tokenizer_dir)
    except RlhfError as error:
        return str(error)
    return None


def run(args: argparse.Namespace) -> int:
    """Under a launcher rank 0 writes and every rank exits with its verdict; called inside a running world (the
    process group is up: a library call from a training script) the calling process writes, with no collective
    and no reseeding, so one rank may call it alone."""
    from pathlib import Path

    import torch.distributed

    from rlhf.checkpoint.verify import agree
    from rlhf.config import load_config
    from rlhf.orchestration.schema import RlhfConfig
    from rlhf.errors import CheckpointError
    from rlhf.parallel.runtime import distributed
    from rlhf.orchestration.checks import check_writable_folder

    check_writable_folder(args.out, "--out")
    run_dir = Path(args.run_dir)
    cfg = load_config(RlhfConfig, run_dir / "config.yaml")
    checkpoint = _checkpoint(run_dir / "checkpoints", args.checkpoint, cfg.checkpoint.keep_last)
    if torch.distributed.is_initialized():  # a call inside a running world: the calling process writes, alone
        problem = _write(args, cfg, checkpoint, run_dir)
    else:
        with distributed(cfg.dist.backend, timeout_s=cfg.dist.timeout_s, seed=cfg.dist.seed) as runtime:
            # one process writes; under a launcher the others wait for its verdict
            problem = agree(_write(args, cfg, checkpoint, run_dir) if runtime.env.rank == 0 else None)
    if problem:
        raise CheckpointError(problem)
    print(f"exported {args.model_role} of {checkpoint} to {args.out}")
    return 0
