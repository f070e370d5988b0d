"""`TrainEngine`: one megatron model chunk trained with megatron's DDP, optimizer, scheduler and schedules.

Loss contract: `loss_fn(output, micro_batch) -> (loss, metrics)` and gradients are d(sum of every loss value
on every micro-batch and every DP rank). Nothing is averaged: not over micro-batches (the schedule's 1/M is
undone), not over DP (the model's `calculate_per_token_loss` is set, so megatron DDP sums grads across DP
instead of pre-scaling them by 1/dp). A loss normalised by the GLOBAL token count therefore gives the same
gradient for any DP size and micro-batching; a per-micro-batch mean must be divided by the caller. At cp > 1
every cp rank computes its DP rank's whole loss from gathered per-token outputs, back-propagates through its own
tokens only, and DDP sums grads over dp x cp (`pg_collection.dp_cp`). MoE
router losses (megatron's, added inside the forward) enter as their token-weighted mean over the whole step.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.process_groups_config import ProcessGroupCollection

from rlhf import platform
from rlhf.errors import ConfigError, NonFiniteError
from rlhf.models.forward import LossFn, TokenFn, forward_backward, routed_tokens
from rlhf.checkpoint.verify import check_trained_folder
from rlhf.models.hf_load import HfFolder
from rlhf.models.routing import has_router_losses
from rlhf.platform import current_device
from rlhf.platform.compat import megatron as megatron_compat
from rlhf.train import offload as offload_lib
from rlhf.train.config import OptimConfig
from rlhf.train.optim import build_optimizer, build_scheduler
from rlhf.train.state import Tensors, adam_step, checkpoint_tensors, load_checkpoint_tensors

ForwardFn = Callable[[torch.Tensor, Any], tuple[torch.Tensor, dict]]


@dataclass
class StepResult:
    """One optimizer step: global loss (summed over micro-batches and DP), pre-clip grad norm, the LR used."""

    loss: float
    grad_norm: float
    lr: float
    skipped: bool
    metrics: list[dict] = field(default_factory=list)


def autocast_dtype(autocast: str, params_dtype: torch.dtype, key: str = "optim.autocast") -> torch.dtype | None:
    """The dtype of an autocast setting (`key`: its config key); bf16 autocast needs fp32 weights and, on a CPU,
    native bf16 instructions."""
    if autocast == "none":
        return None
    if params_dtype != torch.float32:
        raise ConfigError(f"{key}={autocast!r} needs fp32 weights (model.dtype=float32), got {params_dtype}; "
                          f"set {key}=none")
    if not platform.has_accelerator() and not platform.host_supports_bf16():
        raise ConfigError(f"{key}={autocast!r}: this CPU has neither AVX-512-BF16 nor AMX-BF16 (/proc/cpuinfo "
                          f"flags), so bf16 matmuls would be emulated and slower; set {key}=none")
    return getattr(torch, autocast)


class TrainEngine:
    """Trains one role's model chunk (actor, critic) on its explicit process groups."""

    def __init__(self, model: torch.nn.Module, pg_collection: ProcessGroupCollection, config: OptimConfig, *,
                 name: str = "actor", total_steps: int | None = None) -> None:
        megatron_compat.apply()
        self.name, self.config, self.pg_collection = name, config, pg_collection
        self.autocast_dtype = autocast_dtype(config.autocast, model.config.params_dtype)
        model.config.calculate_per_token_loss = True  # DDP sums grads over DP (see module docstring)
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, average_in_collective=False,
            use_distributed_optimizer=config.use_distributed_optimizer, check_for_nan_in_grad=False)
        self.model = DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model,
                                             pg_collection=pg_collection)
        megatron_compat.fuse_wgrad_accumulation(model)  # weight grads straight into the DDP grad buffer
        self.optimizer = build_optimizer(config, self.model, pg_collection)
        self.scheduler = build_scheduler(config, self.optimizer, config.resolved_total_steps(total_steps))
        self.num_steps = 0
        self._offloaded: offload_lib.Offloaded | None = None

    @property
    def module(self) -> torch.nn.Module:
        """The wrapped megatron model (for weight export and resharding)."""
        return self.model.module

    @property
    def lr(self) -> float:
        """The learning rate the next step will use."""
        return self.optimizer.param_groups[0]["lr"]

    def forward_only(self, micro_batches: list, fn: ForwardFn, token_fn: TokenFn | None = None) -> list[dict]:
        """`fn(output, micro_batch) -> (unused_scalar, outputs)` per micro-batch, no grad; last pp stage only.

        Other pipeline stages return an empty list (the caller broadcasts what it needs).
        """
        self._check_loaded()
        with torch.no_grad():
            return forward_backward(self.model, micro_batches, fn, self.pg_collection, forward_only=True,
                                    token_fn=token_fn, autocast_dtype=self.autocast_dtype)

    def train_step(self, micro_batches: list, loss_fn: LossFn, token_fn: TokenFn | None = None) -> StepResult:
        """Zero grads, fwd+bwd over `micro_batches`, reduce over DP, check finiteness, clip, step, schedule."""
        self._check_loaded()
        # training mode: a colocated engine sharing these parameters puts the model in eval mode, which turns
        # megatron's MoE router losses off
        self.model.train()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        losses: list[torch.Tensor] = []

        def recording_loss(output: torch.Tensor, micro_batch: Any) -> tuple[torch.Tensor, dict]:
            value, metrics = loss_fn(output, micro_batch)
            losses.append(value.detach().float())
            return value, metrics

        with self._router_losses(micro_batches):
            metrics = forward_backward(self.model, micro_batches, recording_loss, self.pg_collection,
                                       token_fn=token_fn, autocast_dtype=self.autocast_dtype)
        finalize_model_grads([self.model], None, pg_collection=self.pg_collection)
        loss = self._global_loss(losses)
        self.optimizer.prepare_grads()
        grad_norm = float(self.optimizer.get_grad_norm())
        lr = self.lr
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            self._on_non_finite(loss, grad_norm)
            return StepResult(loss=loss, grad_norm=grad_norm, lr=lr, skipped=True, metrics=metrics)
        self._clip(grad_norm)
        self.optimizer.step_with_ready_grads()
        self.scheduler.step(increment=1)
        self.num_steps += 1
        return StepResult(loss=loss, grad_norm=grad_norm, lr=lr, skipped=False, metrics=metrics)

    def _router_losses(self, micro_batches: list) -> contextlib.AbstractContextManager:
        """MoE router losses as a token-weighted mean over the step's micro-batches and DP ranks (see
        `router_losses_per_token`), so their gradient does not grow with either count. At cp > 1 each cp rank
        routes its own share of every micro-batch's tokens, so the count sums over dp x cp."""
        if not has_router_losses(self.module):
            return contextlib.nullcontext()
        num_tokens = torch.tensor(sum(routed_tokens(mb) for mb in micro_batches), dtype=torch.int64,
                                  device=current_device())
        dist.all_reduce(num_tokens, group=self.pg_collection.dp_cp)
        return megatron_compat.router_losses_per_token(self.module, int(num_tokens))

    def _global_loss(self, losses: list[torch.Tensor]) -> float:
        """Sum of this step's loss values over micro-batches and DP, known to every rank of the role."""
        pp_group, dp_group = self.pg_collection.pp, self.pg_collection.dp
        total = torch.stack(losses).sum() if losses else torch.zeros((), dtype=torch.float32, device=current_device())
        total = total.to(torch.float64)
        dist.all_reduce(total, group=dp_group)
        if pp_group.size() > 1:
            dist.broadcast(total, src=dist.get_global_rank(pp_group, pp_group.size() - 1), group=pp_group)
        return float(total)

    def _on_non_finite(self, loss: float, grad_norm: float) -> None:
        what = "loss" if not math.isfinite(loss) else "gradient norm"
        where = f"{self.name} train step {self.num_steps + 1}: non-finite {what} (loss={loss}, grad_norm={grad_norm})"
        if self.config.nan_policy == "abort":
            raise NonFiniteError(f"{where}; aborting as optim.nan_policy='abort' (set 'skip' to skip such steps)")
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()

    def _clip(self, grad_norm: float) -> None:
        """Scale the grads in place by clip / (norm + 1e-6) when below 1: megatron's
        `clip_grad_by_total_norm_fp32`, whose host fallback writes `grad * coeff` to a new tensor and copies it back."""
        clip_coeff = self.config.clip_grad / (grad_norm + 1.0e-6)
        if self.config.clip_grad <= 0 or clip_coeff >= 1.0:
            return
        for optimizer in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            for param in optimizer.get_parameters():
                if param.grad is not None:
                    param.grad.detach().mul_(clip_coeff)

    def state_dict(self) -> dict:
        """This rank's small, layout-free state (scheduler, step counts); the tensors: `checkpoint_tensors`."""
        self._check_loaded()
        return {"scheduler": self.scheduler.state_dict(), "num_steps": self.num_steps,
                "optimizer_steps": adam_step(self.optimizer)}

    def checkpoint_tensors(self) -> Tensors:
        """Collective over the role's mesh: the full weight and Adam tensors this rank writes (host copies)."""
        self._check_loaded()
        return checkpoint_tensors(self.model.module, self.optimizer)

    def load_state_dict(self, state: dict, folder_of: Callable[[str], HfFolder]) -> None:
        """Restore what `state_dict` and `checkpoint_tensors` saved, from any layout; on the same layout the
        next step is bitwise the uninterrupted one. A checkpoint of another model is a CheckpointError."""
        self._check_loaded()
        check_trained_folder(folder_of("model"), self.model.module)
        load_checkpoint_tensors(self.model.module, self.optimizer, folder_of, state["optimizer_steps"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.num_steps = state["num_steps"]

    def offload(self, *, keep_params: bool = False) -> None:
        """With `optim.offload`: free params, grads and optimizer state from the device, keeping a host copy.

        Call it when the role's phase ends (e.g. before rollout); without `optim.offload` it does nothing.
        `keep_params` keeps the parameters resident (a colocated rollout engine reads them).
        """
        if self.config.offload and self._offloaded is None:
            self._offloaded = offload_lib.offload(self.model, self.optimizer, keep_params=keep_params)

    def reload(self) -> None:
        """Bring back what `offload` moved; grads come back zeroed."""
        if self._offloaded is not None:
            offload_lib.reload(self.model, self._offloaded)
            self._offloaded = None

    def _check_loaded(self) -> None:
        if self._offloaded is not None:
            raise RuntimeError(f"the {self.name} engine is offloaded; call reload() before using it")
