"""The RL run's checkpoints: what a step boundary saves (roles' layout-free tensors, loader, KL, alerts, async
in-flight batches, RNG), the resume on whatever layouts this run has, and the HF copies (`save_hf_every`).

The trainer owns one `RunCheckpoints`; every method but `state`/`expected` is collective.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from transformers import AutoConfig

from rlhf import platform
from rlhf.checkpoint import CheckpointManager, check_root, tensor_folders
from rlhf.checkpoint.state_file import COUNT, tree_problem
from rlhf.checkpoint.verify import agree, check_replicas, checkpoint_problem
from rlhf.data.loader import PromptLoader
from rlhf.errors import CheckpointError
from rlhf.models.hf_export import export_hf
from rlhf.ops.alerts import AlertMonitor
from rlhf.orchestration.async_schedule import AsyncSchedule
from rlhf.orchestration.previous_run import architecture
from rlhf.orchestration.schema import RlhfConfig
from rlhf.orchestration.rollout_side import RolloutSide
from rlhf.orchestration.train_side import TrainSide
from rlhf.parallel.meshes import RoleMeshes
from rlhf.parallel.runtime import seed_host
from rlhf.parallel.watchdog import Watchdog
from rlhf.run_dir import RunDir, check_inside, get_logger

log = get_logger("trainer")
_ENGINE = {"scheduler": dict, "num_steps": COUNT, "optimizer_steps": COUNT}  # a trained role's, on its mesh
_STATE = {"step": COUNT, "policy_version": COUNT, "kl": {"value": float}, "async": dict,
          "loader": {"epoch": COUNT, "step_in_epoch": COUNT, "num_samples": COUNT, "global_batch_size": COUNT,
                     "seed": int, "shuffle": bool},
          "rng": {"torch": {"cpu": torch.Tensor}, "python": tuple, "numpy": tuple}}


class RunCheckpoints:
    """Saves and resumes one RL run's state under `<run>/checkpoints` (`manager` keeps the last few)."""

    def __init__(self, cfg: RlhfConfig, run_dir: RunDir, meshes: RoleMeshes, train: TrainSide, rollout: RolloutSide,
                 loader: PromptLoader, alerts: AlertMonitor, async_schedule: AsyncSchedule | None,
                 watchdog: Watchdog) -> None:
        self.manager = CheckpointManager(run_dir.path / "checkpoints", cfg.checkpoint.keep_last)
        check_root(self.manager.root)  # the run folder's links are checked before anything else is taken in
        if cfg.checkpoint.save_hf_every:
            check_inside(run_dir.path / "hf", run_dir.path, "checkpoint.save_hf_every folder")
        self.cfg, self.run_dir, self.meshes, self.loader = cfg, run_dir, meshes, loader
        self.train, self.engine = train, rollout.engine
        self.alerts, self.async_schedule, self.watchdog = alerts, async_schedule, watchdog

    def state(self, step: int) -> dict:
        """The plain-data state tree (JSON-able and tensors, never pickled)."""
        train = self.train
        return {"step": step, "actor": train.actor.state_dict(),
                "critic": train.critic.state_dict() if train.critic else {},
                "loader": self.loader.state_dict(), "kl": train.kl_controller.state_dict(),
                "policy_version": getattr(self.engine, "policy_version", 0),
                "alerts": self.alerts.state_dict(),
                "async": self.async_schedule.state_dict() if self.async_schedule else {},
                "rng": {"torch": platform.rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}}

    def tensors(self) -> dict:
        """Collective: the trained roles' full weight and optimizer tensors this rank writes (layout-free)."""
        return {role.name: role.checkpoint_tensors() for role in self._trained() if role.mesh.is_member}

    def replicated(self) -> list:
        """State the training ranks share (the async in-flight batches): written once for their group."""
        return self.async_schedule.replicated() if self.async_schedule else []

    def _trained(self) -> list:
        return [role for role in (self.train.actor, self.train.critic) if role is not None]

    def expected(self) -> dict:
        """What must match on resume: the trained roles' architectures and the async settings (layouts may
        change)."""
        models = {"actor": self.cfg.model.path}
        if self.train.critic:
            models["critic"] = self.cfg.model.critic_path or self.cfg.model.path
        trainer = self.cfg.trainer
        return {"models": {role: architecture(path) for role, path in models.items()},
                "async": ({"mode": trainer.async_mode, "max_staleness": trainer.max_staleness,
                           "partial_rollout_tokens": trainer.partial_rollout_tokens}
                          if self.async_schedule else None)}

    def meta(self) -> dict:
        paths = {"actor": self.cfg.model.path, "critic": self.cfg.model.critic_path or self.cfg.model.path}
        return {"layouts": self._layouts(), **self.expected(),
                "hf_configs": {role.name: AutoConfig.from_pretrained(paths[role.name]).to_dict()
                               for role in self._trained()}}

    def _layouts(self) -> dict:
        return {role: mesh.layout.describe() for role, mesh in self.meshes.meshes.items()}

    def state_problem(self, path: Path, state: object, manifest: dict) -> str | None:
        """Why a verified checkpoint's state does not fit this run: the state tree's schema (its step the
        manifest's), or a trained role's tensors (kinds, names, shapes) against its model."""
        trained = self._trained()
        schema = {**_STATE, **{role.name: _ENGINE if role.mesh.is_member else dict for role in trained}}
        problem = tree_problem(state, schema, "state")
        if problem is None and state["step"] != manifest["step"]:
            problem = f"state.step is {state['step']}, but the manifest's step is {manifest['step']}"
        if problem:
            return f"checkpoint {path} holds a malformed state: {problem}"
        for role in trained:
            if role.mesh.is_member:
                try:
                    problem = checkpoint_problem(role.model, tensor_folders(path, manifest, role.name))
                except CheckpointError as error:
                    problem = str(error)
                if problem:
                    return f"{problem}, in the {role.name} of checkpoint {path}"
        return None

    def resume(self) -> int:
        """Load and verify the checkpoint to resume from (if any), on this run's layouts whatever wrote it; its
        replicas must then be bitwise equal. Returns the step it was taken at (0: none). First every rank seeds
        python's and numpy's RNGs from `dist.seed` (the state the checkpoint restores on the same world size)."""
        seed_host(self.cfg.dist.seed)
        found = self.manager.load_for_resume(self.cfg.checkpoint.resume, expected_meta=self.expected(),
                                             replicated=self.replicated(), check=self.state_problem)
        if found is None:
            return 0
        path, state, manifest = found
        if manifest.get("layouts") != self._layouts():
            log.info("resharding %s: layouts %s -> %s", path.name, manifest.get("layouts"), self._layouts())
        problem = None
        try:
            self._restore(path, state, manifest)
        except CheckpointError as error:
            problem = str(error)
        except (KeyError, TypeError, ValueError, IndexError, RuntimeError) as error:  # past the schema check
            problem = f"checkpoint {path} holds a malformed state ({type(error).__name__}: {str(error)[:200]})"
        problem = agree(problem)
        if problem:
            raise CheckpointError(problem)
        trained = self._trained()
        check_replicas({role.name: (role.model, role.mesh.pgs if role.mesh.is_member else None) for role in trained})
        log.info("resumed from %s (step %d)", path, state["step"])
        return state["step"]

    def _restore(self, path: Path, state: dict, manifest: dict) -> None:
        """Hand each owner its part of a verified checkpoint."""
        for role in self._trained():
            role.load_state_dict(state[role.name], tensor_folders(path, manifest, role.name))
        self.loader.load_state_dict(state["loader"])
        self.train.kl_controller.load_state_dict(state["kl"])
        if "alerts" in state:  # checkpoints written before alerts existed start with empty windows
            self.alerts.load_state_dict(state["alerts"])
        if self.async_schedule:
            self.async_schedule.load_state_dict(state["async"])
        if self.engine is not None:
            self.engine.policy_version = state["policy_version"]
        if manifest["world_size"] == dist.get_world_size():
            platform.set_rng_state(state["rng"]["torch"])
            random.setstate(state["rng"]["python"])
            np.random.set_state(state["rng"]["numpy"])

    def at_step_end(self, step: int) -> None:
        """At a step boundary: publish an async save still pending, then save (and write an HF copy) if due."""
        ckpt, last = self.cfg.checkpoint, step == self.cfg.trainer.total_steps
        with self.watchdog.phase(f"checkpoint step {step}", self.cfg.comm.setup_timeout_s):
            self.manager.commit()
            if (ckpt.every and step % ckpt.every == 0) or (last and ckpt.save_at_end):
                self.manager.save(step, self.state(step), meta=self.meta(), tensors=self.tensors(),
                                  replicated=self.replicated(), wait=not ckpt.async_save or last)
            if ckpt.save_hf_every and step % ckpt.save_hf_every == 0:
                self.save_hf(self.run_dir.path / "hf" / f"step_{step}")

    def save_hf(self, folder: Path) -> None:
        """Collective: the actor as an HF folder (tokenizer, generation config); one a resumed run rewrites. A
        symlink in the way is removed itself, never followed."""
        check_inside(folder.parent, self.run_dir.path, "checkpoint.save_hf_every folder")
        if self.run_dir.is_rank0:
            for path in (folder, folder.with_name(folder.name + ".partial")):
                if path.is_symlink():
                    log.warning("save_hf_every: replacing the symlink %s (to %s)", path, os.readlink(path))
                    path.unlink()
                elif path.exists():
                    shutil.rmtree(path)
        dist.barrier()
        if self.train.actor.mesh.is_member:
            export_hf(self.train.actor.model, str(folder), tokenizer_dir=self.cfg.model.path)
