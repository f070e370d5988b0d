"""Role meshes: the world carved into actor / critic / ref / reward / rollout, each with its own layout and groups.

`plan_meshes` is pure (config + world size -> one `ParallelLayout` per role) so every layout rule is unit-tested
without processes; `build_role_meshes` then creates every role's groups on every rank in one fixed order.

Placements:
- colocated: every role spans all ranks and the roles time-share the devices;
- split: each role names a rank range [first, end); two ranges are either identical or disjoint.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, NamedTuple

import torch.distributed as dist

from rlhf.parallel.config import ROLES, MeshConfig, RoleLayoutConfig
from rlhf.parallel.groups import GroupCache, build_layout_groups
from rlhf.parallel.layout import ParallelLayout
from rlhf.errors import ConfigError

if TYPE_CHECKING:
    from megatron.core.process_groups_config import ProcessGroupCollection

Role = Literal["actor", "critic", "ref", "reward", "rollout", "teacher"]


class ModelDims(NamedTuple):
    """The model numbers a layout must divide."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    num_experts: int = 0  # 0: a dense model


def _check_model_fits(role: str, layout: ParallelLayout, dims: ModelDims) -> None:
    if dims.num_heads % layout.tp:
        raise ConfigError(f"mesh.{role}.tp={layout.tp} does not divide the model's {dims.num_heads} attention "
                          f"heads; pick a tp that divides {dims.num_heads}")
    if dims.num_kv_heads % layout.tp:
        raise ConfigError(f"mesh.{role}.tp={layout.tp} does not divide the model's {dims.num_kv_heads} kv heads "
                          f"(GQA groups); pick a tp that divides {dims.num_kv_heads}")
    if dims.num_layers % layout.pp:
        raise ConfigError(f"mesh.{role}.pp={layout.pp} does not divide the model's {dims.num_layers} layers")
    if layout.ep > 1 and (not dims.num_experts or dims.num_experts % layout.ep):
        raise ConfigError(f"mesh.{role}.ep={layout.ep} does not divide the model's {dims.num_experts} experts"
                          if dims.num_experts else f"mesh.{role}.ep={layout.ep} for a dense model; set ep=1")


def _role_range(cfg: MeshConfig, role: str, world_size: int) -> range:
    role_cfg: RoleLayoutConfig = getattr(cfg, role)
    if cfg.placement == "colocated":
        if role_cfg.ranks is not None:
            raise ConfigError(f"mesh.{role}.ranks={role_cfg.ranks} is only valid with mesh.placement=split")
        return range(world_size)
    if role_cfg.ranks is None:
        raise ConfigError(f"mesh.placement=split needs mesh.{role}.ranks=[first, end) for role {role!r}")
    first, end = role_cfg.ranks
    if end > world_size:
        raise ConfigError(f"mesh.{role}.ranks={role_cfg.ranks} reaches past the world of {world_size} ranks")
    return range(first, end)


def _check_split_ranges(ranges: dict[str, range], world_size: int) -> None:
    names = list(ranges)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            ra, rb = ranges[a], ranges[b]
            overlap = set(ra) & set(rb)
            if overlap and ra != rb:
                raise ConfigError(
                    f"split ranges overlap: {a} on [{ra.start}, {ra.stop}) and {b} on [{rb.start}, {rb.stop}) "
                    f"share ranks {min(overlap)}..{max(overlap)}; ranges must be identical or disjoint")
    used = set().union(*(set(r) for r in ranges.values()))
    idle = sorted(set(range(world_size)) - used)
    if idle:
        raise ConfigError(f"mesh.placement=split leaves ranks {idle} without a role; "
                          f"give every rank of the {world_size} to some role")


def plan_meshes(cfg: MeshConfig, world_size: int, dims: ModelDims | None = None,
                role_dims: dict[str, ModelDims] | None = None) -> dict[str, ParallelLayout]:
    """One layout per configured role, in ROLES order; raises ConfigError naming the numbers on bad layouts.

    `dims` applies to every role; `role_dims` overrides it per role (a critic may be another model).
    """
    assert cfg.roles is not None, "mesh.roles unresolved: plan `orchestration.preflight.mesh_config(cfg)`"
    ranges = {role: _role_range(cfg, role, world_size) for role in ROLES if role in cfg.roles}
    if cfg.placement == "split":
        _check_split_ranges(ranges, world_size)
    layouts = {}
    for role, ranks in ranges.items():
        role_cfg: RoleLayoutConfig = getattr(cfg, role)
        size = len(ranks)
        if role == "rollout" and role_cfg.cp > 1:
            raise ConfigError(f"mesh.rollout.cp={role_cfg.cp}: rollout engines do not split sequences; set "
                              f"mesh.rollout.cp=1 (cp applies to the training roles)")
        layout = ParallelLayout.for_world(size, tp=role_cfg.tp, pp=role_cfg.pp, first_rank=ranks.start,
                                          what=f"mesh.{role}", ep=role_cfg.ep, cp=role_cfg.cp)
        role_model = (role_dims or {}).get(role, dims)
        if role_model is not None:
            _check_model_fits(role, layout, role_model)
        layouts[role] = layout
    return layouts


@dataclass
class RoleMesh:
    """One role's layout and, on member ranks, its megatron process-group collection."""

    role: str
    layout: ParallelLayout
    pgs: "ProcessGroupCollection | None"

    @property
    def is_member(self) -> bool:
        return self.pgs is not None


@dataclass
class RoleMeshes:
    """Every configured role's mesh, as seen from this rank."""

    rank: int
    world_size: int
    placement: str
    meshes: dict[str, RoleMesh]
    num_groups: int = 0  # distinct process groups created for all roles

    def __getitem__(self, role: str) -> RoleMesh:
        if role not in self.meshes:
            raise KeyError(f"role {role!r} is not configured (mesh.roles={list(self.meshes)})")
        return self.meshes[role]

    def __contains__(self, role: str) -> bool:
        return role in self.meshes

    def summary_rows(self) -> list[dict]:
        rows = []
        for role, mesh in self.meshes.items():
            layout = mesh.layout
            coords = layout.coords(self.rank) if layout.contains(self.rank) else None
            rows.append({"role": role, "tp": layout.tp, "cp": layout.cp, "pp": layout.pp, "dp": layout.dp,
                         "ranks": f"{layout.first_rank}..{layout.ranks[-1]}",
                         "this_rank": None if coords is None else coords._asdict()})
        return rows


def build_role_meshes(cfg: MeshConfig, dims: ModelDims | None = None, timeout_s: float | None = None,
                      role_dims: dict[str, ModelDims] | None = None) -> RoleMeshes:
    """Plan, then create every role's groups on every rank (same order everywhere). Collective."""
    world_size, rank = dist.get_world_size(), dist.get_rank()
    layouts = plan_meshes(cfg, world_size, dims, role_dims)
    cache = GroupCache(timeout_s)
    meshes = {role: RoleMesh(role, layout, build_layout_groups(layout, cache)) for role, layout in layouts.items()}
    return RoleMeshes(rank=rank, world_size=world_size, placement=cfg.placement, meshes=meshes,
                      num_groups=cache.num_created)
