"""Metric writers behind `trainer.logger`: jsonl (metrics.jsonl + samples.jsonl), TensorBoard (scalars + text),
wandb and mlflow (optional installs, offline-capable: WANDB_MODE=offline, an mlflow file store in the run folder).

Every backend takes `write(step, values)`, `write_samples(step, samples)` and `close()`; rank 0 alone builds them
(`MetricsSink`). A resumed run continues the same wandb / mlflow run (its id is kept in the run folder).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlhf.errors import ConfigError

OPTIONAL = {"wandb": "wandb", "mlflow": "mlflow"}  # logger -> the module it needs


def check_loggers(names: Sequence[str]) -> None:
    """An optional logger that is not installed is a one-line error (before any run folder exists)."""
    for name in names:
        module = OPTIONAL.get(name)
        if module is not None and importlib.util.find_spec(module) is None:
            raise ConfigError(f"trainer.logger lists {name}, but {module} is not installed; pip install {module} "
                              f"(or drop {name} from trainer.logger)")


@dataclass(kw_only=True)
class RunInfo:
    """What the hosted trackers name the run by and record with it."""

    project: str
    experiment: str
    config: dict[str, Any]


def _finite(values: dict[str, float]) -> dict[str, Any]:
    return {k: (v if math.isfinite(v) else str(v)) for k, v in sorted(values.items())}


def drop_rows_from(path: Path, first_step: int) -> None:
    """Rewrite `path` (temp file + rename) without the rows whose step is `first_step` or later (or torn)."""
    kept = []
    with open(path) as f:
        for line in f:
            try:
                if json.loads(line)["step"] < first_step:
                    kept.append(line if line.endswith("\n") else line + "\n")
            except (json.JSONDecodeError, KeyError, TypeError):
                continue  # a line torn by a crash mid-write
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept))
    os.replace(tmp, path)


class JsonlLogger:
    """`metrics.jsonl`: one object per step; `samples.jsonl`: one object per logged validation generation."""

    def __init__(self, run_path: Path, first_step: int | None) -> None:
        self._files = {}
        for name in ("metrics", "samples"):
            path = run_path / f"{name}.jsonl"
            if first_step is not None and path.is_file():
                drop_rows_from(path, first_step)
            self._files[name] = open(path, "a")

    def _append(self, name: str, row: dict) -> None:
        self._files[name].write(json.dumps(row) + "\n")
        self._files[name].flush()

    def write(self, step: int, values: dict[str, float]) -> None:
        self._append("metrics", {"step": step, **_finite(values)})

    def write_samples(self, step: int, samples: list[dict]) -> None:
        for sample in samples:
            self._append("samples", {"step": step, **sample})

    def close(self) -> None:
        for f in self._files.values():
            f.close()


def samples_markdown(samples: list[dict]) -> str:
    """A markdown table of generations (TensorBoard renders text as markdown)."""
    def cell(text: Any) -> str:
        return str(text).replace("|", "\\|").replace("\n", "<br>")

    lines = ["| data_source | prompt | response | ground_truth | score |", "|---|---|---|---|---|"]
    lines += [f"| {cell(s['data_source'])} | {cell(s['prompt'])} | {cell(s['response'])} | "
              f"{cell(s['ground_truth'])} | {s['score']:.4g} |" for s in samples]
    return "\n".join(lines)


class TensorBoardLogger:
    def __init__(self, run_path: Path, first_step: int | None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._tb = SummaryWriter(log_dir=str(run_path / "tensorboard"), purge_step=first_step)

    def write(self, step: int, values: dict[str, float]) -> None:
        for name, value in values.items():
            self._tb.add_scalar(name, value, step)
        self._tb.flush()

    def write_samples(self, step: int, samples: list[dict]) -> None:
        self._tb.add_text("val/generations", samples_markdown(samples), step)
        self._tb.flush()

    def close(self) -> None:
        self._tb.close()


def _kept_id(run_path: Path, name: str, make: str) -> str:
    """The tracker's run id for this run folder: made once, then read back on resume."""
    path = run_path / f"{name}_run_id"
    if path.is_file():
        return path.read_text().strip()
    path.write_text(make + "\n")
    return make


class WandbLogger:
    def __init__(self, run_path: Path, info: RunInfo) -> None:
        import wandb

        digest = hashlib.sha1(str(run_path.resolve()).encode()).hexdigest()[:16]
        self._run = wandb.init(project=info.project, name=info.experiment, config=info.config,
                               dir=str(run_path), id=_kept_id(run_path, "wandb", digest), resume="allow")

    def write(self, step: int, values: dict[str, float]) -> None:
        self._run.log(dict(values), step=step)

    def write_samples(self, step: int, samples: list[dict]) -> None:
        import wandb

        columns = ["data_source", "prompt", "response", "ground_truth", "score"]
        table = wandb.Table(columns=columns, data=[[s[c] for c in columns] for s in samples])
        self._run.log({"val/generations": table}, step=step)

    def close(self) -> None:
        self._run.finish()


def mlflow_name(name: str) -> str:
    """mlflow allows letters, digits, _ - . space : / in metric names: `mean@4` becomes `mean_at_4`."""
    return re.sub(r"[^\w\-. :/]", "_", name.replace("@", "_at_"))


class MlflowLogger:
    """Tracks to $MLFLOW_TRACKING_URI, or to a file store in `<run>/mlruns` when it is unset (mlflow 3 keeps
    file stores behind MLFLOW_ALLOW_FILE_STORE, set here for that case)."""

    def __init__(self, run_path: Path, info: RunInfo) -> None:
        import mlflow

        self._mlflow = mlflow
        if not os.environ.get("MLFLOW_TRACKING_URI"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            mlflow.set_tracking_uri((run_path / "mlruns").resolve().as_uri())
        mlflow.set_experiment(info.project)
        kept = run_path / "mlflow_run_id"
        run_id = kept.read_text().strip() if kept.is_file() else None
        self._run = mlflow.start_run(run_id=run_id, run_name=None if run_id else info.experiment)
        if run_id is None:
            kept.write_text(self._run.info.run_id + "\n")

    def write(self, step: int, values: dict[str, float]) -> None:
        self._mlflow.log_metrics({mlflow_name(k): v for k, v in values.items() if math.isfinite(v)}, step=step)

    def write_samples(self, step: int, samples: list[dict]) -> None:
        self._mlflow.log_text("\n".join(json.dumps(s) for s in samples), f"samples/step_{step:06d}.jsonl")

    def close(self) -> None:
        self._mlflow.end_run()


def build_loggers(names: Sequence[str], run_path: Path, first_step: int | None, info: RunInfo | None) -> list:
    """The backends for `names` ("console" is the rank-0 log handler, not a metric writer)."""
    check_loggers(names)
    backends = []
    for name in names:
        if name == "jsonl":
            backends.append(JsonlLogger(run_path, first_step))
        elif name == "tensorboard":
            backends.append(TensorBoardLogger(run_path, first_step))
        elif name in ("wandb", "mlflow"):
            assert info is not None, f"{name} needs the run's project/experiment names"
            backends.append((WandbLogger if name == "wandb" else MlflowLogger)(run_path, info))
    return backends
