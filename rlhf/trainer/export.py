"""Export a role's weights from a trainer checkpoint as an HF folder (run on the checkpoint's world size)."""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from rlhf.checkpoint import CheckpointManager
from rlhf.config.schema import RlhfConfig
from rlhf.parallel.meshes import build_role_meshes
from rlhf.parallel.watchdog import Watchdog
from rlhf.errors import ConfigError
from rlhf.models.hf_export import export_hf
from rlhf.trainer.preflight import mesh_config, model_dims
from rlhf.trainer.roles import CriticRole, PolicyRole


def export_checkpoint(cfg: RlhfConfig, checkpoint: str | Path, out_dir: str, role: str = "actor") -> None:
    """Collective: rebuild `role` in the run's layout, load its weights from `checkpoint`, write HF to `out_dir`;
    a stall past comm.setup_timeout_s ends every rank with stacks on stderr."""
    if role not in ("actor", "critic"):
        raise ConfigError(f"export role={role!r} is not one of actor, critic")
    if role == "critic" and not cfg.algo.uses_critic:
        raise ConfigError("this run has no critic (algo.advantage.kind is not gae); export role=actor")
    watchdog = Watchdog(timeout_s=cfg.comm.setup_timeout_s, log_file=None,
                        store=dist.distributed_c10d._get_default_store())
    with watchdog, watchdog.phase("export"):
        _export(cfg, checkpoint, out_dir, role)


def _export(cfg: RlhfConfig, checkpoint: str | Path, out_dir: str, role: str) -> None:
    manager = CheckpointManager(Path(checkpoint).parent)
    path = manager.resolve(str(checkpoint))
    meshes = build_role_meshes(mesh_config(cfg), model_dims(cfg.model.path), timeout_s=cfg.dist.timeout_s)
    if role == "actor":
        model_role = PolicyRole("actor", meshes["actor"], cfg.model.path, update=None, total_steps=0,
                                params_dtype=cfg.model.torch_dtype)
    else:
        model_role = CriticRole("critic", meshes["critic"], cfg.model.critic_path or cfg.model.path, update=None,
                                total_steps=0, value_head=True, params_dtype=cfg.model.torch_dtype)
    state, _ = manager.load(path, replicated=model_role.replicated_state(keys=("model",)))
    if model_role.model is not None:
        model_role.model.load_state_dict(state[role]["model"], strict=True)
        export_hf(model_role.model, out_dir, tokenizer_dir=cfg.model.path)
    dist.barrier()
