"""megatron-core on a host without CUDA: the CPU adapter `apply()`, its process-wide state, and the CPU-only
replacements of megatron's private functions it installs (re-exported as `rlhf.platform.compat.megatron.apply`).

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
    weight is cast to bf16 once, and its backward's `grad_output @ weight` reuses that copy; outside autocast the
    product goes to `rlhf.platform.gemm.matmul` (oneDNN for fp32 on a CPU);
  A TorchFunctionMode is deliberately not used for that: autograd switches it off in backward, breaking recompute.
- `_carry_host_autocast` (inside `apply()`): megatron's linear autograd functions
  (`LinearWithGradAccumulationAndAsyncCommunication`, `LinearWithFrozenWeight`) carry autocast into their
  backward only for CUDA (`custom_fwd/custom_bwd(device_type="cuda")`); their forward and backward are wrapped
  to do the same for the host's autocast (`rlhf.platform.autocast` on a CPU), else a bf16 grad_output meets
  the fp32 weight in backward. Under it, an fp32 input is cast to bf16 once, before megatron saves it (autocast
  would cast it again for the wgrad GEMM), and the placeholder weight grad megatron returns next to a fused wgrad
  comes back in the weight's dtype (autograd would convert a bf16 one: a copy of the weight per micro-batch). The
  backward runs inside `rlhf.platform.gemm.matmuls()` (a TorchFunctionMode entered in the backward itself), so its
  dgrad `grad_output.matmul(weight)` takes oneDNN as the forward does.
- `_lean_rope` (inside `apply()`): replaces `rope_utils._apply_rotary_pos_emb_bshd` (private; unfused RoPE, what
  runs without TE's fused kernel) with the same arithmetic minus its waste: cos/sin of the step's `freqs` once
  per forward instead of twice per layer (the last `freqs` tensor is remembered), no `* mscale` when it is 1, no
  concatenation with the empty pass-through part; and `_apply_rotary_pos_emb_thd` (packed sequences) with the
  same, its per-sequence gather of `freqs` (`_get_thd_freqs_on_this_cp_rank`, private) done once per pack (the
  last `freqs` / `cu_seqlens` pair is remembered) instead of for q and k in every layer, so the bshd cos/sin
  cache holds for packs too. The rotation itself is `rlhf.platform.rope.rotate` (bshd and THD packs alike, so
  padded and packed forwards round the same): the kernel library's one pass forward and backward for fp32 on CPU
  (its rounding: within fp32 of the original), else the original's torch formula bit for bit. Interleaved, MLA and
  partial rotary keep the original.
- `_fp32_residual` (inside `apply()`): under CPU autocast, `fused_bias_dropout._bias_dropout_add_func` (private;
  the unfused bias-dropout-add every layer runs) adds a bf16 sublayer output to an fp32 residual in fp32, where
  megatron casts the residual down to bf16 (AMP O1's choice for GPU pipelines): the residual stream and the norms
  stay fp32, as in transformers under autocast, the norm runs torch's fused kernel (it has none for a bf16 input
  with fp32 weights), and a pipeline stage hands on fp32 (its `pipeline_dtype`). Off autocast: the original.
"""

from __future__ import annotations

import contextlib
import sys
import types
from typing import Any

import torch
import torch.distributed as dist

from rlhf.platform import gemm
from rlhf.platform import rope as platform_rope

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
    return gemm.matmul(input, other) if not kwargs else torch.matmul(input, other, **kwargs)


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
        if t.dim() == 4 and cos.shape == (t.shape[0], 1, 1, t.shape[-1]):
            # [s, b, h, d] (a THD pack: [T, 1, h, d]) with a row per s: the platform's RoPE (a CPU kernel for fp32)
            flat_cos, flat_sin = cos.view(t.shape[0], t.shape[-1]), sin.view(t.shape[0], t.shape[-1])
            return platform_rope.rotate(t, flat_cos, flat_sin)
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
            with torch.autocast("cpu", dtype=dtype, enabled=enabled), gemm.matmuls():
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
