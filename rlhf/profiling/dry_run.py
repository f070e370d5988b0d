"""A dry run of a job at its real world size on one host (`rlhf plan`): no model is built, nothing computed.

On torch's fake process-group backend every group of every role mesh is really created (what a 1024-rank
launch does first), this rank's weight-sync transfers are planned for this rank alone (`plan_rank`), and
per-rank memory and per-step communication are estimated from the parameter shapes and the config.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import Any

from rlhf.parallel.layout import ParallelLayout
from rlhf.models.param_specs import param_specs
from rlhf.models.spec import ModelSpec
from rlhf.reshard.planner import min_received_numel, plan_rank

TRAINED = ("actor", "critic")
VALUE_HEAD = ("critic", "reward")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


@dataclass(frozen=True, kw_only=True)
class RoleEstimate:
    """One role on this rank: its layout and coordinates, parameters held, and bytes per kind of state."""

    role: str
    layout: str
    tp_rank: int
    dp_rank: int
    pp_rank: int
    cp_rank: int
    params: int
    weight_bytes: int
    grad_bytes: int  # fp32 gradient buffer (trained roles)
    optimizer_bytes: int  # Adam moments (+ fp32 master weights with bf16), / dp with the distributed optimizer
    kv_cache_bytes: int  # native rollout engine's preallocated cache
    dp_grad_reduce_bytes_per_step: int  # gradient all-reduce (or reduce-scatter) payload per step
    tp_all_reduces_per_micro_batch: int  # megatron's forward + backward all-reduces (no sequence parallel)
    micro_batches_per_step: int

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.grad_bytes + self.optimizer_bytes + self.kv_cache_bytes


def stage_params(hf_config: Any, layout: ParallelLayout, pp_rank: int, *, value_head: bool) -> int:
    """Parameters one rank of `layout` at stage `pp_rank` holds (its tp shard of every tensor of that stage)."""
    return sum(math.prod(spec.shard_shape(layout.tp)) for spec in param_specs(hf_config, layout, value_head=value_head)
               if spec.pp_stage == pp_rank)


def role_estimate(role: str, layout: ParallelLayout, hf_config: Any, cfg: Any, rank: int,
                  shares_weights: bool) -> RoleEstimate:
    """Memory and communication of `role` on `rank` (which must be in `layout`)."""
    coords = layout.coords(rank)
    params = stage_params(hf_config, layout, coords.pp_rank, value_head=role in VALUE_HEAD)
    dtype_bytes = DTYPE_BYTES[cfg.model.dtype]
    weight_bytes = 0 if role == "rollout" and shares_weights else params * dtype_bytes
    grad_bytes = optimizer_bytes = reduce_bytes = all_reduces = micro_batches = 0
    spec = ModelSpec.from_hf(hf_config)
    if role in TRAINED:
        update = getattr(cfg, role)
        optim = update.optim
        master = 4 if dtype_bytes != 4 else 0
        optimizer_bytes = params * (8 + master)
        if optim.use_distributed_optimizer:  # sharded over the weights' replicas: dp x cp
            optimizer_bytes = math.ceil(optimizer_bytes / (layout.dp * layout.cp))
        grad_bytes = params * 4
        rollouts_per_rank = cfg.data.prompts_per_step * cfg.sampling.n // layout.dp
        micro_batches = update.epochs * max(1, rollouts_per_rank // update.micro_batch_size)
        reduce_bytes = grad_bytes * update.epochs * update.mini_batches if layout.dp * layout.cp > 1 else 0
        all_reduces = 4 * (spec.num_layers // layout.pp) if layout.tp > 1 else 0
    kv_bytes = 0
    if role == "rollout" and cfg.rollout.engine == "native":
        native = cfg.rollout.native
        kv_heads = spec.num_kv_heads // layout.tp
        kv_bytes = 2 * spec.num_layers * native.max_batch_size * kv_heads * native.max_seq_len * spec.head_dim
        kv_bytes *= dtype_bytes
    return RoleEstimate(role=role, layout=layout.describe(), tp_rank=coords.tp_rank, dp_rank=coords.dp_rank,
                        pp_rank=coords.pp_rank, cp_rank=coords.cp_rank, params=params, weight_bytes=weight_bytes,
                        grad_bytes=grad_bytes, optimizer_bytes=optimizer_bytes, kv_cache_bytes=kv_bytes,
                        dp_grad_reduce_bytes_per_step=reduce_bytes, tp_all_reduces_per_micro_batch=all_reduces,
                        micro_batches_per_step=micro_batches)


def weight_sync_estimate(hf_config: Any, src: ParallelLayout, dst: ParallelLayout, rank: int,
                         wire_bytes: int) -> dict:
    """This rank's part of the actor -> rollout resharding, planned for this rank only."""
    src_specs, dst_specs = param_specs(hf_config, src), param_specs(hf_config, dst)
    vocab = ModelSpec.from_hf(hf_config).vocab_size
    started = time.perf_counter()
    mine = plan_rank(src, dst, src_specs, dst_specs, vocab_size=vocab, rank=rank)
    plan_s = time.perf_counter() - started
    minimum = min_received_numel(src, dst, src_specs, dst_specs, vocab_size=vocab, rank=rank)
    return {"plan_s": plan_s, "received_bytes": mine.received_numel * wire_bytes,
            "min_received_bytes": minimum * wire_bytes, "sent_bytes": mine.sent_numel * wire_bytes,
            "local_copies": sum(t.is_local for t in mine.received),
            "peers_received_from": len({t.src_rank for t in mine.received if not t.is_local}),
            "peers_sent_to": len({t.dst_rank for t in mine.sent})}


def dry_run(cfg: Any, world_size: int, rank: int, meshes_fn: Any) -> dict:
    """The report for `rank` of a `world_size` job: meshes (groups created for real on the fake backend),
    per-role estimates on this rank, and this rank's weight-sync plan. `meshes_fn()` builds the role meshes."""
    from transformers import AutoConfig

    import torch.distributed as dist

    from rlhf.platform.compat.torch import init_fake_world

    hf_config = AutoConfig.from_pretrained(cfg.model.path)
    init_fake_world(world_size, rank)
    try:
        started = time.perf_counter()
        meshes = meshes_fn()
        groups_s = time.perf_counter() - started
    finally:
        dist.destroy_process_group()
    layouts = {role: mesh.layout for role, mesh in meshes.meshes.items()}
    shares = cfg.rollout.engine == "native" and layouts["rollout"] == layouts["actor"]
    paths = {"critic": cfg.model.critic_path, "reward": cfg.reward.model_path}
    configs = {role: AutoConfig.from_pretrained(paths[role]) if paths.get(role) else hf_config for role in layouts}
    roles = [role_estimate(role, layout, configs[role], cfg, rank, shares)
             for role, layout in layouts.items() if layout.contains(rank)]
    wire_bytes = DTYPE_BYTES[cfg.model.dtype]
    sync = weight_sync_estimate(hf_config, layouts["actor"], layouts["rollout"], rank, wire_bytes)
    return {"world_size": world_size, "rank": rank, "placement": meshes.placement,
            "layouts": {role: layout.describe() for role, layout in layouts.items()},
            "groups_created": meshes.num_groups, "groups_s": groups_s,
            "roles": [asdict(r) | {"total_bytes": r.total_bytes} for r in roles],
            "rank_total_bytes": sum(r.total_bytes for r in roles),
            "weight_sync": sync,
            "metrics_all_reduces_per_step": 1}


def format_report(report: dict) -> str:
    gib = 1024 ** 3
    lines = [f"rlhf plan: rank {report['rank']} of {report['world_size']} ({report['placement']}); "
             f"{report['groups_created']} process groups created in {report['groups_s']:.2f} s (fake backend)"]
    lines += [f"  {role:8} {layout}" for role, layout in report["layouts"].items()]
    lines.append(f"{'role':8} {'coords':>10} {'params':>14} {'weights':>9} {'grads':>9} {'optim':>9} "
                 f"{'kv':>9} {'total GiB':>9} {'dp reduce':>10} {'tp ar/mb':>8}")
    for r in report["roles"]:
        coords = f"{r['tp_rank']}/{r['dp_rank']}/{r['pp_rank']}"
        lines.append(f"{r['role']:8} {coords:>10} {r['params']:>14,} {r['weight_bytes'] / gib:>9.2f} "
                     f"{r['grad_bytes'] / gib:>9.2f} {r['optimizer_bytes'] / gib:>9.2f} "
                     f"{r['kv_cache_bytes'] / gib:>9.2f} {r['total_bytes'] / gib:>9.2f} "
                     f"{r['dp_grad_reduce_bytes_per_step'] / gib:>9.2f}G {r['tp_all_reduces_per_micro_batch']:>8}")
    lines.append(f"this rank's memory (all roles, before activations): {report['rank_total_bytes'] / gib:.2f} GiB")
    sync = report["weight_sync"]
    lines.append(f"weight sync on this rank: receives {sync['received_bytes'] / 2**20:.1f} MiB (minimum "
                 f"{sync['min_received_bytes'] / 2**20:.1f}) from {sync['peers_received_from']} peers, sends "
                 f"{sync['sent_bytes'] / 2**20:.1f} MiB to {sync['peers_sent_to']}, {sync['local_copies']} local "
                 f"copies; planned in {sync['plan_s']:.2f} s")
    return "\n".join(lines)
