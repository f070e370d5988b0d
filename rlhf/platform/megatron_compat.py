"""The one adapter that lets megatron-core run on CPU; `apply()` is a no-op when CUDA is present.

megatron-core 0.16.1 touches CUDA in many places (buffers at `device=torch.cuda.current_device()`,
`torch.zeros(..., device="cuda")` in the schedules, CUDA RNG states, `.cuda()`, and grad type checks
against `'torch.cuda.FloatTensor'`). On a CPU-only host this module redirects exactly those touch-points:

- `torch.cuda.current_device` returns the CPU device, `torch.cuda.synchronize` does nothing,
  `Tensor.cuda` returns the tensor itself;
- inside `megatron.core.*` modules only, tensor factories map a CUDA device to the CPU (the modules' `torch`
  global is swapped for a thin proxy; patching `torch.zeros` globally broke `transformers`);
- `Tensor.type()` without arguments reports the CUDA type name for CPU tensors (megatron's optimizer and
  clip_grads compare against it);
- CUDA RNG state functions (torch's and megatron's private `_get/_set_cuda_rng_state`) use the CPU generator;
- CUDA streams and events (the MoE all-to-all token dispatcher copies its split sizes to the host on a side
  stream) are host stand-ins: on the CPU every op is already ordered, so waits and syncs do nothing; its
  host copy of the split sizes (`maybe_move_tensor_to_cpu(..., as_numpy=True)`) returns numpy for a CPU
  tensor too (megatron only converts device tensors, and `all_to_all_single` takes no tensor of sizes);
- inside `megatron.core.*` modules, list all-gathers and reduce-scatters of unequal sizes (the MoE all-to-all
  dispatcher's gathers over tp) run as an equal-size padded all-gather and an all-reduce: gloo only takes
  equal sizes;
- the MoE router's gating GEMM tests a Transformer-Engine symbol that is never defined without TE (a NameError
  in 0.16.1): it is defined as None, selecting megatron's torch path.

A TorchFunctionMode is deliberately not used: autograd switches it off in backward, breaking recompute.
"""

from __future__ import annotations

import contextlib
import sys
import types
from typing import Any

import torch

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


class _CpuTorch(types.ModuleType):
    """Stands in for `torch` inside megatron.core modules: factories keep CUDA devices off the CPU host."""

    def __init__(self) -> None:
        super().__init__("torch")
        setattr(self, _PROXY_MARK, True)
        for name in _FACTORIES:
            setattr(self, name, _cpu_factory(getattr(torch, name)))
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
        _state["applied"] = True
    _patch_megatron_modules()
