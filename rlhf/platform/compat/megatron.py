"""megatron-core's touch-points: the patches and private reads rlhf needs (the CPU adapter, `apply()`, is
`megatron_host`'s and re-exported here).

pinned: megatron-core==0.16.1

Touch-points (name: what it does; why):
- `apply()`: `rlhf.platform.compat.megatron_host.apply` (megatron-core on a host without CUDA).
- `seed_rng_tracker`: seeds the process-wide RNG tracker (`tensor_parallel.random`) that attention dropout and
  weight init fork from, with the tp rank of the model being built (roles colocated in one process share it:
  with dropout > 0 they must use the same tp layout).
- `ensure_memory_buffer`: creates `parallel_state._GLOBAL_MEMORY_BUFFER` (private), the scratch buffer the
  local attention spec takes; it holds no layout, so one per process serves every role.
- `default_group_as`: patches `torch.distributed.all_gather_object` / `get_world_size` while megatron's
  `get_megatron_optimizer` runs: it agrees on param-group keys over the default (world) group, which would pair
  up roles on disjoint ranks (split placement) or built one after another, and hang or mix.
- `process_groups`: a `ProcessGroupCollection` with rlhf's own extra attribute `layout_all` (every rank of the
  layout); megatron ignores attributes it does not declare.
- `param_range`: a distributed optimizer's private `_get_model_param_range_map` (the [start, end) of a param's
  flat piece held on this DP rank), for the layout-free optimizer state.
- `routers` / `router_losses_per_token`: megatron's `TopKRouter`s by class name; while open, each router's
  `calculate_per_token_loss` is set and the config's `moe_aux_loss_coeff` / `moe_z_loss_coeff` are divided by
  the step's routed tokens, so router losses are a token-weighted mean over micro-batches and DP ranks
  (megatron otherwise adds them once per micro-batch and per DP rank). At cp > 1 each cp rank's router sees
  its own tokens: the z-loss coefficient is multiplied back by tp x cp (megatron divides it by that), and the
  load-balancing loss needs nothing: each rank's is its share of the micro-batch's (local probabilities, loads
  summed over tp x cp), weighted by the micro-batch's tokens over tp x cp (megatron's "local" count, read after
  its in-place all-reduce of the loads), so the cp ranks' gradients add up to the cp = 1 ones (tested).
- `fuse_wgrad_accumulation`: megatron's `gradient_accumulation_fusion` on the local linears of a DDP-wrapped
  model: the weight-gradient GEMM accumulates straight into the DDP grad buffer (`main_grad += g^T x`:
  `rlhf.platform.gemm.add_weight_grad_`, oneDNN's product added in place for fp32 on a CPU, else one GEMM with
  beta=1) instead of writing a fresh `.grad` the DDP hook then adds in. megatron implements it in apex's
  CUDA extension `fused_weight_gradient_mlp_cuda`; where that is absent, its module global in
  `tensor_parallel.layers` is a torch stand-in (`_HostWgradAccumulation`). Set per module after the DDP wrap
  (megatron reads the flag at build time and would otherwise need `main_grad` on every linear's weight).
  The same call switches each `VocabParallelEmbedding` (no sequence parallelism, not deterministic mode) to a
  forward of rlhf's own (megatron's, with the lookup an autograd function) whose backward index-adds the
  looked-up rows' gradients into `main_grad`, instead of a dense [vocab, hidden] zero-filled gradient per
  micro-batch that the DDP hook then adds in (SmolLM2: 113 MB allocated, filled and added twice per micro-batch).
- `main_grad_of` / `add_weight_grad`: a weight's DDP `main_grad`, for rlhf's own autograd functions (the fused
  LM head) to accumulate into in place and return no `.grad`: rlhf's DDP never overlaps the grad reduce
  (`rlhf.train.engine`), so megatron's per-param hook only adds `.grad` into `main_grad` and may be skipped.
- `silence_unknown_mlp_warning`: a filter on `megatron.core.transformer.transformer_layer`'s logger, which
  warns "Unknown MLP type" for any MLP class it does not list (rlhf's `TensorParallelMoELayer`).

Public but version-bound, used in place (re-read them on a bump): `rlhf.models.moe_tp` overrides
`MoELayer.forward` with its own sequence of `route` / `preprocess` / `dispatch` / `routed_experts_compute` /
`combine` / `postprocess`; `rlhf.models.routing` hooks `TopKRouter.forward` (outputs `(probs, routing_map)`);
`rlhf.models.routing_replay` fills the router's `router_replay` slot; `rlhf.train.state` reads the optimizers'
`model_param_group_index_map`, `float16_groups`, `fp32_from_float16_groups`, `fp32_from_fp32_groups`.
"""

from __future__ import annotations

import contextlib
import logging
import types
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from rlhf.platform import gemm
from rlhf.platform.compat.megatron_host import apply  # noqa: F401 - the CPU adapter, re-exported


def seed_rng_tracker(seed: int, tp_rank: int) -> None:
    """(Re)seed megatron's process-wide RNG tracker without reading its parallel_state globals."""
    from megatron.core import tensor_parallel

    apply()
    tensor_parallel.model_parallel_cuda_manual_seed(seed, tp_rank=tp_rank, ep_rank=0, etp_rank=0,
                                                    force_reset_rng=True)


def ensure_memory_buffer() -> None:
    """Create megatron's process-wide scratch buffer once (the local attention spec asks for it)."""
    from megatron.core import parallel_state

    if parallel_state._GLOBAL_MEMORY_BUFFER is None:
        parallel_state._set_global_memory_buffer()


@contextlib.contextmanager
def default_group_as(group: dist.ProcessGroup) -> Iterator[None]:
    """While active, megatron's group-less `all_gather_object` / `get_world_size` calls use `group`.

    Only wrap a megatron call known to use the default group for role-local agreement (optimizer building).
    """
    gather, world_size = dist.all_gather_object, dist.get_world_size

    def role_gather(object_list, obj, group_arg=None, **kwargs):
        return gather(object_list, obj, group=group_arg or kwargs.pop("group", None) or group, **kwargs)

    def role_world_size(group_arg=None, **kwargs):
        return world_size(group_arg or kwargs.pop("group", None) or group)

    dist.all_gather_object, dist.get_world_size = role_gather, role_world_size
    try:
        yield
    finally:
        dist.all_gather_object, dist.get_world_size = gather, world_size


def process_groups(layout_all: dist.ProcessGroup, **groups: Any) -> Any:
    """megatron's `ProcessGroupCollection` of `groups`, carrying rlhf's `layout_all` (every rank of the layout)."""
    from megatron.core.process_groups_config import ProcessGroupCollection  # slow import, needed late

    collection = ProcessGroupCollection(**groups)
    collection.layout_all = layout_all
    return collection


def param_range(optimizer: Any, param: torch.nn.Parameter) -> tuple[int, int]:
    """[start, end) of `param`'s flattened elements held on this DP rank by a megatron DistributedOptimizer."""
    piece = optimizer._get_model_param_range_map(param)["param"]
    return piece.start, piece.end


def routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Every megatron top-k router of `model` (one per MoE layer of this pipeline stage)."""
    return [m for m in model.modules() if type(m).__name__ == "TopKRouter"]


@contextlib.contextmanager
def router_losses_per_token(model: torch.nn.Module, num_tokens: int) -> Iterator[None]:
    """While open, each forward's router losses enter the gradients weighted by its share of the `num_tokens`
    routed in the whole optimizer step (every micro-batch and DP rank): their token-weighted mean, at the
    configured coefficients. Megatron otherwise adds them once per micro-batch and per DP rank."""
    config, found = model.config, routers(model)
    saved = (config.moe_aux_loss_coeff, config.moe_z_loss_coeff, [r.calculate_per_token_loss for r in found])
    shards = found[0].tp_cp_group.size() if found else 1  # ranks splitting a micro-batch's tokens (cp)
    for router in found:
        router.calculate_per_token_loss = True  # megatron multiplies each forward's losses by its token count
    config.moe_aux_loss_coeff = saved[0] / num_tokens if saved[0] else saved[0]
    # megatron divides the z-loss by its tp x cp size; each cp rank's router sees its own tokens, so undo it
    config.moe_z_loss_coeff = saved[1] * shards / num_tokens if saved[1] else saved[1]
    try:
        yield
    finally:
        config.moe_aux_loss_coeff, config.moe_z_loss_coeff = saved[0], saved[1]
        for router, per_token in zip(found, saved[2]):
            router.calculate_per_token_loss = per_token


def add_weight_grad(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    """`main_grad += grad_output^T @ total_input`, in place (`gemm.add_weight_grad_`) when the dtypes agree; else
    the product in the inputs' dtype (bf16 GEMMs stay bf16), then added, as unfused."""
    if total_input.dtype == grad_output.dtype == main_grad.dtype:
        gemm.add_weight_grad_(main_grad, grad_output, total_input)
    else:
        main_grad.add_(grad_output.t().matmul(total_input))


class _HostWgradAccumulation:
    """Stands in for apex's `fused_weight_gradient_mlp_cuda` (`add_weight_grad`)."""

    wgrad_gemm_accum_fp32 = wgrad_gemm_accum_fp16 = staticmethod(add_weight_grad)


def fuse_wgrad_accumulation(model: torch.nn.Module) -> int:
    """Weight gradients of `model`'s local Column/RowParallelLinears and vocab-parallel embeddings accumulate
    into their DDP `main_grad` (see the module docstring); returns how many modules were switched. Call after
    the DDP wrap."""
    from megatron.core.tensor_parallel import layers

    if not layers._grad_accum_fusion_available or getattr(layers, "fused_weight_gradient_mlp_cuda", None) is None:
        layers.fused_weight_gradient_mlp_cuda = _HostWgradAccumulation
        layers._grad_accum_fusion_available = True
    switched = 0
    for module in model.modules():
        if isinstance(module, layers.VocabParallelEmbedding) and main_grad_of(module.weight) is not None \
                and not module.reduce_scatter_embeddings and not module.deterministic_mode:
            module.forward = types.MethodType(_embedding_forward, module)
            switched += 1
        elif isinstance(module, (layers.ColumnParallelLinear, layers.RowParallelLinear)):
            weight = getattr(module, "weight", None)
            if weight is not None and weight.requires_grad and hasattr(weight, "main_grad") \
                    and weight.main_grad.dtype in (torch.float32, torch.float16, torch.bfloat16):
                module.gradient_accumulation_fusion = True
                switched += 1
    return switched


def main_grad_of(weight: torch.Tensor) -> torch.Tensor | None:
    """The DDP grad-buffer view `weight`'s gradient accumulates into (megatron DDP's `main_grad`), or None
    (outside DDP, or a frozen weight): a backward may add into it in place and return no gradient."""
    main_grad = getattr(weight, "main_grad", None)
    return main_grad if weight.requires_grad and isinstance(main_grad, torch.Tensor) else None


class _LookupIntoMainGrad(torch.autograd.Function):
    """`F.embedding(ids, weight)` whose weight gradient is index-added into `weight.main_grad` (none returned)."""

    @staticmethod
    def forward(ctx, ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.weight = weight
        return torch.nn.functional.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor) -> tuple[None, None]:
        (ids,) = ctx.saved_tensors
        main_grad = ctx.weight.main_grad  # read late: an offloaded engine refills its buffers on reload
        main_grad.index_add_(0, ids.reshape(-1), grad_out.reshape(-1, grad_out.shape[-1]).to(main_grad.dtype))
        return None, None


def _embedding_forward(module: torch.nn.Module, input_: torch.Tensor) -> torch.Tensor:
    """megatron's `VocabParallelEmbedding.forward` (tp masking, lookup, reduce over tp) with the lookup above."""
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    sharded = module.tp_group.size() > 1
    if sharded:
        outside = (input_ < module.vocab_start_index) | (input_ >= module.vocab_end_index)
        input_ = (input_ - module.vocab_start_index).masked_fill_(outside, 0)
    output = _LookupIntoMainGrad.apply(input_, module.weight)
    if sharded:
        output = output.masked_fill(outside[..., None], 0.0)
    return reduce_from_tensor_model_parallel_region(output, group=module.tp_group)


class _UnknownMlpWarning(logging.Filter):
    """megatron's TransformerLayer warns about any MLP class it does not list; rlhf's MoE layer it builds right."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Unknown MLP type")


def silence_unknown_mlp_warning() -> None:
    """Drop megatron's "Unknown MLP type" warning (idempotent)."""
    logger = logging.getLogger("megatron.core.transformer.transformer_layer")
    if not any(isinstance(f, _UnknownMlpWarning) for f in logger.filters):
        logger.addFilter(_UnknownMlpWarning())
