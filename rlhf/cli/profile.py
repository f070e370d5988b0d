"""`rlhf profile`: N RL steps of a config with per-phase time, peak memory and collective counters.

Rank 0 prints a table (phase seconds and share of the step, peak memory, collectives per phase), on split
placement how much of each phase overlapped the other side's work (async RL), and writes `profile.json` in the
run folder; `--trace` adds a torch profiler chrome trace per rank. `--ops` profiles the actor update and the
generation phase op by op on rank 0 (`rlhf.profiling.ops`): achieved GFLOP/s from the model shape against the
measured matmul peak, and the top-15 op table grouped as GEMM / attention / elementwise / optimizer / framework.
"""

from __future__ import annotations

import argparse
import json

from rlhf.cli.common import add_config_args, config_from_args, diagnostic_config, run_in_world
from rlhf.errors import ConfigError

_MIB = 2**20


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("profile", help="where one RL step's time, memory and communication go")
    add_config_args(parser)
    parser.add_argument("--steps", type=int, default=3, help="timed steps (default 3)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first (default 1)")
    parser.add_argument("--trace", action="store_true", help="write a torch profiler trace per rank")
    parser.add_argument("--ops", action="store_true",
                        help="op table and achieved GFLOP/s of the actor update and generation (rank 0)")
    return parser


def check_steps(steps: int, warmup: int, trace: bool = False, ops: bool = False) -> None:
    if steps < 1 or warmup < 0:
        raise ConfigError(f"--steps={steps} must be >= 1 and --warmup={warmup} >= 0")
    if trace and ops:
        raise ConfigError("--trace and --ops both run the torch profiler; pass one of them")


def run(args: argparse.Namespace) -> int:
    check_steps(args.steps, args.warmup, args.trace, args.ops)
    cfg = diagnostic_config(config_from_args(args), "profile")  # config errors before torch is imported
    from rlhf.profiling.runner import run_profiled_steps
    from rlhf.orchestration.preflight import preflight

    def body(cfg, run_dir) -> None:
        from rlhf.profiling.ops import PhaseOps

        ops = PhaseOps() if args.ops and run_dir.is_rank0 else None
        profile = run_profiled_steps(cfg, run_dir, steps=args.steps, warmup=args.warmup, counters=True,
                                     trace_dir=run_dir.path if args.trace else None, ops=ops)
        from rlhf.parallel.wire import all_gather_json

        per_rank = all_gather_json({"memory": profile.memory.peak_bytes, "comm": profile.comm.rows(),
                                    "timings": profile.local_timings,
                                    "timeline": profile.timeline.steps, "side": profile.side})
        if run_dir.is_rank0:
            report = build_report(profile.steps, per_rank, args.steps)
            if ops is not None:
                report["ops"] = ops_report(cfg, ops, profile.steps)
            (run_dir.path / "profile.json").write_text(json.dumps(report, indent=1) + "\n")
            print(format_report(report))
            if ops is not None:
                print(format_ops(report["ops"]))
            print(f"wrote {run_dir.path / 'profile.json'}")

    run_in_world(cfg, "profile", body, preflight)
    return 0


def ops_report(cfg, ops, steps: list[dict]) -> dict:
    """Rank 0's op tables of the actor update and generation, with the FLOPs the timed steps' token counts give
    (update: every token of the batch, `actor.epochs` times; generation: the prompts' prefill and each generated
    token over its mean context) and the fp32 matmul peak of this process's threads."""
    import statistics

    from transformers import AutoConfig

    from rlhf.models.spec import ModelSpec
    from rlhf.profiling.ops import decode_flops, matmul_peak_gflops, train_flops

    spec = ModelSpec.from_hf(AutoConfig.from_pretrained(cfg.model.path))
    rollouts = cfg.data.prompts_per_step * cfg.sampling.n
    total = sum(s["perf/total_num_tokens"] for s in steps)
    prompt_mean = statistics.mean(s["prompt_length/mean"] for s in steps)
    response_mean = statistics.mean(s["response_length/mean"] for s in steps)
    flops = {"update_actor": train_flops(spec, int(total * cfg.actor.epochs), round(total / len(steps) / rollouts)),
             "gen": decode_flops(spec, round(rollouts * response_mean * len(steps)), prompt_mean + response_mean / 2)
             + decode_flops(spec, round(rollouts * prompt_mean * len(steps)), prompt_mean / 2)}
    peak = matmul_peak_gflops()
    out = {"peak_gflops": peak, "phases": {}}
    for phase, phase_flops in flops.items():
        table = ops.table(phase)
        if table is not None:
            achieved = phase_flops / table["wall_s"] / 1e9
            out["phases"][phase] = table | {"flops": phase_flops, "achieved_gflops": achieved}
    return out


def format_ops(ops: dict) -> str:
    from rlhf.profiling.ops import format_op_table

    return "\n".join(format_op_table(f"{phase} (rank 0, profiled)", table, table["flops"], ops["peak_gflops"])
                     for phase, table in ops["phases"].items())


def build_report(steps: list[dict], per_rank: list[dict], timed_steps: int) -> dict:
    """Phases (max over ranks per step, median over steps), memory (max over ranks), collectives per step."""
    from rlhf.profiling.overlap import overlap_report
    from rlhf.profiling.runner import phase_summary

    memory: dict[str, int] = {}
    for rank in per_rank:
        for name, value in rank["memory"].items():
            memory[name] = max(memory.get(name, 0), value)
    comm: dict[tuple[str, str], dict] = {}
    for rank in per_rank:
        for row in rank["comm"]:
            entry = comm.setdefault((row["phase"], row["op"]), {"calls": 0, "bytes": 0, "seconds_max_rank": 0.0})
            entry["calls"] += row["calls"] / timed_steps
            entry["bytes"] += row["bytes"] / timed_steps
            entry["seconds_max_rank"] = max(entry["seconds_max_rank"], row["seconds"] / timed_steps)
    return {"timed_steps": timed_steps, "world_size": len(per_rank), **phase_summary(steps),
            "peak_memory_bytes": memory,
            "collectives_per_step": [{"phase": p, "op": o, **v} for (p, o), v in sorted(comm.items())],
            "overlap": overlap_report([rank["timeline"] for rank in per_rank], [rank["side"] for rank in per_rank]),
            "steps": steps, "per_rank_timings": [rank["timings"] for rank in per_rank]}


def format_report(report: dict) -> str:
    lines = [f"{report['timed_steps']} timed steps on {report['world_size']} rank(s): "
             f"step {report['step_s']:.3f} s (median); phases account for {report['coverage']:.1%}",
             f"{'phase':15} {'seconds':>9} {'share':>7} {'peak MiB':>9} {'colls':>6} {'coll MiB':>9} {'coll s':>8}"]
    by_phase: dict[str, list[float]] = {}
    for row in report["collectives_per_step"]:
        agg = by_phase.setdefault(row["phase"], [0, 0, 0.0])
        agg[0] += row["calls"]
        agg[1] += row["bytes"]
        agg[2] += row["seconds_max_rank"]
    for name, seconds in report["phases_s"].items():
        calls, nbytes, comm_s = by_phase.get(name, [0, 0, 0.0])
        lines.append(f"{name:15} {seconds:9.3f} {report['share'][name]:7.1%} "
                     f"{report['peak_memory_bytes'].get(name, 0) / _MIB:9.1f} {calls:6.0f} {nbytes / _MIB:9.2f} "
                     f"{comm_s:8.3f}")
    lines.append(f"{'step':15} {report['step_s']:9.3f} {1:7.1%} {report['peak_memory_bytes'].get('step', 0) / _MIB:9.1f}")
    lines.append("collectives per step (sum over ranks; time = slowest rank):")
    for row in report["collectives_per_step"]:
        lines.append(f"  {row['phase']:15} {row['op']:24} calls {row['calls']:7.1f}  MiB {row['bytes'] / _MIB:9.3f}  "
                     f"s {row['seconds_max_rank']:.4f}")
    return "\n".join(lines + format_overlap(report["overlap"], report["step_s"]))


def format_overlap(overlap: dict | None, step_s: float) -> list[str]:
    """Per side and phase: seconds, and how much of it ran while the other side worked (split placement)."""
    if overlap is None:
        return []
    lines = [f"overlap of rollout and training ranks: both busy {overlap['both_busy_s']:.3f} s of the "
             f"{step_s:.3f} s step ({overlap['both_busy_s'] / step_s:.1%})",
             f"  {'side':8} {'phase':15} {'seconds':>9} {'overlapped':>11} {'share':>7}"]
    for row in overlap["phases"]:
        share = row["overlapped_s"] / row["seconds"] if row["seconds"] else 0.0
        lines.append(f"  {row['side']:8} {row['phase']:15} {row['seconds']:9.3f} {row['overlapped_s']:11.3f} "
                     f"{share:7.1%}")
    return lines
