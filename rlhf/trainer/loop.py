"""The RL trainer: builds every role on its mesh, then runs `rl_step` with validation, metrics and checkpoints.

    Trainer(cfg, run_dir).fit()
      build: meshes -> data -> reward -> actor / ref / critic / reward model / rollout engine (+ weight sync)
      loop:  resume? -> validate -> [rl_step -> reduce metrics -> log -> validate? -> checkpoint?]* -> plot
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoTokenizer

from rlhf import platform
from rlhf.algo.advantages import AdvantageKind
from rlhf.algo.kl import KLController
from rlhf.checkpoint import CheckpointManager
from rlhf.config.schema import RlhfConfig
from rlhf.data.loader import PromptLoader, load_prompts
from rlhf.dist.watchdog import Watchdog
from rlhf.dist.meshes import ROLES, ModelDims, RoleMeshes, build_role_meshes, plan_meshes
from rlhf.errors import ConfigError
from rlhf.metrics import MetricsSink
from rlhf.rollout.factory import build_engine, close_engine, engine_layout, eos_token_ids
from rlhf.run_dir import RunDir, get_logger, progress
from rlhf.step import RLStack, rl_step
from rlhf.trainer.config import check_batch_sizes
from rlhf.trainer.memory import check_sleep, plan_memory_phases
from rlhf.trainer.roles import CriticRole, PolicyRole, RewardModelRole
from rlhf.trainer.scoring import Scorer
from rlhf.trainer.sync import SharedWeights
from rlhf.trainer.validate import validate

log = get_logger("trainer")
CONSOLE_KEYS = {"critic/score/mean": "reward", "val/score/mean@1": "val", "actor/pg_loss": "pg_loss",
                "actor/entropy": "entropy", "response_length/mean": "resp_len", "timing_s/step": "step_s"}


def _model_dims(path: str, label: str = "model.path") -> ModelDims:
    if not path or not Path(path).is_dir():
        raise ConfigError(f"{label}={path!r} is not a folder; point it at an HF model folder "
                          "(config.json + safetensors), e.g. one written by `rlhf sft`")
    hf_config = AutoConfig.from_pretrained(path)
    return ModelDims(hf_config.num_hidden_layers, hf_config.num_attention_heads,
                     getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads)


def _mesh_config(cfg: RlhfConfig):
    """The mesh config with exactly the roles the algorithm uses (ref only with KL, critic only with GAE)."""
    algo = cfg.algo
    needed = {"actor", "rollout"} | ({"ref"} if algo.uses_ref else set()) | ({"critic"} if algo.uses_critic else set())
    if cfg.reward.model_path:
        needed.add("reward")
    return dataclasses.replace(cfg.mesh, roles=[role for role in ROLES if role in needed])


def _role_dims(cfg: RlhfConfig) -> dict[str, ModelDims]:
    """Models that differ from the policy (critic, reward model) are checked against their own sizes."""
    dims = {}
    if cfg.algo.uses_critic and cfg.model.critic_path:
        dims["critic"] = _model_dims(cfg.model.critic_path, "model.critic_path")
    if cfg.reward.model_path:
        if cfg.algo.advantage.kind == AdvantageKind.REMAX:
            raise ConfigError("algo.advantage.kind=remax scores a greedy baseline with rule rewards; it cannot "
                              "be combined with reward.model_path yet")
        dims["reward"] = _model_dims(cfg.reward.model_path, "reward.model_path")
    return dims


def _check_batches(cfg: RlhfConfig, layouts: dict) -> None:
    for role in ("actor", "critic"):
        if role in layouts:
            check_batch_sizes(prompts_per_step=cfg.data.prompts_per_step, n=cfg.sampling.n,
                              rollout_dp=layouts["rollout"].dp, role=role, role_dp=layouts[role].dp,
                              update=getattr(cfg, role))


def _shares_weights(cfg: RlhfConfig, layouts: dict) -> bool:
    """The colocated native engine in the actor's own layout generates with the actor's parameter tensors."""
    return cfg.rollout.engine == "native" and layouts["rollout"] == layouts["actor"]


def _sleep(cfg: RlhfConfig) -> str:
    return cfg.rollout.resolved_sleep(accelerator=platform.has_accelerator())


def preflight(cfg: RlhfConfig, world_size: int) -> None:
    """Every input check that needs no process group, run before the run folder exists: bad input writes nothing."""
    layouts = plan_meshes(_mesh_config(cfg), world_size, _model_dims(cfg.model.path), _role_dims(cfg))
    _check_batches(cfg, layouts)
    check_sleep(_sleep(cfg), _shares_weights(cfg, layouts))
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    records = load_prompts(cfg.data.train_files, tokenizer, cfg.data).records
    if cfg.reward.model_path:
        records = []  # the reward model scores training; rule rewards only score validation
    if cfg.data.val_files:
        records += load_prompts(cfg.data.val_files, tokenizer, cfg.data, label="data.val_files").records
    Scorer(cfg.reward, tokenizer).check_sources(records)


class Trainer:
    def __init__(self, cfg: RlhfConfig, run_dir: RunDir) -> None:
        self.cfg, self.run_dir = cfg, run_dir
        algo = cfg.algo
        self.meshes: RoleMeshes = build_role_meshes(_mesh_config(cfg), _model_dims(cfg.model.path),
                                                    timeout_s=cfg.dist.timeout_s, role_dims=_role_dims(cfg))
        _check_batches(cfg, {role: mesh.layout for role, mesh in self.meshes.meshes.items()})
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
        pad = self.tokenizer.pad_token_id
        self.pad_token_id = pad if pad is not None else (self.tokenizer.eos_token_id or 0)
        self.loader = self._build_data()
        self.scorer = Scorer(cfg.reward, self.tokenizer)
        self.scorer.check_sources(([] if cfg.reward.model_path else self.loader.prompts.records)
                                  + (self.val.records if self.val else []))
        optimizer_steps = cfg.trainer.total_steps * cfg.actor.epochs * cfg.actor.mini_batches
        actor = PolicyRole("actor", self.meshes["actor"], cfg.model.path, update=cfg.actor,
                           total_steps=optimizer_steps, recompute=cfg.model.recompute, seed=cfg.dist.seed,
                           fused_head=cfg.model.fused_head, temperature=cfg.sampling.logprob_temperature,
                           params_dtype=cfg.model.torch_dtype)
        ref = (PolicyRole("ref", self.meshes["ref"], cfg.model.path, update=None, total_steps=0,
                          seed=cfg.dist.seed, offload_frozen=cfg.ref.offload, fused_head=cfg.model.fused_head,
                          temperature=cfg.sampling.logprob_temperature, params_dtype=cfg.model.torch_dtype)
               if algo.uses_ref else None)
        critic = (CriticRole("critic", self.meshes["critic"], cfg.model.critic_path or cfg.model.path,
                             update=cfg.critic, value_head=True, seed=cfg.dist.seed + 1,
                             total_steps=cfg.trainer.total_steps * cfg.critic.epochs * cfg.critic.mini_batches,
                             params_dtype=cfg.model.torch_dtype)
                  if algo.uses_critic else None)
        reward_model = (RewardModelRole("reward", self.meshes["reward"], cfg.reward.model_path, update=None,
                                        total_steps=0, value_head=True, offload_frozen=cfg.reward.model_offload,
                                        params_dtype=cfg.model.torch_dtype)
                        if cfg.reward.model_path else None)
        engine, weight_sync = self._build_rollout(actor)
        layouts = {role: mesh.layout for role, mesh in self.meshes.meshes.items()}
        memory = plan_memory_phases(engine=engine, roles={"actor": actor, "critic": critic, "ref": ref,
                                                          "reward": reward_model},
                                    on_rollout_mesh=self.meshes["rollout"].is_member, sleep=_sleep(cfg),
                                    weights_shared=_shares_weights(cfg, layouts))
        self.stack = RLStack(rollout=engine, rollout_layout=self.meshes["rollout"].layout, scorer=self.scorer,
                             actor=actor, ref=ref, critic=critic, weight_sync=weight_sync, algo=algo,
                             sampling=cfg.sampling, actor_update=cfg.actor, critic_update=cfg.critic,
                             kl_controller=KLController.from_config(algo.kl), pad_token_id=self.pad_token_id,
                             reward_model=reward_model, memory=memory)
        self.checkpoints = CheckpointManager(run_dir.path / "checkpoints", cfg.checkpoint.keep_last)
        self.sink = MetricsSink(run_dir.path, enabled=run_dir.is_rank0, tensorboard=cfg.trainer.tensorboard)

    def _build_data(self) -> PromptLoader:
        rollout = self.meshes["rollout"]
        dp_rank = rollout.pgs.dp.rank() if rollout.is_member else 0
        loader = PromptLoader(self.cfg.data, self.tokenizer, dp_rank=dp_rank, dp_size=rollout.layout.dp)
        self.val = (load_prompts(self.cfg.data.val_files, self.tokenizer, self.cfg.data, label="data.val_files")
                    if self.cfg.data.val_files else None)
        return loader

    def _build_rollout(self, actor: PolicyRole):
        """The rollout engine on its mesh and how the actor's weights reach it after each update.

        Colocated native rollout in the actor's own layout shares its parameters (a free sync); any other
        layout or engine gets its own copy, refreshed by the planned, bucketed resharding (`rlhf.reshard`).
        """
        cfg, mesh = self.cfg, self.meshes["rollout"]
        actor_layout = self.meshes["actor"].layout
        if _shares_weights(cfg, {"rollout": mesh.layout, "actor": actor_layout}):
            if not mesh.is_member:
                return None, SharedWeights(None)
            from rlhf.rollout.native.engine import NativeEngine

            engine = NativeEngine(actor.model, vocab_size=actor.vocab_size, config=cfg.rollout.native,
                                  eos_token_ids=eos_token_ids(cfg.model.path), layout=engine_layout(mesh.pgs),
                                  tp_group=mesh.pgs.tp)
            return engine, SharedWeights(engine)
        from rlhf.reshard.sync import WeightSync

        engine = (build_engine(cfg.rollout, cfg.model.path, mesh.pgs, dtype=cfg.model.torch_dtype)
                  if mesh.is_member else None)
        sync = WeightSync(actor.model, actor_layout, mesh.layout, engine,
                          hf_config=AutoConfig.from_pretrained(cfg.model.path), verify=cfg.comm.verify,
                          hf_names=cfg.rollout.engine != "native")
        return engine, sync

    # -- state -----------------------------------------------------------------------------------------------
    def _state(self, step: int) -> dict:
        return {"step": step, "actor": self.stack.actor.state_dict(),
                "critic": self.stack.critic.state_dict() if self.stack.critic else {},
                "loader": self.loader.state_dict(), "kl": self.stack.kl_controller.state_dict(),
                "policy_version": getattr(self.stack.rollout, "policy_version", 0),
                "rng": {"torch": platform.rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}}

    def _meta(self) -> dict:
        return {"layouts": {role: m.layout.describe() for role, m in self.meshes.meshes.items()}}

    def _resume(self) -> int:
        path = self.checkpoints.resolve(self.cfg.checkpoint.resume)
        if path is None:
            return 0
        state, meta = self.checkpoints.load(path, expected_meta=self._meta())
        self.stack.actor.load_state_dict(state["actor"])
        if self.stack.critic:
            self.stack.critic.load_state_dict(state["critic"])
        self.loader.load_state_dict(state["loader"])
        self.stack.kl_controller.load_state_dict(state["kl"])
        if self.stack.rollout is not None:
            self.stack.rollout.policy_version = state["policy_version"]
        platform.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
        np.random.set_state(state["rng"]["numpy"])
        log.info("resumed from %s (step %d)", path, state["step"])
        return state["step"]

    def push_initial_weights(self) -> None:
        """An engine with its own weights (a resharded copy, or vLLM's dummy init) takes the actor's current (maybe
        resumed) ones before the first rollout; the policy version stays what the checkpoint (or 0) says."""
        if isinstance(self.stack.weight_sync, SharedWeights):
            return
        engine = self.stack.rollout
        version = engine.policy_version if engine is not None else 0
        self.stack.weight_sync.sync()
        if engine is not None:
            engine.policy_version = version

    # -- loop ------------------------------------------------------------------------------------------------
    def validate(self, step: int) -> dict[str, float]:
        if self.val is None:
            return {}
        native = self.cfg.rollout.native
        chunk = max(1, native.max_batch_size // max(1, self.cfg.sampling.val_n))
        with self.stack.memory.rollout(sync_follows=False):
            return validate(self.stack.rollout, self.stack.rollout_layout, self.val, self.scorer,
                            self.cfg.sampling.val_params(step), chunk, self.pad_token_id)

    def fit(self) -> list[dict]:
        cfg = self.cfg.trainer
        start = self._resume()
        self.push_initial_weights()
        history = []
        if start == 0 and cfg.val_before_train and self.val is not None:
            values = {"step": 0, **self.validate(0)}
            self.sink.write(0, values)
            history.append(values)
            log.info("before training: val/score/mean@1 = %.4f", values["val/score/mean@1"])
        bar = progress(range(start + 1, cfg.total_steps + 1), desc="rl", total=cfg.total_steps - start)
        try:
            with self._watchdog() as watchdog:
                for step in bar:
                    with watchdog.phase(f"rl_step {step}"):
                        history.append(self._step(step))
        finally:
            close_engine(self.stack.rollout)  # vLLM's teardown needs the process groups still alive
        self.sink.close()
        return history

    def _watchdog(self) -> Watchdog:
        """A step that outlives comm.step_timeout_s dumps every rank's stacks to its log and exits non-zero."""
        rank = dist.get_rank()
        return Watchdog(timeout_s=self.cfg.comm.step_timeout_s, log_file=self.run_dir.path / f"rank{rank}.log",
                        store=dist.distributed_c10d._get_default_store())

    def _step(self, step: int) -> dict:
        """One RL step plus its validation, logging and checkpoint."""
        cfg = self.cfg.trainer
        values = rl_step(self.stack, self.loader.next_step(), step).reduced()
        if (cfg.val_every and step % cfg.val_every == 0) or step == cfg.total_steps:
            values.update(self.validate(step))
        values["training/global_step"] = step
        self.sink.write(step, values)
        log.info("step %d: %s", step, "  ".join(f"{CONSOLE_KEYS[k]}={values[k]:.4g}"
                                               for k in CONSOLE_KEYS if k in values))
        every = self.cfg.checkpoint.every
        if (every and step % every == 0) or (step == cfg.total_steps and self.cfg.checkpoint.save_at_end):
            self.checkpoints.save(step, self._state(step), meta=self._meta())
        return {"step": step, **values}
