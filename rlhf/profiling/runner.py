"""Run N timed RL steps of a config (after warm-up steps) and summarise where the step time goes."""

from __future__ import annotations

import statistics
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from rlhf.metrics import TIMER_OBSERVERS
from rlhf.orchestration.schema import RlhfConfig
from rlhf.profiling.comm import CollectiveCounter
from rlhf.profiling.overlap import PhaseTimeline, side_of
from rlhf.profiling.phases import PhaseMemory
from rlhf.run_dir import RunDir

# Phases of an RL step (`orchestration.step`), in order; `step` is their enclosing wall time.
PHASES = ("gen", "gather", "reward", "old_log_prob", "ref", "values", "adv", "update_actor", "update_critic",
          "update_weights")
TRAIN_PHASES = ("reward", "old_log_prob", "ref", "values", "update_actor", "update_critic")


class StepProfile:
    """What the timed steps recorded: reduced step metrics, this rank's own timings and phase intervals (with
    its side: rollout, train or both), phase memory, collectives."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []
        self.local_timings: list[dict[str, float]] = []
        self.memory = PhaseMemory()
        self.comm = CollectiveCounter(self.memory.current_phase)
        self.timeline = PhaseTimeline()
        self.side = "both"


def run_profiled_steps(cfg: RlhfConfig, run_dir: RunDir, *, steps: int, warmup: int, counters: bool,
                       trace_dir: Path | None = None, ops: Any = None) -> StepProfile:
    """Build the trainer, run `warmup` untimed and `steps` timed RL steps; collectives (world-wide). `ops`, a
    `rlhf.profiling.ops.PhaseOps`, profiles its phases' ops during the timed steps."""
    from rlhf.orchestration.loop import Trainer

    trainer = Trainer(cfg, run_dir)
    trainer.push_initial_weights()  # before the timed steps: an engine with its own weights starts from the actor's
    profile = StepProfile()
    profile.side = side_of(trainer.meshes["rollout"].is_member,
                           any(mesh.is_member for role, mesh in trainer.meshes.meshes.items() if role != "rollout"))
    for index in range(1, warmup + 1):
        trainer.boundary.reduce(trainer.run_step(index))
    with ExitStack() as stack:
        if counters:
            stack.enter_context(profile.memory.active())
            stack.enter_context(profile.comm.active())
            TIMER_OBSERVERS.append(profile.timeline)
            stack.callback(TIMER_OBSERVERS.remove, profile.timeline)
        if ops is not None:
            TIMER_OBSERVERS.append(ops)
            stack.callback(TIMER_OBSERVERS.remove, ops)
        tracer = stack.enter_context(torch.profiler.profile(
            activities=list(torch.profiler.supported_activities()))) if trace_dir else None
        for index in range(warmup + 1, warmup + steps + 1):
            metrics = trainer.run_step(index)
            profile.steps.append(trainer.boundary.reduce(metrics))
            profile.local_timings.append({k: v for k, v in metrics.local().items() if k.startswith("timing_s/")})
    if tracer is not None:
        trace_dir.mkdir(parents=True, exist_ok=True)
        tracer.export_chrome_trace(str(trace_dir / f"trace_rank{dist.get_rank()}.json"))
    return profile


def phase_summary(steps: list[dict[str, float]]) -> dict:
    """Median seconds per phase, each phase's share of the step, and the share all phases account for."""
    step_s = statistics.median(s["timing_s/step"] for s in steps)
    phases = {name: statistics.median(s.get(f"timing_s/{name}", 0.0) for s in steps) for name in PHASES
              if any(f"timing_s/{name}" in s for s in steps)}
    covered = statistics.median(sum(s.get(f"timing_s/{n}", 0.0) for n in PHASES) / s["timing_s/step"]
                                for s in steps)
    return {"step_s": step_s, "phases_s": phases, "share": {n: t / step_s for n, t in phases.items()},
            "coverage": covered}


def throughput(steps: list[dict[str, float]], rollouts_per_step: int, world_size: int) -> dict:
    """Rollout tokens/s (generated tokens / gen time) vs training tokens/s (all tokens / train phases' time)."""
    generated = [s["response_length/mean"] * rollouts_per_step for s in steps]
    total = [s["perf/total_num_tokens"] for s in steps]
    gen_s = [s["timing_s/gen"] for s in steps]
    train_s = [sum(s.get(f"timing_s/{n}", 0.0) for n in TRAIN_PHASES) for s in steps]
    rollout_tok_s = statistics.median(g / t for g, t in zip(generated, gen_s))
    train_tok_s = statistics.median(g / t for g, t in zip(total, train_s))
    return {"rollout_tok_s": rollout_tok_s, "train_tok_s": train_tok_s,
            "gen_s": statistics.median(gen_s), "train_s": statistics.median(train_s),
            "gen_over_train_time": statistics.median(g / t for g, t in zip(gen_s, train_s)),
            "generated_tokens_per_step": statistics.median(generated),
            "total_tokens_per_step": statistics.median(total), "world_size": world_size}
