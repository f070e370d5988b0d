"""The RL trainer: builds the two sides of the step and their boundary, then runs the step driver with validation,
metrics and checkpoints.

    Trainer(cfg, run_dir).fit()
      build: meshes -> data -> reward -> TrainRoles -> rollout engine (+ weight sync) -> memory phases
             -> RolloutSide · TrainSide · Boundary -> StepDriver (`rlhf.orchestration.step`)
      loop:  resume? -> validate -> [step -> reduce metrics -> alerts -> log -> validate? -> checkpoint?]*
Layouts, groups and every input check come from `rlhf.orchestration.preflight`; with trainer.async_mode on, each step
is the driver's one-step-off ordering (`rlhf.orchestration.async_schedule`: rollout ranks a batch ahead) and the
in-flight batches are checkpointed. Every scored batch reaches `scored_hooks` (rollout dumps; tests add theirs).
Every stage after process-group init (build, resume, first push, validation, each step, each save) is a
watchdog phase: a stall anywhere ends every rank with stacks in its log. `rlhf replay` and `rlhf sft` are this
trainer with another step: a dumped batch (`replay.py`), the supervised update on labelled records (`sft.py`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch.distributed as dist
from transformers import AutoConfig

from rlhf.checkpoint import find_latest
from rlhf.config.loader import to_dict
from rlhf.orchestration.schema import RlhfConfig
from rlhf.data.loader import PromptLoader, load_prompts
from rlhf.parallel.watchdog import Watchdog
from rlhf.parallel.meshes import RoleMeshes
from rlhf.platform.compat import torch as torch_compat
from rlhf.loggers import RunInfo
from rlhf.models.lora import adapter_dtype
from rlhf.metrics import MetricsSink, StepMetrics, read_jsonl
from rlhf.ops.alerts import AlertMonitor
from rlhf.ops.prometheus import PrometheusExporter
from rlhf.rollout.factory import build_engine, close_engine, engine_layout, eos_token_ids
from rlhf.rollout.vllm_lora import ADAPTER_FOLDER
from rlhf.run_dir import RunDir, get_logger, progress
from rlhf.orchestration.async_schedule import AsyncSchedule, check_async, training_group
from rlhf.orchestration.boundary import Boundary
from rlhf.orchestration.rollout_side import RolloutSide
from rlhf.orchestration.step import StepDriver
from rlhf.orchestration.train_side import TrainRoles, TrainSide
from rlhf.orchestration.checks import input_warnings, load_tokenizer
from rlhf.orchestration.console import end_summary, finished_notice, start_banner
from rlhf.stages.memory import plan_memory_phases
from rlhf.orchestration.plot import plot_run
from rlhf.orchestration.checkpointing import RunCheckpoints
from rlhf.orchestration.preflight import (build_meshes, check_batches, resolved_algo, resolved_sleep, rollout_dtype,
                                          shares_weights)
from rlhf.stages.batch import ScoredBatch
from rlhf.stages.policy_role import PolicyRole
from rlhf.stages.scoring import Scorer
from rlhf.stages.sync import SharedWeights
from rlhf.orchestration.rollout_dump import RolloutDumper
from rlhf.stages.validate import run_validation

log = get_logger("trainer")
CONSOLE_KEYS = {"critic/score/mean": "reward", "val/score/mean@1": "val", "actor/pg_loss": "pg_loss",
                "actor/entropy": "entropy", "sft/loss": "sft_loss", "response_length/mean": "resp_len",
                "timing_s/step": "step_s"}


class Trainer:
    train_side_type: type[TrainSide] = TrainSide  # what `train(batch)` does (`rlhf sft`: the supervised update)
    step_name = "rl"  # the progress bar's and the step's watchdog phase's name
    steps_key = "trainer.total_steps"  # the setting the number of steps comes from (named when a run is done)
    batch_key = "data.prompts_per_step"  # the setting the prompts per step come from (named in errors)

    def __init__(self, cfg: RlhfConfig, run_dir: RunDir) -> None:
        self.cfg, self.run_dir = cfg, run_dir
        self.watchdog = self._watchdog()
        with self.watchdog, self.watchdog.phase("build", self.cfg.comm.setup_timeout_s):
            self._build(cfg, run_dir)

    def _build(self, cfg: RlhfConfig, run_dir: RunDir) -> None:
        """Meshes, data, reward, the two sides of the step and their boundary (collective)."""
        self.meshes: RoleMeshes = build_meshes(cfg)
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
        self.scorer = self._build_scorer()
        roles = TrainRoles.from_config(cfg, algo, self.meshes, train_group, self.loader.prompts.records)
        engine, weight_sync = self._build_rollout(roles.actor)
        if engine is not None and algo.routing_replay == "r3":
            engine.record_routing = True  # a native engine (preflight checks): rollouts carry their routing
        memory = plan_memory_phases(engine=engine, roles=roles.by_name(), sleep=resolved_sleep(cfg),
                                    on_rollout_mesh=self.meshes["rollout"].is_member,
                                    weights_shared=shares_weights(cfg, layouts))
        self.rollout_side = RolloutSide.from_config(cfg, algo, self.meshes, engine=engine, loader=self.loader,
                                                    scorer=self.scorer, memory=memory, pad_token_id=self.pad_token_id)
        self.train_side = self.train_side_type.from_config(cfg, algo, roles, memory)
        self.boundary = Boundary.from_config(cfg, self.meshes["rollout"].layout, engine=engine,
                                             weight_sync=weight_sync, memory=memory)
        pipeline = (AsyncSchedule(self.meshes, cfg.trainer.max_staleness, train_group,
                                  cfg.trainer.partial_rollout_tokens, self.rollout_side)
                    if cfg.trainer.is_async else None)
        self.driver = StepDriver(rollout=self.rollout_side, train=self.train_side, boundary=self.boundary,
                                 pipeline=pipeline, on_scored=self._on_scored)
        self.last_scored: ScoredBatch | None = None  # what alerts.nan_policy=abort dumps
        self.scored_hooks: list[Callable[[ScoredBatch, int], None]] = (
            [self._dumper(pipeline)] if cfg.trainer.dump_rollouts else [])  # tests add their own
        self.sink: MetricsSink | None = None  # opened once the resumed step is known
        self.alerts = AlertMonitor(cfg.alerts, run_dir.path, is_rank0=run_dir.is_rank0)
        self.checkpoints = RunCheckpoints(cfg, run_dir, self.meshes, self.train_side, self.rollout_side, self.loader,
                                          self.alerts, pipeline, self.watchdog)
        self.exporter: PrometheusExporter | None = None  # rank 0 serves while `fit` runs

    def _build_scorer(self) -> Scorer:
        """The rule reward, checked against every data source it will see; input warnings on rank 0."""
        cfg = self.cfg
        if self.run_dir.is_rank0:
            for warning in input_warnings(cfg, self.tokenizer, self.loader.prompts, self.val):
                log.warning(warning)
        scorer = Scorer(cfg.reward, self.tokenizer)
        scorer.check_sources(([] if cfg.reward.model_path else self.loader.prompts.records)
                             + (self.val.records if self.val else []))
        return scorer

    def _dumper(self, pipeline: AsyncSchedule | None) -> Callable[[ScoredBatch, int], None]:
        """trainer.dump_rollouts, written by a rank that holds the trained batch (async: not a rollout rank)."""
        writer = pipeline.reporter_rank if pipeline else 0
        return RolloutDumper(self.run_dir.path / "rollouts", every=self.cfg.trainer.dump_every,
                             records=self.loader.prompts.records, tokenizer=self.tokenizer,
                             enabled=dist.get_rank() == writer).write

    def _on_scored(self, batch: ScoredBatch, step: int) -> None:
        """Every trained batch, under its step: kept for the alerts' NaN dump, then the hooks (rollout dumps)."""
        self.last_scored = batch
        for hook in self.scored_hooks:
            hook(batch, step)

    def _build_data(self) -> PromptLoader:
        dp_rank, dp_size = self._loader_shard()
        loader = PromptLoader(self.cfg.data, self.tokenizer, dp_rank=dp_rank, dp_size=dp_size,
                              batch_key=self.batch_key)
        self.val = (load_prompts(self.cfg.data.val_files, self.tokenizer, self.cfg.data, label="data.val_files")
                    if self.cfg.data.val_files else None)
        return loader

    def _loader_shard(self) -> tuple[int, int]:
        """(dp rank, dp size) of the prompts this rank takes each step: its rollout replica's share."""
        rollout = self.meshes["rollout"]
        return (rollout.pgs.dp.rank() if rollout.is_member else 0), rollout.layout.dp

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
        adapter_sync = cfg.lora.enabled and cfg.lora.sync == "adapter"
        lora = dict(lora=cfg.lora, adapter_dtype=adapter_dtype(cfg.lora),
                    adapter_folder=str(self.run_dir.path / ADAPTER_FOLDER),
                    adapter_slots=cfg.trainer.max_staleness + 1) if adapter_sync else {}
        engine = build_engine(cfg.rollout, cfg.model.path, mesh.pgs, dtype=dtype, **lora) if mesh.is_member else None
        if cfg.rollout.engine == "vllm":
            from rlhf.rollout.vllm_engine import align_group_names

            align_group_names()  # vLLM on the rollout ranks alone created groups the others did not
        sync_class, extra = WeightSync, {}
        if adapter_sync:
            from rlhf.reshard.lora_sync import AdapterSync

            sync_class, extra = AdapterSync, {"lora": cfg.lora}
        sync = sync_class(actor.model, actor_layout, mesh.layout, engine,
                          hf_config=AutoConfig.from_pretrained(cfg.model.path), verify=cfg.comm.verify,
                          hf_names=cfg.rollout.engine != "native", dtype=dtype,
                          method=cfg.comm.weight_sync_method, max_bucket_mb=cfg.comm.weight_sync_bucket_mb or None,
                          coalesce=cfg.comm.strategy != "plain", **extra)
        return engine, sync

    def push_initial_weights(self) -> None:
        """Collective, idempotent: an engine with its own weights takes the actor's (`Boundary.first_sync`)."""
        self.boundary.first_sync()

    # -- loop ------------------------------------------------------------------------------------------------
    def run_step(self, step: int) -> StepMetrics:
        """One RL step on this rank (unreduced metrics): the one step driver `fit`, `rlhf profile`/`bench` and
        the benchmarks share, so none can skip the initial weight push or dynamic sampling's extra prompts."""
        self.push_initial_weights()
        return self.driver.run(step)

    def validate(self, step: int) -> dict[str, float]:
        if self.val is None:
            return {}
        native = self.cfg.rollout.native
        chunk = max(1, native.max_batch_size // max(1, self.cfg.sampling.val_n))
        rollout = self.rollout_side
        with rollout.memory.rollout(sync_follows=False):
            result = run_validation(rollout.engine, rollout.layout, self.val, self.scorer,
                                    self.cfg.sampling.val_params(step), chunk, self.pad_token_id,
                                    num_samples=self.cfg.trainer.val_samples, multiturn=rollout.multiturn)
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
                    self._announce(lambda: [finished_notice(self.cfg, self.run_dir.path, start, self.steps_key)])
                    return []
                self._announce(lambda: start_banner(
                    self.cfg, world_size=dist.get_world_size(), backend=str(dist.get_backend()),
                    mesh_rows=self.meshes.summary_rows(), num_train=len(self.loader.prompts.records),
                    num_val=len(self.val.records) if self.val else 0, run_path=self.run_dir.path, start_step=start))
                started = time.perf_counter()
                self._start_exporter()  # before config.yaml: a port taken since preflight leaves it as it was
                self.run_dir.commit_config()  # only now: a failed resume leaves the run's config.yaml as it was
                self.sink = MetricsSink(self.run_dir.path, enabled=self.run_dir.is_rank0, loggers=cfg.loggers,
                                        first_step=start + 1 if start else 0, info=RunInfo(
                                            project=cfg.project_name, config=to_dict(self.cfg),
                                            experiment=cfg.experiment_name or self.run_dir.path.name))
                with watchdog.phase("first weight push"):
                    self.push_initial_weights()
                history = []
                if start == 0 and cfg.val_before_train and self.val is not None:
                    with watchdog.phase("validation before training"):
                        values = {"step": 0, **self.validate(0)}
                    self.sink.write(0, values)
                    history.append(values)
                    log.info("before training: val/score/mean@1 = %.4f", values["val/score/mean@1"])
                bar = progress(range(start + 1, cfg.total_steps + 1), desc=self.step_name,
                               total=cfg.total_steps - start)
                for step in bar:
                    with watchdog.phase(f"{self.step_name}_step {step}"):
                        history.append(self._step(step))
        finally:
            close_engine(self.rollout_side.engine)  # vLLM's teardown needs the process groups still alive
            self.alerts.close()
            if self.exporter is not None:
                self.exporter.close()
        self.sink.close()
        self._write_curve()
        self._announce(lambda: end_summary(self.cfg, run_path=self.run_dir.path, last_step=cfg.total_steps,
                                           elapsed_s=time.perf_counter() - started,
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
        values = self.boundary.reduce(self.run_step(step))
        values.update(self.alerts.observe(step, values, self.last_scored))
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
