"""Free a trained model's device memory between phases and bring it back bit-exact.

Parameters (or the distributed optimizer's contiguous param buffers; kept resident with `keep_params`) and
optimizer state are copied to the host (`platform.offload_device()`) and their device storage is resized to zero, so every view (param.data,
main_grad, optimizer shards) stays valid and is refilled in place on reload. Grad buffers are freed without a
copy (they are zeroed at every step anyway). On a CPU-only host the "device" is the host: the same code runs
and frees the storage, which is what the CPU tests check.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.distributed import DistributedDataParallel
from megatron.core.optimizer.optimizer import MegatronOptimizer

from rlhf.platform import offload_device, release_cached_memory


@dataclass
class Offloaded:
    """Storages freed on the device, each with the host copy of its bytes."""

    storages: list[tuple[torch.UntypedStorage, torch.Tensor]]


def _optimizer_tensors(optimizer: MegatronOptimizer) -> list[torch.Tensor]:
    tensors = []
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = part.optimizer
        for group in inner.param_groups:
            tensors.extend(group["params"])
        for state in inner.state.values():
            tensors.extend(v for v in state.values() if isinstance(v, torch.Tensor) and v.numel() > 1)
    return tensors


def _unique_storages(tensors: list[torch.Tensor], keep: set[int]) -> list[torch.UntypedStorage]:
    seen: dict[int, torch.UntypedStorage] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if storage.nbytes() > 0 and storage.data_ptr() not in keep:
            seen.setdefault(storage.data_ptr(), storage)
    return list(seen.values())


def _park(tensors: list[torch.Tensor], keep: set[int]) -> Offloaded:
    """Copy each storage (except those in `keep`, by data pointer) to the host and free it on the device."""
    host = offload_device()
    saved = []
    for storage in _unique_storages(tensors, keep):
        device_bytes = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
        saved.append((storage, device_bytes.to(host, copy=True)))
        storage.resize_(0)
    return Offloaded(storages=saved)


def _restore(offloaded: Offloaded) -> None:
    for storage, host_bytes in offloaded.storages:
        storage.resize_(host_bytes.numel())
        torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage).copy_(host_bytes)


def offload(model: DistributedDataParallel, optimizer: MegatronOptimizer, *, keep_params: bool = False) -> Offloaded:
    """Copy params + optimizer state to the host, free their device storage and the grad buffers.

    `keep_params` leaves the model's parameters resident (a colocated rollout engine generates with them):
    only optimizer state (and fp32 master copies that are not the parameters themselves) and grads go.
    """
    params = list(model.module.parameters())
    params += [buffer.param_data for buffer in model.buffers if buffer.param_data is not None]
    keep = {param.untyped_storage().data_ptr() for param in params} if keep_params else set()
    saved = _park(params + _optimizer_tensors(optimizer), keep)
    model.offload_grad_buffers(synchronize=False, empty_cache=False)
    release_cached_memory()
    return saved


def reload(model: DistributedDataParallel, offloaded: Offloaded) -> None:
    """Re-allocate every freed storage, refill it from its host copy, and re-allocate zeroed grad buffers."""
    _restore(offloaded)
    model.restore_grad_buffers(synchronize=False)


def offload_frozen(module: torch.nn.Module) -> Offloaded:
    """A frozen model (reference, reward model) holds only parameters: park them on the host."""
    saved = _park(list(module.parameters()), set())
    release_cached_memory()
    return saved


def reload_frozen(offloaded: Offloaded) -> None:
    _restore(offloaded)
