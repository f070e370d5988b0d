"""What rank 0 prints around a training run: the start banner, the end summary, and the finished-run notice.

The lines are plain text for `log.info` (so they land in rank0.log too); nothing here is collective.
"""

from __future__ import annotations

import math
from pathlib import Path

from transformers import AutoConfig

from rlhf.orchestration.previous_run import finished_notice  # noqa: F401  (the loop prints it)
from rlhf.orchestration.schema import RlhfConfig
from rlhf.models.param_specs import param_specs
from rlhf.parallel.layout import ParallelLayout

VALUE_HEAD_ROLES = ("critic", "reward")


def parameter_count(model_path: str, value_head: bool = False) -> int:
    """Parameters of the whole model in an HF folder (from its config; nothing is loaded)."""
    hf_config = AutoConfig.from_pretrained(model_path)
    specs = param_specs(hf_config, ParallelLayout(), value_head=value_head)
    return sum(math.prod(spec.full_shape) for spec in specs if not spec.tied_copy)


def _role_models(cfg: RlhfConfig, role: str) -> list[str]:
    """The HF folders of a role's model(s): one, or every distillation teacher."""
    if role == "critic":
        return [cfg.model.critic_path or cfg.model.path]
    if role == "teacher":
        return cfg.algo.distill.teacher_paths
    return [cfg.reward.model_path if role == "reward" else cfg.model.path]


def _millions(count: int) -> str:
    return f"{count / 1e6:.1f}M" if count >= 1e5 else f"{count / 1e6:.3f}M"


def start_banner(cfg: RlhfConfig, *, world_size: int, backend: str, mesh_rows: list[dict], num_train: int,
                 num_val: int, run_path: Path, start_step: int) -> list[str]:
    """World, each role's layout and size, the data, and where the run writes."""
    lines = [f"rlhf train: {world_size} ranks ({backend}), {cfg.mesh.placement} placement, run folder {run_path}"]
    counts: dict[tuple[str, bool], int] = {}
    for row in mesh_rows:
        role = row["role"]
        context = f" cp{row['cp']}" if row.get("cp", 1) > 1 else ""
        layout = f"tp{row['tp']}{context} pp{row['pp']} dp{row['dp']}  ranks {row['ranks']}"
        if role == "rollout":
            lines.append(f"  {role:8} {layout}  {cfg.rollout.engine} engine")
            continue
        for path in _role_models(cfg, role):
            key = (path, role in VALUE_HEAD_ROLES)
            counts.setdefault(key, parameter_count(*key))
            lines.append(f"  {role:8} {layout}  {_millions(counts[key])} params  {key[0]}")
    rollouts = cfg.data.prompts_per_step * cfg.sampling.n
    lines.append(f"data: {num_train} training prompts, {num_val} validation prompts; a step samples "
                 f"{cfg.data.prompts_per_step} prompts x {cfg.sampling.n} = {rollouts} responses")
    resumed = f" (resuming after step {start_step})" if start_step else ""
    lines.append(f"steps {start_step + 1}..{cfg.trainer.total_steps}{resumed}")
    return lines


def end_summary(cfg: RlhfConfig, *, run_path: Path, last_step: int, elapsed_s: float,
                checkpoint: Path | None) -> list[str]:
    """Where the results are and the command that comes next (the HF export)."""
    lines = [f"done: step {last_step} of {cfg.trainer.total_steps} in {elapsed_s:.1f} s; metrics in "
             f"{run_path / 'metrics.jsonl'}, logs in {run_path}/rank<k>.log"]
    if checkpoint is None:
        lines.append("no checkpoint was saved (checkpoint.every=0 and checkpoint.save_at_end=false)")
        return lines
    lines.append(f"checkpoint: {checkpoint}")
    lines.append(f"next, the actor as an HF folder (one process, whatever the world size): rlhf export --run-dir "
                 f"{run_path} --out {run_path / 'hf'}")
    return lines
