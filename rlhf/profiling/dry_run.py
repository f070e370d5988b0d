"""A dry run of a job at its real world size on one host (`rlhf plan`): no model is built, nothing computed.

On torch's fake process-group backend every group of every role mesh is really created (what a 1024-rank
launch does first), this rank's weight-sync transfers are planned for this rank alone (`plan_rank`), and
per-rank memory and per-step communication are estimated from the parameter shapes and the config:
weights, gradients and optimizer state, and the activation peak of each role's largest micro-batch
(`rlhf.profiling.activations`) at a planned row length, every row that long (the worst case). `fit_layouts`
lists the tp x cp x pp x dp layouts of a world whose training roles fit a memory per device.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from rlhf.errors import ConfigError
from rlhf.parallel.layout import ParallelLayout
from rlhf.models.param_specs import param_specs
from rlhf.models.spec import ModelSpec
from rlhf.platform.device import ACCELERATOR_HEAD_BYTES
from rlhf.profiling.activations import MicroBatchShape, activation_bytes, check_recompute
from rlhf.reshard.planner import min_received_numel, plan_rank
from rlhf.stages.config import check_batch_sizes
from rlhf.stages.micro_batches import pack_plan

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
    micro_batch_tokens: int  # tokens of the largest micro-batch of the pass with the activation peak
    activation_bytes: int  # activation peak of the role's largest micro-batch (update or forward-only pass)
    activation_pass: str  # which pass has it: update, forward, or "" (none: the rollout engine)

    @property
    def total_bytes(self) -> int:
        """Weights, gradients, optimizer state and KV cache: held for the whole step."""
        return self.weight_bytes + self.grad_bytes + self.optimizer_bytes + self.kv_cache_bytes


@dataclass(frozen=True, kw_only=True)
class MemoryPlan:
    """What activations are planned for: `response_length` tokens per response (None: sampling.max_new_tokens)
    after data.max_prompt_length prompt tokens; `recompute` none/full/selective for the trained roles (None:
    the config's, full in the actor with model.recompute); sequence parallelism (rlhf runs it off); the memory
    per device to check against (None: no check)."""

    response_length: int | None = None
    recompute: str | None = None
    sequence_parallel: bool = False
    memory_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.recompute is not None:
            check_recompute(self.recompute, "--recompute")

    def lengths(self, cfg: Any) -> tuple[int, int]:
        """(row, response) lengths in tokens."""
        response = self.response_length or cfg.sampling.max_new_tokens
        return cfg.data.max_prompt_length + response, response


@dataclass(frozen=True)
class PassPlan:
    """One pass over `rows` rows of a step on each DP rank: its micro-batch count and the largest's rows."""

    micro_batches: int
    rows: int
    packed: bool


def plan_pass(rows: int, dp: int, row_length: int, micro_batch_size: int, budget: tuple[int, str]) -> PassPlan:
    """Micro-batches of a pass over `rows` rows of `row_length` tokens split over dp: packed by the token
    budget (`pack_plan`, as the roles do) when one is set, else `micro_batch_size` rows each."""
    if rows < dp:
        raise ConfigError(f"{rows} rows per pass cannot fill dp={dp} ranks; lower dp or raise "
                          f"data.prompts_per_step x sampling.n")
    if budget[0]:
        bins = pack_plan(torch.full((rows,), row_length, dtype=torch.int64), dp, *budget)[0]
        return PassPlan(len(bins), max(map(len, bins)), packed=True)
    return PassPlan(max(1, rows // dp // micro_batch_size), min(micro_batch_size, rows // dp), packed=False)


def _passes(role: str, cfg: Any, dp: int, row_length: int) -> dict[str, PassPlan]:
    """The passes `role` runs each step: the update's (trained roles, per mini-batch) and the forward-only."""
    rollouts = cfg.data.prompts_per_step * cfg.sampling.n
    if role in TRAINED:
        update = getattr(cfg, role)
        forward_key = "forward_max_tokens_per_microbatch" if update.forward_max_tokens_per_microbatch else \
            "max_tokens_per_microbatch"
        return {"update": plan_pass(rollouts // update.mini_batches, dp, row_length, update.micro_batch_size,
                                    (update.max_tokens_per_microbatch, f"{role}.max_tokens_per_microbatch")),
                "forward": plan_pass(rollouts, dp, row_length, update.micro_batch_size,
                                     (update.forward_tokens_per_microbatch, f"{role}.{forward_key}"))}
    frozen = {"ref": (cfg.ref.micro_batch_size, (cfg.ref.max_tokens_per_microbatch, "ref.max_tokens_per_microbatch")),
              "reward": (cfg.reward.model_micro_batch_size, (cfg.reward.model_max_tokens_per_microbatch,
                                                             "reward.model_max_tokens_per_microbatch")),
              "teacher": (cfg.algo.distill.micro_batch_size, (0, ""))}
    if role not in frozen:
        return {}
    size, budget = frozen[role]
    return {"forward": plan_pass(rollouts, dp, row_length, size, budget)}


def role_activation(role: str, layout: ParallelLayout, spec: ModelSpec, cfg: Any, pp_rank: int,
                    plan: MemoryPlan) -> tuple[int, int, str, dict[str, PassPlan]]:
    """(bytes, tokens, pass) of `role`'s activation peak on a rank of stage `pp_rank`, and its passes."""
    row_length, response = plan.lengths(cfg)
    passes = _passes(role, cfg, layout.dp, row_length)
    config_recompute = "full" if role == "actor" and cfg.model.recompute else "none"
    head = "value" if role in VALUE_HEAD else ("fused" if cfg.model.fused_head else "full")
    best = (0, 0, "")
    for name, pass_plan in passes.items():
        rows = pass_plan.rows
        shape = MicroBatchShape(tokens=rows * row_length, padded_rows=0 if pass_plan.packed else rows,
                                tp=layout.tp, cp=layout.cp, pp=layout.pp, pp_rank=pp_rank,
                                micro_batches=pass_plan.micro_batches, sequence_parallel=plan.sequence_parallel,
                                recompute=plan.recompute or config_recompute, dtype_bytes=DTYPE_BYTES[cfg.model.dtype],
                                head=head, head_rows=rows * response,
                                head_chunk_bytes=ACCELERATOR_HEAD_BYTES[0],
                                train=name == "update")
        best = max(best, (activation_bytes(spec, shape).total_bytes, shape.tokens, name))
    return (*best, passes)


def stage_params(hf_config: Any, layout: ParallelLayout, pp_rank: int, *, value_head: bool) -> int:
    """Parameters one rank of `layout` at stage `pp_rank` holds (its tp shard of every tensor of that stage)."""
    return sum(math.prod(spec.shard_shape(layout.tp)) for spec in param_specs(hf_config, layout, value_head=value_head)
               if spec.pp_stage == pp_rank)


def role_estimate(role: str, layout: ParallelLayout, hf_config: Any, cfg: Any, rank: int,
                  shares_weights: bool, plan: MemoryPlan = MemoryPlan()) -> RoleEstimate:
    """Memory and communication of `role` on `rank` (which must be in `layout`)."""
    coords = layout.coords(rank)
    params = stage_params(hf_config, layout, coords.pp_rank, value_head=role in VALUE_HEAD)
    dtype_bytes = DTYPE_BYTES[cfg.model.dtype]
    weight_bytes = 0 if role == "rollout" and shares_weights else params * dtype_bytes
    grad_bytes = optimizer_bytes = reduce_bytes = all_reduces = micro_batches = 0
    spec = ModelSpec.from_hf(hf_config)
    activation, tokens, peak_pass, passes = role_activation(role, layout, spec, cfg, coords.pp_rank, plan)
    if role in TRAINED:
        update = getattr(cfg, role)
        optim = update.optim
        master = 4 if dtype_bytes != 4 else 0
        optimizer_bytes = params * (8 + master)
        if optim.use_distributed_optimizer:  # sharded over the weights' replicas: dp x cp
            optimizer_bytes = math.ceil(optimizer_bytes / (layout.dp * layout.cp))
        grad_bytes = params * 4
        micro_batches = update.epochs * update.mini_batches * passes["update"].micro_batches
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
                        micro_batches_per_step=micro_batches, micro_batch_tokens=tokens, activation_bytes=activation,
                        activation_pass=peak_pass)


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


def dry_run(cfg: Any, world_size: int, rank: int, meshes_fn: Any, plan: MemoryPlan = MemoryPlan()) -> dict:
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
    roles = [role_estimate(role, layout, configs[role], cfg, rank, shares, plan)
             for role, layout in layouts.items() if layout.contains(rank)]
    wire_bytes = DTYPE_BYTES[cfg.model.dtype]
    sync = weight_sync_estimate(hf_config, layouts["actor"], layouts["rollout"], rank, wire_bytes)
    return {"world_size": world_size, "rank": rank, "placement": meshes.placement,
            "layouts": {role: layout.describe() for role, layout in layouts.items()},
            "groups_created": meshes.num_groups, "groups_s": groups_s,
            "roles": [asdict(r) | {"total_bytes": r.total_bytes} for r in roles],
            "rank_total_bytes": sum(r.total_bytes for r in roles),
            "memory": rank_memory(roles, cfg, plan),
            "weight_sync": sync,
            "metrics_all_reduces_per_step": 1}


def rank_memory(roles: list[RoleEstimate], cfg: Any, plan: MemoryPlan) -> dict:
    """A rank's peak: every role's state is held all step, the roles' passes run one at a time, so the peak is
    the state plus the largest activation peak; `fits` against the plan's memory (None: not checked)."""
    row_length, response = plan.lengths(cfg)
    peak_role = max(roles, key=lambda r: r.activation_bytes)
    static = sum(r.total_bytes for r in roles)
    peak = static + peak_role.activation_bytes
    recompute = plan.recompute or ("full in the actor" if cfg.model.recompute else "none")
    return {"row_length": row_length, "response_length": response, "recompute": recompute,
            "sequence_parallel": "on" if plan.sequence_parallel else "off", "state_bytes": static,
            "activation_bytes": peak_role.activation_bytes,
            "activation_role": f"{peak_role.role} {peak_role.activation_pass}".strip(), "peak_bytes": peak,
            "memory_bytes": plan.memory_bytes,
            "fits": None if plan.memory_bytes is None else peak <= plan.memory_bytes}


def fit_layouts(cfg: Any, world_size: int, plan: MemoryPlan) -> dict:
    """Every tp x cp x pp x dp layout of `world_size` ranks for the training roles (actor, and ref / critic when
    the algorithm uses them, all on that layout; the rollout engine is not counted), with the peak over its
    pipeline stages of state + largest activation, and whether it fits `plan.memory_bytes`. Layouts the model
    or the batch cannot split are listed under `skipped` with the reason."""
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(cfg.model.path)
    critic_config = AutoConfig.from_pretrained(cfg.model.critic_path) if cfg.model.critic_path else hf_config
    roles = {"actor": hf_config} | ({"ref": hf_config} if cfg.algo.uses_ref else {}) | \
        ({"critic": critic_config} if cfg.algo.uses_critic else {})
    for role in roles:  # a token budget below the planned rows fails on every layout: say so once
        _passes(role, cfg, 1, plan.lengths(cfg)[0])
    ep = cfg.mesh.actor.ep
    divisors = [n for n in range(1, world_size + 1) if world_size % n == 0]
    rows, skipped = [], []
    for tp, cp, pp in ((tp, cp, pp) for pp in divisors for cp in divisors for tp in divisors):
        if world_size % (tp * cp * pp):
            continue
        try:
            layout = ParallelLayout.for_world(world_size, tp=tp, pp=pp, cp=cp, ep=ep)
            for role, config in roles.items():
                ModelSpec.from_hf(config).check_layout(tp, pp, ep)
                if role in TRAINED:
                    check_batch_sizes(prompts_per_step=cfg.data.prompts_per_step, n=cfg.sampling.n, rollout_dp=1,
                                      role=role, role_dp=layout.dp, update=getattr(cfg, role))
            stages = [[role_estimate(role, layout, config, cfg, layout.rank_of(pp_rank=stage), False, plan)
                       for role, config in roles.items()] for stage in range(pp)]
        except ConfigError as err:
            skipped.append({"layout": f"tp={tp} cp={cp} pp={pp}", "reason": str(err)})
            continue
        memory = max((rank_memory(estimates, cfg, plan) for estimates in stages), key=lambda m: m["peak_bytes"])
        rows.append({"tp": tp, "cp": cp, "pp": pp, "dp": layout.dp, **memory,
                     "micro_batch_tokens": max(e.micro_batch_tokens for e in stages[0])})
    rows.sort(key=lambda row: row["peak_bytes"])
    return {"world_size": world_size, "roles": list(roles), "layouts": rows, "skipped": skipped}


GIB = 1024 ** 3
MODELLED = ("activations: flash/TE attention (no s^2 term; the CPU SDPA math path keeps more), every row "
            "{row_length} tokens ({response_length} response), largest micro-batch of each pass, recompute "
            "{recompute}, sequence parallel {sequence_parallel}")


def format_report(report: dict) -> str:
    lines = [f"rlhf plan: rank {report['rank']} of {report['world_size']} ({report['placement']}); "
             f"{report['groups_created']} process groups created in {report['groups_s']:.2f} s (fake backend)"]
    lines += [f"  {role:8} {layout}" for role, layout in report["layouts"].items()]
    lines.append(f"{'role':8} {'coords':>10} {'params':>14} {'weights':>9} {'grads':>9} {'optim':>9} "
                 f"{'kv':>9} {'state GiB':>9} {'mb tokens':>10} {'act GiB':>9} {'dp reduce':>10} {'tp ar/mb':>8}")
    for r in report["roles"]:
        coords = f"{r['tp_rank']}/{r['dp_rank']}/{r['pp_rank']}"
        lines.append(f"{r['role']:8} {coords:>10} {r['params']:>14,} {r['weight_bytes'] / GIB:>9.2f} "
                     f"{r['grad_bytes'] / GIB:>9.2f} {r['optimizer_bytes'] / GIB:>9.2f} "
                     f"{r['kv_cache_bytes'] / GIB:>9.2f} {r['total_bytes'] / GIB:>9.2f} "
                     f"{r['micro_batch_tokens']:>10,} {r['activation_bytes'] / GIB:>9.2f} "
                     f"{r['dp_grad_reduce_bytes_per_step'] / GIB:>9.2f}G {r['tp_all_reduces_per_micro_batch']:>8}")
    memory = report["memory"]
    lines.append(MODELLED.format(**memory))
    lines.append(f"this rank's peak: {memory['state_bytes'] / GIB:.2f} GiB state + "
                 f"{memory['activation_bytes'] / GIB:.2f} GiB activations ({memory['activation_role']}) = "
                 f"{memory['peak_bytes'] / GIB:.2f} GiB" + _fits(memory))
    sync = report["weight_sync"]
    lines.append(f"weight sync on this rank: receives {sync['received_bytes'] / 2**20:.1f} MiB (minimum "
                 f"{sync['min_received_bytes'] / 2**20:.1f}) from {sync['peers_received_from']} peers, sends "
                 f"{sync['sent_bytes'] / 2**20:.1f} MiB to {sync['peers_sent_to']}, {sync['local_copies']} local "
                 f"copies; planned in {sync['plan_s']:.2f} s")
    return "\n".join(lines)


def _fits(memory: dict) -> str:
    if memory["memory_bytes"] is None:
        return ""
    verdict = "fits" if memory["fits"] else "does not fit"
    return f"; {verdict} in {memory['memory_bytes'] / GIB:g} GiB"


def format_fit(fit: dict, plan: MemoryPlan) -> str:
    rows = fit["layouts"]
    fitting = [row for row in rows if row["fits"]]
    first = rows[0] if rows else None
    lines = [f"rlhf plan --fit: {fit['world_size']} ranks, {'+'.join(fit['roles'])} on each layout (the rollout "
             f"engine not counted), {plan.memory_bytes / GIB:g} GiB per device"]
    if first:
        lines.append(MODELLED.format(**first))
    lines.append(f"{'tp':>3} {'cp':>3} {'pp':>3} {'dp':>4} {'mb tokens':>10} {'state GiB':>9} {'act GiB':>9} "
                 f"{'peak GiB':>9}  fits  (peak on the worst stage; activations of)")
    for row in rows:
        lines.append(f"{row['tp']:>3} {row['cp']:>3} {row['pp']:>3} {row['dp']:>4} {row['micro_batch_tokens']:>10,} "
                     f"{row['state_bytes'] / GIB:>9.2f} {row['activation_bytes'] / GIB:>9.2f} "
                     f"{row['peak_bytes'] / GIB:>9.2f}  {'yes' if row['fits'] else 'no ':4}  {row['activation_role']}")
    lines.append(f"{len(fitting)} of {len(rows)} layouts fit; {len(fit['skipped'])} skipped (the model or the batch "
                 "cannot split that way: see --json)")
    return "\n".join(lines)
