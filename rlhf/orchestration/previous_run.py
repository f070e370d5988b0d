"""What a relaunch finds in its run folder, read before torch is imported: finished, another experiment, or a run
to resume.

`rlhf train` with `checkpoint.resume: auto` and a named run (`run.name`) looks at `<output_dir>/<run.name>/`:
- a newest checkpoint at or past `trainer.total_steps`: the run is finished; say so and stop (no world is built);
- a folder whose `config.yaml` names other models, training data or advantage estimator: another experiment
  reuses the name (a recipe's fixed `run.name`); refuse, naming what differs, rather than resume into it;
- otherwise resume from the newest checkpoint (layouts, total_steps and the rest may change).
An explicit `checkpoint.resume=<folder>` is asked for and skips the experiment check; `none` starts afresh.
The manifest is only peeked at here (published, files present at their sizes); the resume verifies it in full.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

from rlhf.errors import ConfigError
from rlhf.orchestration.schema import RlhfConfig

STEP_DIR = re.compile(r"^step_(\d+)$")  # the checkpoint layout of rlhf.checkpoint (format rlhf-checkpoint/3)
# what makes a run the same experiment: its models, its training data and its advantage estimator
IDENTITY_KEYS = ("model.path", "model.critic_path", "reward.model_path", "data.train_files", "algo.advantage.kind")
ARCHITECTURE_KEYS = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "vocab_size", "tie_word_embeddings")


def architecture(path: str) -> dict:
    """What must not change across a resume: the HF config fields that define the model's parameters."""
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(path)
    return {key: getattr(hf_config, key, None) for key in ARCHITECTURE_KEYS}


def run_path(cfg: RlhfConfig) -> Path | None:
    """The folder a relaunch writes into, when the run is named (an unnamed run gets a fresh, timed folder)."""
    return Path(cfg.run.output_dir) / cfg.run.name if cfg.run.name else None


def _published_manifest(step_dir: Path) -> dict | None:
    """A checkpoint's manifest when it is published and every file it lists is present at its size."""
    try:
        manifest = json.loads((step_dir / "manifest.json").read_text())
        files = manifest["files"]
        if all((step_dir / name).is_file() and (step_dir / name).stat().st_size == entry["size"]
               for name, entry in files.items()):
            return manifest
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    return None


def newest_checkpoint(cfg: RlhfConfig) -> tuple[Path, dict] | None:
    """The checkpoint the resume would load first (`auto`: the newest published one) and its manifest."""
    if cfg.checkpoint.resume == "none":
        return None
    if cfg.checkpoint.resume != "auto":
        folder = Path(cfg.checkpoint.resume)
        manifest = _published_manifest(folder)
        return None if manifest is None else (folder, manifest)
    root = run_path(cfg) / "checkpoints" if run_path(cfg) else None
    if root is None or not root.is_dir():
        return None
    steps = sorted((p for p in root.iterdir() if p.is_dir() and STEP_DIR.match(p.name)),
                   key=lambda p: -int(STEP_DIR.match(p.name).group(1)))
    for folder in steps:
        manifest = _published_manifest(folder)
        if manifest is not None:
            return folder, manifest
    return None


def _value(tree: dict, key: str) -> Any:
    for part in key.split("."):
        tree = tree.get(part, {}) if isinstance(tree, dict) else {}
    return tree if tree != {} else None


def check_same_experiment(cfg: RlhfConfig, saved: dict) -> None:
    """`resume: auto` continues only the experiment the folder holds (its config.yaml's identity keys)."""
    from rlhf.config import to_dict

    current = to_dict(cfg)
    differ = [f"{key}={_value(saved, key)!r} there, {_value(current, key)!r} now" for key in IDENTITY_KEYS
              if _value(saved, key) != _value(current, key)]
    if differ:
        raise ConfigError(
            f"{run_path(cfg)} holds another experiment ({'; '.join(differ)}): run.name={cfg.run.name} is reused "
            f"(recipes fix run.name); set a new run.name for this run, or checkpoint.resume=<a checkpoint folder> "
            "to resume from one anyway")


def check_same_models(cfg: RlhfConfig, folder: Path, manifest: dict) -> None:
    """The checkpoint's trained models have the architectures of this config's (else the resume cannot load)."""
    saved = manifest.get("models") or {}
    paths = {"actor": ("model.path", cfg.model.path),
             "critic": ("model.critic_path", cfg.model.critic_path or cfg.model.path)}
    for role, arch in saved.items():
        if role not in paths:
            continue
        key, path = paths[role]
        now = architecture(path)
        differ = [f"{field}={arch.get(field)!r} there, {now[field]!r} in {key}={path!r}" for field in now
                  if arch.get(field) != now[field]]
        if differ:
            cause = (f"run.name={cfg.run.name} is likely reused from another experiment: set a new run.name, or "
                     "checkpoint.resume=none to start afresh" if cfg.checkpoint.resume == "auto"
                     else "point checkpoint.resume at a checkpoint of this model")
            raise ConfigError(f"checkpoint {folder} holds another {role} model ({'; '.join(differ)}); {cause}")


def finished_notice(cfg: RlhfConfig, run_folder: Path, start_step: int,
                    steps_key: str = "trainer.total_steps") -> str:
    """A relaunched run that has nothing left to do says so (it used to print an empty progress bar);
    `steps_key` names the setting its step count came from (`rlhf sft`: sft.steps)."""
    return (f"{run_folder} already finished: its checkpoint is at step {start_step} and {steps_key}="
            f"{cfg.trainer.total_steps}; raise {steps_key} to train on, or start afresh with another "
            "run.name (or checkpoint.resume=none)")


def previous_run_notice(cfg: RlhfConfig) -> str | None:
    """The finished notice when there is nothing left to train; ConfigError when the folder holds another
    experiment or model; None to go on (fresh or resuming)."""
    found = newest_checkpoint(cfg)
    if found is None:
        return None
    folder, manifest = found
    saved_config = run_path(cfg) / "config.yaml" if run_path(cfg) else None
    if cfg.checkpoint.resume == "auto" and saved_config is not None and saved_config.is_file():
        try:
            saved = yaml.safe_load(saved_config.read_text())
        except (OSError, yaml.YAMLError):
            saved = None  # unreadable: the resume's own checks decide
        if isinstance(saved, dict):
            check_same_experiment(cfg, saved)
    step = int(manifest.get("step", 0))
    if step >= cfg.trainer.total_steps:
        return finished_notice(cfg, run_path(cfg) or folder.parent.parent, step)
    check_same_models(cfg, folder, manifest)
    return None
