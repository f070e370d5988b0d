"""The RL trainer: builds every role on its mesh, then runs `rl_step` with validation, metrics and checkpoints.

    Trainer(cfg, run_dir).fit()
      build: meshes -> data -> reward -> actor / ref / critic / reward model / rollout engine (+ weight sync)
      loop:  resume? -> validate -> [rl_step -> reduce metrics -> alerts -> log -> validate? -> checkpoint?]*
Layouts, groups and every input check come from `rlhf.orchestration.preflight`; with trainer.async_mode on, each step
follows `rlhf.orchestration.async_schedule` (rollout ranks a batch ahead) and the in-flight batches are checkpointed.
Every stage after process-group init (build, resume, first push, validation, each step, each save) is a
watchdog phase: a stall anywhere ends every rank with stacks in its log.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch.distributed as dist
from transformers import AutoConfig

from rlhf.algo.kl import KLController
from rlhf.checkpoint import find_latest
from rlhf.config.loader import to_dict
from rlhf.orchestration.schema import RlhfConfig
from rlhf.data.loader import PromptLoader, load_prompts
from rlhf.parallel.watchdog import Watchdog
from rlhf.parallel.meshes import RoleMeshes
from rlhf.platform.compat import torch as torch_compat
from rlhf.loggers import RunInfo
from rlhf.metrics import MetricReducer, MetricsSink, StepMetrics, read_jsonl
from rlhf.ops.alerts import AlertMonitor
from rlhf.ops.prometheus import PrometheusExporter
from rlhf.rollout.factory import build_engine, close_engine, engine_layout, eos_token_ids
from rlhf.run_dir import RunDir, get_logger, progress
from rlhf.orchestration.step import RLStack, rl_step
from rlhf.orchestration.async_schedule import AsyncSchedule, check_async, training_group
from rlhf.trainer.checks import input_warnings, load_tokenizer
from rlhf.orchestration.console import end_summary, finished_notice, start_banner
from rlhf.trainer.memory import plan_memory_phases
from rlhf.trainer.plot import plot_run
from rlhf.orchestration.checkpointing import RunCheckpoints
from rlhf.orchestration.preflight import (build_meshes, check_batches, resolved_algo, resolved_sleep, rollout_dtype,
                                          shares_weights)
from rlhf.trainer.roles import CriticRole, PolicyRole, RewardModelRole
from rlhf.trainer.scoring import Scorer
from rlhf.trainer.sync import SharedWeights
from rlhf.trainer.rollout_dump import RolloutDumper
from rlhf.trainer.validate import run_validation

log = get_logger("trainer")
CONSOLE_KEYS = {"critic/score/mean": "reward", "val/score/mean@1": "val", "actor/pg_loss": "pg_loss",
                "actor/entropy": "entropy", "response_length/mean": "resp_len", "timing_s/step": "step_s"}


class Trainer:
    def __init__(self, cfg: RlhfConfig, run_dir: RunDir) -> None:
        self.cfg, self.run_dir = cfg, run_dir
        self.watchdog = self._watchdog()
        with self.watchdog, self.watchdog.phase("build", self.cfg.comm.setup_timeout_s):
            self._build(cfg, run_dir)

    def _build(self, cfg: RlhfConfig, run_dir: RunDir) -> None:
        """Meshes, data, reward and every role on its mesh, the rollout engine and its weight sync (collective)."""
        self.meshes: RoleMeshes = build_meshes(cfg)
        self.metric_reducer = MetricReducer(strategy=cfg.comm.strategy, min_bucket_mb=cfg.comm.min_bucket_mb,
                                            verify=cfg.comm.verify, timeout_s=cfg.dist.timeout_s)
        layouts = {role: mesh.layout for role, mesh in self.meshes.meshes.items()}
        check_batches(cfg, layouts)
        algo = resolved_algo(cfg, layouts)
        check_async(cfg, layouts, algo)
        # async: the training roles gather among themselves while the rollout ranks generate (every rank creates it)
        train_group = training_group(self.meshes) if cfg.trainer.is_async else None
        self.tokenizer = load_tokenizer(cfg.model.path)
        pad = self.tokenizer.pad_token_id
        self.pad_token_id = pad if pad is not None else (self.tokenizer.eos_token_id or 0)
        self.loader = self._build_data()
        if run_dir.is_rank0:
            for warning in input_warnings(cfg, self.tokenizer, self.loader.prompts, self.val):
                log.warning(warning)
        self.scorer = Scorer(cfg.reward, self.tokenizer)
        self.scorer.check_sources(([] if cfg.reward.model_path else self.loader.prompts.records)
                                  + (self.val.records if self.val else []))
        optimizer_steps = cfg.trainer.total_steps * cfg.actor.epochs * cfg.actor.mini_batches
        actor = PolicyRole("actor", self.meshes["actor"], cfg.model.path, update=cfg.actor,
                           total_steps=optimizer_steps, recompute=cfg.model.recompute, seed=cfg.dist.seed,
                           fused_head=cfg.model.fused_head, temperature=cfg.sampling.logprob_temperature,
                           params_dtype=cfg.model.torch_dtype, moe_kwargs=cfg.model.moe.build_kwargs(),
                           gather_group=train_group, routing_replay=algo.routing_replay)
        ref = (PolicyRole("ref", self.meshes["ref"], cfg.model.path, update=None, total_steps=0,
                          micro_batch_size=cfg.ref.micro_batch_size, seed=cfg.dist.seed,
                          offload_frozen=cfg.ref.offload, fused_head=cfg.model.fused_head,
                          temperature=cfg.sampling.logprob_temperature, params_dtype=cfg.model.torch_dtype,
                          moe_kwargs=cfg.model.moe.build_kwargs(), gather_group=train_group,
                          routing_replay=algo.routing_replay)
               if algo.uses_ref else None)
        critic = (CriticRole("critic", self.meshes["critic"], cfg.model.critic_path or cfg.model.path,
                             update=cfg.critic, value_head=True, seed=cfg.dist.seed + 1,
                             total_steps=cfg.trainer.total_steps * cfg.critic.epochs * cfg.critic.mini_batches,
                             params_dtype=cfg.model.torch_dtype, moe_kwargs=cfg.model.moe.build_kwargs(),
                             gather_group=train_group)
                  if algo.uses_critic else None)
        reward_model = (RewardModelRole("reward", self.meshes["reward"], cfg.reward.model_path, update=None,
                                        total_steps=0, micro_batch_size=cfg.reward.model_micro_batch_size,
                                        value_head=True, offload_frozen=cfg.reward.model_offload,
                                        params_dtype=cfg.model.torch_dtype, gather_group=train_group)
                        if cfg.reward.model_path else None)
        engine, weight_sync = self._build_rollout(actor)
        if engine is not None and algo.routing_replay == "r3":
            engine.record_routing = True  # a native engine (preflight checks): rollouts carry their routing
        memory = plan_memory_phases(engine=engine, roles={"actor": actor, "critic": critic, "ref": ref,
                                                          "reward": reward_model},
                                    on_rollout_mesh=self.meshes["rollout"].is_member, sleep=resolved_sleep(cfg),
                                    weights_shared=shares_weights(cfg, layouts))
        self._weights_pushed = False
        self.stack = RLStack(rollout=engine, rollout_layout=self.meshes["rollout"].layout, scorer=self.scorer,
                             actor=actor, ref=ref, critic=critic, weight_sync=weight_sync, algo=algo,
                             sampling=cfg.sampling, actor_update=cfg.actor,
                             kl_controller=KLController.from_config(algo.kl), pad_token_id=self.pad_token_id,
                             reward_model=reward_model, memory=memory)
        self.async_schedule = (AsyncSchedule(self.stack, self.loader, self.meshes, cfg.trainer.max_staleness,
                                             train_group, cfg.trainer.partial_rollout_tokens)
                               if cfg.trainer.is_async else None)
        if cfg.trainer.dump_rollouts:  # written by a rank that holds the trained batch (async: not a rollout rank)
            writer = self.async_schedule.reporter_rank if self.async_schedule else 0
            self.stack.dump = RolloutDumper(run_dir.path / "rollouts", every=cfg.trainer.dump_every,
                                            records=self.loader.prompts.records, tokenizer=self.tokenizer,
                                            enabled=dist.get_rank() == writer).write
        self.sink: MetricsSink | None = None  # opened once the resumed step is known
        self.alerts = AlertMonitor(cfg.alerts, run_dir.path, is_rank0=run_dir.is_rank0)
        self.checkpoints = RunCheckpoints(cfg, run_dir, self.meshes, self.stack, self.loader, self.alerts,
                                          self.async_schedule, self.watchdog)
        self.exporter: PrometheusExporter | None = None  # rank 0 serves while `fit` runs

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
        if shares_weights(cfg, {"rollout": mesh.layout, "actor": actor_layout}):
            if not mesh.is_member:
                return None, SharedWeights(None)
            from rlhf.rollout.native.engine import NativeEngine

            engine = NativeEngine(actor.model, vocab_size=actor.vocab_size, config=cfg.rollout.native,
                                  eos_token_ids=eos_token_ids(cfg.model.path), layout=engine_layout(mesh.pgs),
                                  tp_group=mesh.pgs.tp)
            return engine, SharedWeights(engine)
        from rlhf.reshard.sync import WeightSync

        dtype = rollout_dtype(cfg)
        engine = build_engine(cfg.rollout, cfg.model.path, mesh.pgs, dtype=dtype) if mesh.is_member else None
        if cfg.rollout.engine == "vllm":
            from rlhf.rollout.vllm_engine import align_group_names

            align_group_names()  # vLLM on the rollout ranks alone created groups the others did not
        sync = WeightSync(actor.model, actor_layout, mesh.layout, engine,
                          hf_config=AutoConfig.from_pretrained(cfg.model.path), verify=cfg.comm.verify,
                          hf_names=cfg.rollout.engine != "native", dtype=dtype,
                          method=cfg.comm.weight_sync_method, max_bucket_mb=cfg.comm.weight_sync_bucket_mb or None,
                          coalesce=cfg.comm.strategy != "plain")
        return engine, sync

    def push_initial_weights(self) -> None:
        """An engine with its own weights (a resharded copy, or vLLM's dummy init) takes the actor's current (maybe
        resumed) ones before the first rollout; the policy version stays what the checkpoint (or 0) says.
        Collective; idempotent (`run_step` calls it if nobody did)."""
        if self._weights_pushed or isinstance(self.stack.weight_sync, SharedWeights):
            self._weights_pushed = True
            return
        self._weights_pushed = True
        engine = self.stack.rollout
        version = engine.policy_version if engine is not None else 0
        self.stack.weight_sync.sync()
        if engine is not None:
            engine.policy_version = version

    # -- loop ------------------------------------------------------------------------------------------------
    def run_step(self, step: int) -> StepMetrics:
        """One RL step on this rank (unreduced metrics): the one step driver `fit`, `rlhf profile`/`bench` and
        the benchmarks share, so none can skip the initial weight push or dynamic sampling's extra prompts."""
        self.push_initial_weights()
        if self.async_schedule:
            return self.async_schedule.step(step)
        return rl_step(self.stack, self.loader.next_step(), step, more_prompts=self.loader.next_step)

    def validate(self, step: int) -> dict[str, float]:
        if self.val is None:
            return {}
        native = self.cfg.rollout.native
        chunk = max(1, native.max_batch_size // max(1, self.cfg.sampling.val_n))
        with self.stack.memory.rollout(sync_follows=False):
            result = run_validation(self.stack.rollout, self.stack.rollout_layout, self.val, self.scorer,
                                    self.cfg.sampling.val_params(step), chunk, self.pad_token_id,
                                    num_samples=self.cfg.trainer.val_samples)
        if self.sink is not None:
            self.sink.write_samples(step, result.samples)
        return result.metrics

    def fit(self) -> list[dict]:
        cfg = self.cfg.trainer
        try:
            with self.watchdog as watchdog:
                with watchdog.phase("resume", self.cfg.comm.setup_timeout_s):
                    start = self.checkpoints.resume()
                if start >= cfg.total_steps:
                    self._announce(lambda: [finished_notice(self.cfg, self.run_dir.path, start)])
                    return []
                self._announce(lambda: start_banner(
                    self.cfg, world_size=dist.get_world_size(), backend=str(dist.get_backend()),
                    mesh_rows=self.meshes.summary_rows(), num_train=len(self.loader.prompts.records),
                    num_val=len(self.val.records) if self.val else 0, run_path=self.run_dir.path, start_step=start))
                started = time.perf_counter()
                self.run_dir.commit_config()  # only now: a failed resume leaves the run's config.yaml as it was
                self.sink = MetricsSink(self.run_dir.path, enabled=self.run_dir.is_rank0, loggers=cfg.loggers,
                                        first_step=start + 1 if start else 0, info=RunInfo(
                                            project=cfg.project_name, config=to_dict(self.cfg),
                                            experiment=cfg.experiment_name or self.run_dir.path.name))
                self._start_exporter()
                with watchdog.phase("first weight push"):
                    self.push_initial_weights()
                history = []
                if start == 0 and cfg.val_before_train and self.val is not None:
                    with watchdog.phase("validation before training"):
                        values = {"step": 0, **self.validate(0)}
                    self.sink.write(0, values)
                    history.append(values)
                    log.info("before training: val/score/mean@1 = %.4f", values["val/score/mean@1"])
                bar = progress(range(start + 1, cfg.total_steps + 1), desc="rl", total=cfg.total_steps - start)
                for step in bar:
                    with watchdog.phase(f"rl_step {step}"):
                        history.append(self._step(step))
        finally:
            close_engine(self.stack.rollout)  # vLLM's teardown needs the process groups still alive
            self.alerts.close()
            if self.exporter is not None:
                self.exporter.close()
        self.sink.close()
        self._write_curve()
        self._announce(lambda: end_summary(self.cfg, run_path=self.run_dir.path, last_step=cfg.total_steps,
                                           elapsed_s=time.perf_counter() - started,
                                           world_size=dist.get_world_size(),
                                           checkpoint=find_latest(self.checkpoints.manager.root)))
        return history

    def _announce(self, lines: Callable[[], list[str]]) -> None:
        """Rank 0 logs the lines (only rank 0 builds them: the banner reads every role's model config)."""
        if self.run_dir.is_rank0:
            for line in lines():
                log.info(line)

    def _write_curve(self) -> None:
        """trainer.plot: rank 0 draws curve.png from the run's whole metrics.jsonl (resumed segments included)."""
        metrics = self.run_dir.path / "metrics.jsonl"
        if not (self.cfg.trainer.plot and self.run_dir.is_rank0):
            return
        if not metrics.is_file():
            log.info("learning curve: none (trainer.logger writes no metrics.jsonl)")
            return
        path = plot_run(read_jsonl(metrics), self.run_dir.path)
        log.info("learning curve: %s", path or "none (matplotlib is not installed; pip install matplotlib)")

    def _start_exporter(self) -> None:
        """`metrics.prometheus_port` != 0: rank 0 serves /metrics, heartbeats read from the rendezvous store."""
        metrics = self.cfg.metrics
        if not metrics.prometheus_port or not self.run_dir.is_rank0:
            return
        self.exporter = PrometheusExporter(metrics, world_size=dist.get_world_size(),
                                           store=torch_compat.default_store())
        (self.run_dir.path / "prometheus.port").write_text(f"{self.exporter.port}\n")
        log.info("prometheus: serving http://%s:%d/metrics", metrics.prometheus_host, self.exporter.port)

    def _watchdog(self) -> Watchdog:
        """A phase that outlives comm.step_timeout_s dumps every rank's stacks to its log and exits non-zero."""
        rank = dist.get_rank()
        return Watchdog(timeout_s=self.cfg.comm.step_timeout_s, log_file=self.run_dir.path / f"rank{rank}.log",
                        store=torch_compat.default_store())

    def _step(self, step: int) -> dict:
        """One RL step plus its validation, logging and checkpoint."""
        cfg = self.cfg.trainer
        values = self.run_step(step).reduced(self.metric_reducer)
        values.update(self.alerts.observe(step, values, self.stack.last_batch))
        if (cfg.val_every and step % cfg.val_every == 0) or step == cfg.total_steps:
            values.update(self.validate(step))
        values["training/global_step"] = step
        self.sink.write(step, values)
        if self.exporter is not None:
            self.exporter.update(step, values, self.alerts.counts)
        log.info("step %d: %s", step, "  ".join(f"{CONSOLE_KEYS[k]}={values[k]:.4g}"
                                               for k in CONSOLE_KEYS if k in values))
        self.checkpoints.at_step_end(step)
        return {"step": step, **values}
