"""The root config: one section per owner, each section defined (with its defaults) next to its owner."""

from __future__ import annotations

from dataclasses import dataclass, field

from rlhf.dist.config import CommConfig, DistConfig
from rlhf.dist.meshes import MeshConfig
from rlhf.run_dir import RunConfig


@dataclass(kw_only=True)
class RlhfConfig:
    run: RunConfig = field(default_factory=RunConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
