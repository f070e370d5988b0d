"""Megatron's own optimizer and LR/WD scheduler, configured from an `OptimConfig` on explicit groups."""

from __future__ import annotations

import torch
from megatron.core.distributed import DistributedDataParallel
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer.optimizer import MegatronOptimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.process_groups_config import ProcessGroupCollection

from rlhf.platform import has_accelerator
from rlhf.platform.compat.megatron import default_group_as
from rlhf.train.config import OptimConfig


def build_optimizer(config: OptimConfig, model: DistributedDataParallel,
                    pg_collection: ProcessGroupCollection) -> MegatronOptimizer:
    """AdamW (decoupled weight decay; none on biases and norms) over `model`'s params, megatron-wrapped.

    Clipping is done by the engine (after its non-finite check), so megatron's own clip is left at its
    value only for the record; the engine never calls `optimizer.step()`. Without TE/apex megatron falls back
    to torch's AdamW, which on a CPU defaults to its per-tensor loop (six elementwise passes per parameter);
    on a CPU host it runs torch's fused kernel instead (one pass; `use_fused_adam`).
    """
    params_dtype = model.config.params_dtype
    megatron_config = OptimizerConfig(
        optimizer="adam", lr=config.lr, min_lr=config.min_lr, weight_decay=config.weight_decay,
        adam_beta1=config.betas[0], adam_beta2=config.betas[1], adam_eps=config.eps,
        clip_grad=config.clip_grad, use_distributed_optimizer=config.use_distributed_optimizer,
        params_dtype=params_dtype, bf16=params_dtype == torch.bfloat16, fp16=params_dtype == torch.float16)
    with default_group_as(pg_collection.layout_all):
        optimizer = get_megatron_optimizer(megatron_config, [model], use_gloo_process_groups=False,
                                           pg_collection=pg_collection)
    if not has_accelerator():
        use_fused_adam(optimizer)
    return optimizer


def use_fused_adam(optimizer: MegatronOptimizer) -> None:
    """Every torch AdamW inside `optimizer` steps with torch's fused kernel (the `fused=True` constructor flag,
    set on its param groups). CPU only: there the `step` counters rlhf restores are host tensors, as fused
    wants them; on an accelerator torch's default (foreach) stays."""
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(part, "optimizer", None)
        if isinstance(inner, torch.optim.Adam):
            inner.defaults.update(fused=True, foreach=False)
            for group in inner.param_groups:
                group.update(fused=True, foreach=False)


def build_scheduler(config: OptimConfig, optimizer: MegatronOptimizer, total_steps: int) -> OptimizerParamScheduler:
    """Linear warmup from 0 to `lr` over `warmup_steps`, then `decay_style` down to `min_lr` at `total_steps`.

    Step k of training (0-based) runs at the scheduler value after k increments: lr(0) = 0 with warmup.
    """
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=config.lr, min_lr=config.min_lr, lr_warmup_steps=config.warmup_steps,
        lr_decay_steps=total_steps, lr_decay_style=config.decay_style, start_wd=config.weight_decay,
        end_wd=config.weight_decay, wd_incr_steps=total_steps, wd_incr_style="constant")
