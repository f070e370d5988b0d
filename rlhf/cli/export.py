"""`rlhf export`: a trainer checkpoint's actor (or critic) as an HF folder that `transformers` loads."""

from __future__ import annotations

import argparse


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("export", help="write a checkpoint's actor/critic as HF safetensors "
                                                  "(one process, whatever world size trained it)")
    parser.add_argument("--run-dir", required=True, help="the run folder (holds config.yaml and checkpoints/)")
    parser.add_argument("--checkpoint", default="latest", help="step_<N> folder name or path (default: latest)")
    parser.add_argument("--out", required=True, help="new output folder")
    parser.add_argument("--model-role", default="actor", choices=["actor", "critic"],
                        help="which trained role to export (default actor)")
    return parser


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from rlhf.checkpoint import find_latest
    from rlhf.checkpoint_verify import agree
    from rlhf.config import load_config
    from rlhf.orchestration.schema import RlhfConfig
    from rlhf.errors import CheckpointError, RlhfError
    from rlhf.parallel.runtime import distributed
    from rlhf.trainer.checks import check_writable_folder
    from rlhf.orchestration.export import export_checkpoint

    check_writable_folder(args.out, "--out")
    run_dir = Path(args.run_dir)
    cfg = load_config(RlhfConfig, run_dir / "config.yaml")
    root = run_dir / "checkpoints"
    checkpoint = find_latest(root) if args.checkpoint == "latest" else root / args.checkpoint
    if checkpoint is None:
        raise CheckpointError(f"no complete checkpoint under {root}")
    with distributed(cfg.dist.backend, timeout_s=cfg.dist.timeout_s, seed=cfg.dist.seed) as runtime:
        problem = None
        if runtime.env.rank == 0:  # one process writes; under a launcher the others wait for its verdict
            try:
                export_checkpoint(checkpoint, args.out, args.model_role, tokenizer_dir=cfg.model.path)
            except RlhfError as error:
                problem = str(error)
        problem = agree(problem)
        if problem:
            raise CheckpointError(problem)
    print(f"exported {args.model_role} of {checkpoint} to {args.out}")
    return 0
