"""megatron-core's touch-points: the CPU adapter (`apply()`), its process-wide state, and the patches rlhf needs.

pinned: megatron-core==0.16.1

Touch-points (name: what it does; why):
- `apply()`, CPU hosts only (a no-op with CUDA): megatron-core touches CUDA in many places (buffers at
  `device=torch.cuda.current_device()`, `torch.zeros(..., device="cuda")` in the schedules, CUDA RNG states,
  `.cuda()`, grad type checks against `'torch.cuda.FloatTensor'`); exactly those are redirected:
  - patches `torch.cuda.current_device` (the CPU device), `torch.cuda.synchronize` (nothing), `Tensor.cuda`
    (the tensor itself), `Tensor.type()` without arguments (the CUDA type name: the optimizer and clip_grads
    compare against it), `torch.cuda.{get,set}_rng_state` / `manual_seed` and megatron's private
    `tensor_parallel.random._{get,set}_cuda_rng_state` (the CPU generator), `torch.cuda.Stream` /
    `current_stream` / `stream` (host stand-ins: the MoE all-to-all dispatcher copies its split sizes on a side
    stream; on the CPU every op is already ordered);
  - swaps the `torch` global of every loaded `megatron.core.*` module for a proxy whose tensor factories map a
    CUDA device to the CPU (patching `torch.zeros` globally broke `transformers`) and whose `distributed` runs
    list all-gathers / reduce-scatters of unequal sizes (the MoE dispatcher's gathers over tp) as a padded
    all-gather and an all-reduce: gloo only takes equal sizes;
  - wraps `moe.*.maybe_move_tensor_to_cpu` so `as_numpy=True` returns numpy for a CPU tensor too (megatron only
    converts device tensors, and `all_to_all_single` takes no tensor of sizes);
  - defines `moe_utils.te_general_gemm = None`: the router's gating GEMM tests that Transformer-Engine symbol,
    never defined without TE (a NameError in 0.16.1), so megatron takes its torch path.
  - gives that proxy a `matmul` that, under CPU autocast, computes `x @ param.t()` of an fp32 `Parameter` as
    `F.linear(x, param)`: bitwise the same product, but autocast casts the parameter itself (a leaf) instead of
    its transpose (a view, which autocast never caches), so inside `rlhf.platform.autocast_weight_cache` each
    weight is cast to bf16 once, and its backward's `grad_output @ weight` reuses that copy;
  A TorchFunctionMode is deliberately not used: autograd switches it off in backward, breaking recompute.
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
  model: the weight-gradient GEMM accumulates straight into the DDP grad buffer (`main_grad += g^T x`, one GEMM
  with beta=1) instead of writing a fresh `.grad` the DDP hook then adds in. megatron implements it in apex's
  CUDA extension `fused_weight_gradient_mlp_cuda`; where that is absent, its module global in
  `tensor_parallel.layers` is a torch stand-in (`_HostWgradAccumulation`). Set per module after the DDP wrap
  (megatron reads the flag at build time and would otherwise need `main_grad` on every linear's weight).
- `_carry_host_autocast` (inside `apply()`): megatron's linear autograd functions
  (`LinearWithGradAccumulationAndAsyncCommunication`, `LinearWithFrozenWeight`) carry autocast into their
  backward only for CUDA (`custom_fwd/custom_bwd(device_type="cuda")`); their forward and backward are wrapped
  to do the same for the host's autocast (`rlhf.platform.autocast` on a CPU), else a bf16 grad_output meets
  the fp32 weight in backward. Under it, an fp32 input is cast to bf16 once, before megatron saves it (autocast
  would cast it again for the wgrad GEMM), and the placeholder weight grad megatron returns next to a fused wgrad
  comes back in the weight's dtype (autograd would convert a bf16 one: a copy of the weight per micro-batch).
- `_lean_rope` (inside `apply()`): replaces `rope_utils._apply_rotary_pos_emb_bshd` (private; unfused RoPE, what
  runs without TE's fused kernel) with the same arithmetic minus its waste: cos/sin of the step's `freqs` once
  per forward instead of twice per layer (the last `freqs` tensor is remembered), no `* mscale` when it is 1, no
  concatenation with the empty pass-through part; and `_apply_rotary_pos_emb_thd` (packed sequences) with the
  same, its per-sequence gather of `freqs` (`_get_thd_freqs_on_this_cp_rank`, private) done once per pack (the
  last `freqs` / `cu_seqlens` pair is remembered) instead of for q and k in every layer, so the bshd cos/sin
  cache holds for packs too. Bitwise the original's output and gradients; interleaved, MLA and partial rotary
  keep the original.
- `_fp32_residual` (inside `apply()`): under CPU autocast, `fused_bias_dropout._bias_dropout_add_func` (private;
  the unfused bias-dropout-add every layer runs) adds a bf16 sublayer output to an fp32 residual in fp32, where
  megatron casts the residual down to bf16 (AMP O1's choice for GPU pipelines): the residual stream and the norms
  stay fp32, as in transformers under autocast, the norm runs torch's fused kernel (it has none for a bf16 input
  with fp32 weights), and a pipeline stage hands on fp32 (its `pipeline_dtype`). Off autocast: the original.
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
import sys
import types
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

_FACTORIES = ("arange", "as_tensor", "empty", "empty_like", "full", "full_like", "linspace", "ones",
              "ones_like", "rand", "randint", "randn", "randperm", "tensor", "zeros", "zeros_like")
_PROXY_MARK = "_rlhf_cpu_proxy"
_state = {"applied": False}


def _to_cpu_device(device: Any) -> Any:
    """A CUDA device spec (string, torch.device or ordinal) becomes the CPU device; others pass through."""
    if isinstance(device, int) and not isinstance(device, bool):
        return torch.device("cpu")
    if isinstance(device, (str, torch.device)) and torch.device(device).type == "cuda":
        return torch.device("cpu")
    return device


def _cpu_factory(factory: Any) -> Any:
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if "device" in kwargs:
            kwargs["device"] = _to_cpu_device(kwargs["device"])
        return factory(*args, **kwargs)

    wrapped.__name__ = factory.__name__
    wrapped.__doc__ = factory.__doc__
    return wrapped


def _uneven_all_gather(tensor_list: list, tensor: torch.Tensor, group: Any = None, async_op: bool = False) -> Any:
    """`dist.all_gather`, where parts of unequal first dimension travel zero-padded to the longest."""
    if async_op or all(part.shape == tensor.shape for part in tensor_list):
        return torch.distributed.all_gather(tensor_list, tensor, group=group, async_op=async_op)
    rows = max(part.shape[0] for part in tensor_list)
    padded = tensor.new_zeros((rows, *tensor.shape[1:]))
    padded[:tensor.shape[0]] = tensor
    parts = [torch.empty_like(padded) for _ in tensor_list]
    torch.distributed.all_gather(parts, padded, group=group)
    for out, part in zip(tensor_list, parts):
        out.copy_(part[:out.shape[0]])
    return None


def _list_reduce_scatter(output: torch.Tensor, input_list: list, op: Any = None, group: Any = None,
                         async_op: bool = False) -> None:
    """`dist.reduce_scatter` of a list (gloo has none): an all-reduce of the whole, this rank's part kept."""
    assert not async_op and op in (None, torch.distributed.ReduceOp.SUM)
    full = torch.cat([part.reshape(part.shape[0], -1) for part in input_list])
    torch.distributed.all_reduce(full, group=group)
    start = sum(part.shape[0] for part in input_list[:torch.distributed.get_rank(group)])
    output.copy_(full[start:start + output.shape[0]].view_as(output))


class _HostDistributed(types.ModuleType):
    """Stands in for `torch.distributed` inside megatron.core modules: unequal list collectives for gloo."""

    def __init__(self) -> None:
        super().__init__("torch.distributed")
        self.all_gather, self.reduce_scatter = _uneven_all_gather, _list_reduce_scatter

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.distributed, name)


def _cast_once_matmul(input: torch.Tensor, other: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    """`torch.matmul`, where under CPU autocast `input @ param.t()` (megatron's linears) runs as
    `F.linear(input, param)`: the same GEMM on the same bf16 operands, with the cast of `param` cacheable."""
    base = other._base
    if (isinstance(base, torch.nn.Parameter) and not kwargs and input.dim() >= 2 and base.dim() == 2
            and base.dtype == torch.float32 and other.shape == base.shape[::-1]
            and other.stride() == base.stride()[::-1] and torch.is_autocast_enabled("cpu")):
        return torch.nn.functional.linear(input, base)
    return torch.matmul(input, other, **kwargs)


class _CpuTorch(types.ModuleType):
    """Stands in for `torch` inside megatron.core modules: factories keep CUDA devices off the CPU host, and
    `matmul` lets autocast cache its cast of a linear's weight."""

    def __init__(self) -> None:
        super().__init__("torch")
        setattr(self, _PROXY_MARK, True)
        for name in _FACTORIES:
            setattr(self, name, _cpu_factory(getattr(torch, name)))
        self.matmul = _cast_once_matmul
        self.distributed = _HostDistributed()

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def _cpu_rng_get(*_args: Any, **_kwargs: Any) -> torch.Tensor:
    return torch.get_rng_state()


def _cpu_rng_set(state: torch.Tensor, *_args: Any, **_kwargs: Any) -> None:
    torch.set_rng_state(state)


def _cpu_seed(seed: int, *_args: Any, **_kwargs: Any) -> None:
    torch.manual_seed(seed)


class _HostEvent:
    def synchronize(self) -> None:
        return None

    def wait(self, *_args: Any) -> None:
        return None


class _HostStream:
    """Stands in for `torch.cuda.Stream` on a CPU host, where all work runs in program order. A class, not a
    factory: libraries annotate with `torch.cuda.Stream | None` at import time (transformers' generation)."""

    def __init__(self, *_args: Any, **_kwargs: Any) -> None:
        pass

    def wait_stream(self, _other: Any) -> None:
        return None

    def wait_event(self, _event: Any) -> None:
        return None

    def record_event(self, _event: Any = None) -> _HostEvent:
        return _HostEvent()

    def synchronize(self) -> None:
        return None


_HOST_STREAM = _HostStream()


def _host_copy(original: Any) -> Any:
    def maybe_move_tensor_to_cpu(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        if as_numpy and torch.is_tensor(tensor) and tensor.device.type == "cpu":
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    maybe_move_tensor_to_cpu.rlhf_host_copy = True
    return maybe_move_tensor_to_cpu


def _patch_torch() -> None:
    original_type = torch.Tensor.type

    def tensor_type(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        name = original_type(self, *args, **kwargs)
        if not args and not kwargs and isinstance(name, str) and name.startswith("torch."):
            return name.replace("torch.", "torch.cuda.", 1)
        return name

    torch.Tensor.type = tensor_type
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.Stream = _HostStream
    torch.cuda.current_stream = lambda *args, **kwargs: _HOST_STREAM
    torch.cuda.stream = lambda *args, **kwargs: contextlib.nullcontext()
    torch.cuda.get_rng_state = _cpu_rng_get
    torch.cuda.set_rng_state = _cpu_rng_set
    torch.cuda.manual_seed = _cpu_seed
    torch.cuda.random.get_rng_state = _cpu_rng_get
    torch.cuda.random.set_rng_state = _cpu_rng_set


def _patch_megatron_modules() -> None:
    """Swap `torch` for the CPU proxy in every loaded megatron.core module (new ones on each call; the scan of
    sys.modules is skipped while no module was imported since the last one: it runs before every forward)."""
    if _state.get("modules_seen") == len(sys.modules):
        return
    _state["modules_seen"] = len(sys.modules)
    proxy = _state.setdefault("proxy", _CpuTorch())
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith("megatron.core"):
            continue
        if getattr(module, "torch", None) is torch:
            module.torch = proxy
        if name == "megatron.core.tensor_parallel.random":
            module._get_cuda_rng_state = _cpu_rng_get
            module._set_cuda_rng_state = _cpu_rng_set
        if name == "megatron.core.transformer.moe.moe_utils" and not hasattr(module, "te_general_gemm"):
            module.te_general_gemm = None
        move = getattr(module, "maybe_move_tensor_to_cpu", None) if name.startswith("megatron.core.transformer.moe") \
            else None
        if move is not None and not getattr(move, "rlhf_host_copy", False):
            module.maybe_move_tensor_to_cpu = _host_copy(move)


def apply() -> None:
    """Adapt megatron-core to a CPU-only host; idempotent, and a no-op when CUDA is available.

    Call it after importing megatron modules (the builder and forward helpers do): modules loaded since
    the previous call are adapted too.
    """
    if torch.cuda.is_available():
        return
    import megatron.core.pipeline_parallel.schedules  # noqa: F401 - load the modules we adapt
    import megatron.core.tensor_parallel.random  # noqa: F401

    if not _state["applied"]:
        _patch_torch()
        _carry_host_autocast()
        _lean_rope()
        _fp32_residual()
        _state["applied"] = True
    _patch_megatron_modules()


def _lean_rope() -> None:
    """`_apply_rotary_pos_emb_bshd` without recomputing cos/sin per call and without the empty concatenation."""
    from megatron.core.models.common.embeddings import rope_utils

    original = rope_utils._apply_rotary_pos_emb_bshd
    last: dict[str, Any] = {}

    def cos_sin(freqs: torch.Tensor, mscale: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        key = (freqs._version, mscale, dtype, torch.is_inference_mode_enabled())
        if last.get("freqs") is not freqs or last.get("key") != key:
            cos, sin = torch.cos(freqs), torch.sin(freqs)
            if mscale != 1.0:
                cos, sin = cos * mscale, sin * mscale
            last.update(freqs=freqs, key=key, cos_sin=(cos.to(dtype), sin.to(dtype)))
        return last["cos_sin"]

    def lean(t: torch.Tensor, freqs: torch.Tensor, rotary_interleaved: bool = False,
             multi_latent_attention: bool = False, mscale: float = 1.0) -> torch.Tensor:
        if rotary_interleaved or multi_latent_attention or t.shape[-1] != freqs.shape[-1] or freqs.requires_grad:
            return original(t, freqs, rotary_interleaved=rotary_interleaved,
                            multi_latent_attention=multi_latent_attention, mscale=mscale)
        cos, sin = cos_sin(freqs, mscale, t.dtype)
        first, second = torch.chunk(t, 2, dim=-1)
        return (t * cos) + (torch.cat((-second, first), dim=-1) * sin)

    original_thd = rope_utils._apply_rotary_pos_emb_thd
    packed: dict[str, Any] = {}

    def packed_freqs(t: torch.Tensor, cu_seqlens: torch.Tensor, freqs: torch.Tensor,
                     cp_group: torch.distributed.ProcessGroup) -> torch.Tensor:
        key = (freqs._version, cu_seqlens._version, cp_group.size(), cp_group.rank(),
               torch.is_inference_mode_enabled())
        if packed.get("freqs") is not freqs or packed.get("cu_seqlens") is not cu_seqlens or packed.get("key") != key:
            seqlens = ((cu_seqlens[1:] - cu_seqlens[:-1]) // cp_group.size()).tolist()
            starts = cu_seqlens[:-1].tolist() if freqs.size(0) == cu_seqlens[-1] else [0] * len(seqlens)
            slices = [rope_utils._get_thd_freqs_on_this_cp_rank(cp_group.rank(), cp_group.size(), x, freqs, start)
                      for x, start in zip(torch.split(t, seqlens), starts)]
            packed.update(freqs=freqs, cu_seqlens=cu_seqlens, key=key, packed=torch.cat(slices, dim=0))
        return packed["packed"]

    def lean_thd(t: torch.Tensor, cu_seqlens: torch.Tensor, freqs: torch.Tensor, rotary_interleaved: bool = False,
                 multi_latent_attention: bool = False, mscale: float = 1.0,
                 cp_group: torch.distributed.ProcessGroup | None = None) -> torch.Tensor:
        if cp_group is None or rotary_interleaved or multi_latent_attention or freqs.requires_grad:
            return original_thd(t, cu_seqlens, freqs, rotary_interleaved=rotary_interleaved,
                                multi_latent_attention=multi_latent_attention, mscale=mscale, cp_group=cp_group)
        return lean(t.unsqueeze(1), packed_freqs(t, cu_seqlens, freqs, cp_group), mscale=mscale).squeeze(1)

    rope_utils._apply_rotary_pos_emb_bshd = lean
    rope_utils._apply_rotary_pos_emb_thd = lean_thd


def _fp32_residual() -> None:
    """Megatron's bias-dropout-add keeps an fp32 residual in fp32 under CPU autocast (see the module docstring)."""
    from megatron.core.fusions import fused_bias_dropout

    original = fused_bias_dropout._bias_dropout_add_func

    def fp32_residual(x_with_bias: tuple, residual: torch.Tensor, prob: float, training: bool) -> torch.Tensor:
        x, bias = x_with_bias
        if x.dtype != residual.dtype and residual.dtype == torch.float32 and torch.is_autocast_enabled("cpu"):
            x_with_bias = (x.float(), None if bias is None else bias.float())
        return original(x_with_bias, residual, prob, training)

    fused_bias_dropout._bias_dropout_add_func = fp32_residual


def _carry_host_autocast() -> None:
    """The forward's CPU autocast state (enabled, dtype) is restored around the backward of megatron's linears."""
    from megatron.core.tensor_parallel import layers

    for function in (layers.LinearWithGradAccumulationAndAsyncCommunication, layers.LinearWithFrozenWeight):
        forward, backward = function.forward, function.backward

        def carried_forward(ctx: Any, input: torch.Tensor, *args: Any, _forward: Any = forward) -> Any:
            enabled, dtype = ctx.rlhf_host_autocast = (torch.is_autocast_enabled("cpu"),
                                                       torch.get_autocast_dtype("cpu"))
            if enabled and input.dtype == torch.float32:
                input = input.to(dtype)  # what autocast casts it to, done once: saved as such for the wgrad GEMM
            return _forward(ctx, input, *args)

        def carried_backward(ctx: Any, *grads: Any, _backward: Any = backward) -> Any:
            enabled, dtype = getattr(ctx, "rlhf_host_autocast", (False, torch.bfloat16))
            with torch.autocast("cpu", dtype=dtype, enabled=enabled):
                input_grads = _backward(ctx, *grads)
            return _placeholder_in_weight_dtype(ctx, input_grads) if enabled else input_grads

        function.forward, function.backward = staticmethod(carried_forward), staticmethod(carried_backward)


def _placeholder_in_weight_dtype(ctx: Any, input_grads: tuple) -> tuple:
    """With the wgrad already in `main_grad`, megatron returns an unused placeholder weight grad in the input's
    dtype; under autocast that is bf16, which autograd would convert to the fp32 weight's dtype (a copy of the
    whole weight per micro-batch). Return it in the weight's dtype instead: the DDP hook drops it unread."""
    weight_grad = input_grads[1] if len(input_grads) > 1 else None
    if weight_grad is None or not getattr(ctx, "gradient_accumulation_fusion", False):
        return input_grads
    weight = ctx.saved_tensors[1]
    if weight_grad.dtype == weight.dtype or not getattr(weight, "grad_added_to_main_grad", False) \
            or getattr(weight, "zero_out_wgrad", False):
        return input_grads
    return (input_grads[0], torch.empty_like(weight), *input_grads[2:])


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


class _HostWgradAccumulation:
    """Stands in for apex's `fused_weight_gradient_mlp_cuda`: `main_grad += grad_output^T @ input`, in place (one
    GEMM with beta=1 when the dtypes agree; else the product in the inputs' dtype, then added, as unfused)."""

    @staticmethod
    def wgrad_gemm_accum_fp32(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
        if total_input.dtype == grad_output.dtype == main_grad.dtype:
            main_grad.addmm_(grad_output.t(), total_input)
        else:
            main_grad.add_(grad_output.t().matmul(total_input))

    wgrad_gemm_accum_fp16 = wgrad_gemm_accum_fp32


def fuse_wgrad_accumulation(model: torch.nn.Module) -> int:
    """Weight gradients of `model`'s local Column/RowParallelLinears accumulate into their DDP `main_grad`
    (see the module docstring); returns how many linears were switched. Call after the DDP wrap."""
    from megatron.core.tensor_parallel import layers

    if not layers._grad_accum_fusion_available or getattr(layers, "fused_weight_gradient_mlp_cuda", None) is None:
        layers.fused_weight_gradient_mlp_cuda = _HostWgradAccumulation
        layers._grad_accum_fusion_available = True
    switched = 0
    for module in model.modules():
        if isinstance(module, (layers.ColumnParallelLinear, layers.RowParallelLinear)):
            weight = getattr(module, "weight", None)
            if weight is not None and weight.requires_grad and hasattr(weight, "main_grad") \
                    and weight.main_grad.dtype in (torch.float32, torch.float16, torch.bfloat16):
                module.gradient_accumulation_fusion = True
                switched += 1
    return switched


class _UnknownMlpWarning(logging.Filter):
    """megatron's TransformerLayer warns about any MLP class it does not list; rlhf's MoE layer it builds right."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Unknown MLP type")


def silence_unknown_mlp_warning() -> None:
    """Drop megatron's "Unknown MLP type" warning (idempotent)."""
    logger = logging.getLogger("megatron.core.transformer.transformer_layer")
    if not any(isinstance(f, _UnknownMlpWarning) for f in logger.filters):
        logger.addFilter(_UnknownMlpWarning())
