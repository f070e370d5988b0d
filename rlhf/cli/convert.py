"""`rlhf convert hf-to-ckpt | ckpt-to-hf`: HF folder <-> rlhf's sharded model checkpoint; `peft-check`: a PEFT
LoRA adapter folder checked against its HF base, printing the settings that continue training it.

Run it as one process, or under torchrun/srun for a sharded layout (world = tp * pp * dp; dp replicas
beyond the first only check). Every rank reads only the slices it owns.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from transformers import AutoConfig

from rlhf.parallel.groups import build_layout_groups
from rlhf.parallel.layout import ParallelLayout
from rlhf.parallel.runtime import distributed

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("convert", help="convert HF weights to an rlhf checkpoint and back")
    directions = parser.add_subparsers(dest="direction", required=True, metavar="direction")
    to_ckpt = directions.add_parser("hf-to-ckpt", help="HF safetensors folder -> sharded rlhf checkpoint")
    to_ckpt.add_argument("--hf", required=True, help="HF model folder (config.json + safetensors)")
    to_ckpt.add_argument("--out", required=True, help="checkpoint folder to create (must not exist)")
    to_ckpt.add_argument("--tp", type=int, default=1, help="tensor-parallel size of the checkpoint")
    to_ckpt.add_argument("--pp", type=int, default=1, help="pipeline-parallel size of the checkpoint")
    to_ckpt.add_argument("--value-head", action="store_true",
                         help="critic/reward model: scalar head from score.weight, or fresh from a causal LM")
    to_hf = directions.add_parser("ckpt-to-hf", help="sharded rlhf checkpoint -> HF safetensors folder")
    to_hf.add_argument("--ckpt", required=True, help="rlhf checkpoint folder (from hf-to-ckpt, or a training "
                                                     "run's checkpoints/step_<N>: its actor)")
    to_hf.add_argument("--out", required=True, help="HF folder to create (must not exist)")
    to_hf.add_argument("--tokenizer-dir", default=None, help="copy tokenizer files from this HF folder")
    to_hf.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                       help="dtype of the exported tensors (default: the dtype of the HF folder converted from)")
    peft = directions.add_parser("peft-check", help="PEFT LoRA adapter folder: check it against its HF base and "
                                                    "print the settings that continue training it")
    peft.add_argument("--adapter", required=True, help="PEFT adapter folder (adapter_config.json + "
                                                       "adapter_model.safetensors)")
    peft.add_argument("--hf", required=True, help="the HF base model folder the adapter was trained on")
    return parser


def _peft_check(args: argparse.Namespace) -> None:
    """Reads the adapter's config and tensor header and the base's config only; prints `key=value` settings."""
    from rlhf.models.config import LoraConfig
    from rlhf.models.lora_peft import check_peft_adapter, read_peft_folder
    from rlhf.orchestration.checks import read_hf_config

    adapter = read_peft_folder(args.adapter)
    lora = LoraConfig(enabled=True, rank=adapter.rank, alpha=adapter.alpha, targets=adapter.targets)
    check_peft_adapter(adapter, read_hf_config(args.hf, "--hf"), lora)
    print(" ".join([f"model.path={args.hf}", *adapter.overrides()]))


def _checked_layout(config, world_size: int, *, tp: int, pp: int) -> ParallelLayout:
    """The layout, checked against the model on every rank before any process group exists (a one-line error
    on every rank, never one rank failing while its peers block in group creation)."""
    from rlhf.models.spec import ModelSpec

    layout = ParallelLayout.for_world(world_size, tp=tp, pp=pp, what="convert")
    ModelSpec.from_hf(config).check_layout(layout.tp, layout.pp)
    return layout


def _hf_to_ckpt(args: argparse.Namespace, world_size: int) -> None:
    from rlhf.models.builder import build_gpt
    from rlhf.models.hf_load import load_hf_weights
    from rlhf.models.mcore_ckpt import save_model_shards

    config = AutoConfig.from_pretrained(args.hf)
    layout = _checked_layout(config, world_size, tp=args.tp, pp=args.pp)
    model = build_gpt(config, build_layout_groups(layout), value_head=args.value_head)
    load_hf_weights(model, args.hf)
    save_model_shards(model, args.out)


def _ckpt_to_hf(args: argparse.Namespace, world_size: int) -> None:
    from pathlib import Path

    from rlhf.checkpoint import MANIFEST
    from rlhf.models.builder import build_gpt
    from rlhf.models.hf_export import export_hf
    from rlhf.models.mcore_ckpt import load_model_shards, read_meta

    if (Path(args.ckpt) / MANIFEST).is_file():  # a training checkpoint: one process merges it, any world size
        from rlhf.orchestration.export import export_checkpoint

        if dist.get_rank() == 0:
            export_checkpoint(args.ckpt, args.out, tokenizer_dir=args.tokenizer_dir,
                              dtype=DTYPES[args.dtype] if args.dtype else None)
        dist.barrier()
        return
    meta = read_meta(args.ckpt)
    config = AutoConfig.for_model(**meta["hf_config"])
    layout = _checked_layout(config, world_size, tp=meta["tp"], pp=meta["pp"])
    model = build_gpt(config, build_layout_groups(layout), value_head=meta["value_head"])
    load_model_shards(model, args.ckpt)
    dtype = DTYPES[args.dtype] if args.dtype else getattr(config, "dtype", None)
    export_hf(model, args.out, tokenizer_dir=args.tokenizer_dir, dtype=dtype)


def run(args: argparse.Namespace) -> int:
    if args.direction == "peft-check":
        _peft_check(args)
        return 0
    with distributed("auto") as runtime:
        convert = _hf_to_ckpt if args.direction == "hf-to-ckpt" else _ckpt_to_hf
        convert(args, runtime.env.world_size)
    return 0
