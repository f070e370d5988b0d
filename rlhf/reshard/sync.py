"""`WeightSync`: the trainer's once-per-step call that pushes the actor's weights into the rollout engine.

Built once (plan + schedule computed from the two layouts), then `sync()` every step: allocate this rank's
rollout shards, run the transport, hand the shards to the engine in its own naming, optionally verify.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from rlhf.parallel.layout import ParallelLayout
from rlhf.errors import ConfigError
from rlhf.models.hf_load import experts_per_rank, model_layout, param_specs_for, stage_params
from rlhf.models.lora import merged_weight
from rlhf.platform import current_device, has_accelerator, synchronize
from rlhf.reshard.apply import allocate_dst
from rlhf.reshard.hf_names import full_model_layout, hf_named
from rlhf.reshard.planner import ReshardPlan, plan_for_model
from rlhf.reshard.schedule import build_schedule
from rlhf.reshard.shm import SharedMemoryTransport, all_on_one_host
from rlhf.reshard.transport import execute
from rlhf.reshard.verify import verify_sync

WIRE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
METHODS = ("auto", "shm", "p2p", "all_to_all")  # auto: shm on one CPU host, p2p otherwise
# Bucket cap when not given: 16 MB measured best on CPU (benchmarks/bench_reshard.py: big gloo messages stall,
# tiny ones pay a round each); accelerators take the usual large NCCL buckets (not measured here).
CPU_BUCKET_MB, ACCELERATOR_BUCKET_MB = 16.0, 256.0


@dataclass(frozen=True)
class SyncStats:
    """One sync on this rank: remote bytes each way, messages/collectives issued, wall time, slices verified."""

    seconds: float
    bytes_sent: int
    bytes_received: int
    num_messages: int
    num_collectives: int
    num_verified: int  # slices checksummed on this rank (0 unless verify=True)


def _model_attr(src_model: Any, engine: Any, attr: str) -> Any:
    """`attr` of whichever model this rank holds (training model first, else the engine's), or None."""
    for holder in (src_model, getattr(engine, "model", None)):
        value = getattr(holder, attr, None)
        if value is not None:
            return value
    return None


class WeightSync:
    """Reshards `src_model` (this rank's training shard, None off the training mesh) into `engine` (None off
    the rollout mesh). Collective: every rank of the process group constructs it and calls `sync()` together.

    `engine.load_weights` gets this rank's megatron shards by name (native engine), or with `hf_names=True`
    full HF-named tensors (vLLM, which shards itself). `dtype` casts on the wire (fp32 master -> bf16 rollout).
    """

    def __init__(self, src_model: torch.nn.Module | None, src_layout: ParallelLayout, dst_layout: ParallelLayout,
                 engine: Any | None, *, hf_config: Any = None, dtype: torch.dtype | None = None,
                 method: str = "auto", max_bucket_mb: float | None = None, coalesce: bool = True,
                 verify: bool = False, hf_names: bool = False, group: dist.ProcessGroup | None = None) -> None:
        """`coalesce`: pack a pair's small tensors into buckets of `max_bucket_mb` (comm.strategy bucket/rs_ag);
        off, every tensor slice travels as its own message (comm.strategy=plain)."""
        if max_bucket_mb is None:
            max_bucket_mb = ACCELERATOR_BUCKET_MB if has_accelerator() else CPU_BUCKET_MB
        if max_bucket_mb <= 0:
            raise ConfigError(f"reshard max_bucket_mb={max_bucket_mb} must be positive")
        if hf_names and verify:
            raise ConfigError("reshard verify=True needs an engine with megatron-named weights (native); "
                              "engines loading HF names (vllm) cannot be read back: set verify=False")
        self.rank = dist.get_rank()
        if (engine is not None) != dst_layout.contains(self.rank):
            raise ConfigError(f"rank {self.rank}: engine must be given exactly on the rollout ranks "
                              f"{list(dst_layout.ranks)}")
        self.src_model, self.engine, self.group = src_model, engine, group
        if method not in METHODS:
            raise ConfigError(f"reshard method={method!r} is not one of {', '.join(METHODS)}")
        self.verify, self.device = verify, current_device()
        self.hf_config = hf_config if hf_config is not None else _model_attr(src_model, engine, "rlhf_hf_config")
        if self.hf_config is None:
            raise ConfigError("WeightSync needs hf_config= on ranks that hold neither a model built by build_gpt "
                              "nor an engine over one")
        self.value_head = bool(_model_attr(src_model, engine, "rlhf_value_head"))
        self.hf_names = hf_names
        plan_layout = full_model_layout(dst_layout) if hf_names else dst_layout
        self.plan = self._make_plan(src_layout, plan_layout)
        self.dtype = dtype or _agreed_dtype(self._first_source(), group)
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        max_numel = max(1, int(max_bucket_mb * 2**20) // itemsize) if coalesce else 1
        self.schedule = build_schedule(self.plan, max_bucket_numel=max_numel)
        self.method = _resolve_method(method, group)
        self.shm = None
        if self.method == "shm":
            self.shm = SharedMemoryTransport(self.schedule, dtype=self.dtype, group=group)

    def _make_plan(self, src_layout: ParallelLayout, dst_layout: ParallelLayout) -> ReshardPlan:
        return plan_for_model(self.hf_config, src_layout, dst_layout, value_head=self.value_head)

    def _first_source(self) -> torch.Tensor | None:
        """A tensor of what this rank sends (its dtype is the wire's unless `dtype=` says otherwise)."""
        return None if self.src_model is None else next(self.src_model.parameters())

    def _sources(self) -> dict[str, torch.Tensor]:
        return _params_by_plan_name(self.src_model)

    def sync(self) -> SyncStats:
        """Move the current training weights into the engine; collective over the group."""
        start = time.perf_counter()
        sources = self._sources()
        shards = allocate_dst(self.plan, self.rank, dtype=self.dtype, device=self.device)
        if self.shm is not None:
            stats = self.shm.execute(sources, shards)
        else:
            stats = execute(self.schedule, sources, shards, dtype=self.dtype, device=self.device,
                            method=self.method, group=self.group)
        if self.engine is not None:
            self._deliver(shards)
        del shards
        num_verified = self.check() if self.verify else 0
        synchronize()
        return SyncStats(seconds=time.perf_counter() - start, bytes_sent=stats.bytes_sent,
                         bytes_received=stats.bytes_received, num_messages=stats.num_messages,
                         num_collectives=stats.num_collectives, num_verified=num_verified)

    def _deliver(self, shards: dict[str, torch.Tensor]) -> None:
        """Hand this rank's received shards to the engine in its own naming (megatron, or full HF tensors)."""
        named = hf_named(self.hf_config, shards, value_head=self.value_head) if self.hf_names else shards.items()
        self.engine.load_weights(named)

    def check(self) -> int:
        """Checksum the engine's live weights against the trainer's (collective); WeightSyncError on mismatch."""
        return verify_sync(self.plan, self._sources(), self.engine_weights(), dtype=self.dtype, device=self.device,
                           group=self.group)

    def engine_weights(self) -> Mapping[str, torch.Tensor]:
        """The engine's live parameters by megatron name (empty off the rollout mesh)."""
        return _params_by_plan_name(None if self.engine is None else self.engine.model)


def _params_by_plan_name(model: torch.nn.Module | None) -> dict[str, torch.Tensor]:
    """A `build_gpt` model's parameters under the plan's (local-spec, stage- and ep-local) names, whatever its layer
    spec; a LoRA model's with its adapters merged in (what the engine generates with)."""
    if model is None:
        return {}
    per_stage, per_ep_rank = model.rlhf_spec.num_layers // model_layout(model)[0].pp, experts_per_rank(model)
    named = ((spec.local_name(per_stage, per_ep_rank), param)
             for spec, param in stage_params(model, param_specs_for(model)))
    return {name: merged_weight(model, name, param).detach() for name, param in named}


def _resolve_method(method: str, group: dist.ProcessGroup | None) -> str:
    """`auto` -> shm when every rank is on this host and computes on CPU, else p2p; `shm` is checked the same."""
    if method not in ("auto", "shm"):
        return method
    usable = not has_accelerator() and all_on_one_host(group)
    if method == "shm" and not usable:
        raise ConfigError("reshard method='shm' needs every rank on one host and CPU tensors; use method='p2p'")
    return "shm" if usable else "p2p"


def _agreed_dtype(source: torch.Tensor | None, group: dist.ProcessGroup | None) -> torch.dtype:
    """The training parameters' dtype, made known to ranks without a training model (one tiny all_reduce)."""
    code = torch.tensor([-1], dtype=torch.int64, device=current_device())
    if source is not None:
        code[0] = WIRE_DTYPES.index(source.dtype)
    dist.all_reduce(code, op=dist.ReduceOp.MAX, group=group)
    return WIRE_DTYPES[int(code)]
