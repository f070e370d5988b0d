"""Resume safety on 2 ranks, in one launched world: metrics and TensorBoard never repeat a step after resuming
from an older checkpoint; a corrupt weight shard is skipped by `resume: auto` (saying so); a failed resume leaves
config.yaml as it was; diverged DP replicas are a named error; a pickle planted in a checkpoint never runs,
neither on resume nor on export."""

import json
import pickle
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from fixtures import make_tiny_setup, run_trainer  # noqa: E402

sys.path.insert(0, str(Path(__file__).parents[1] / "checkpoint"))
from test_manager import WritesMarker, _flip, resign  # noqa: E402

from rlhf.testing.distributed import run_distributed  # noqa: E402

# The distributed optimizer: each DP rank's file holds its own Adam shard, the model is written once.
SETTINGS = ["run.name=r", "checkpoint.every=1", "checkpoint.keep_last=3", "trainer.tensorboard=true",
            "actor.optim.use_distributed_optimizer=true"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    paths = make_tiny_setup(root, num_val=4)
    from rlhf.data.char_tokenizer import build_char_tokenizer
    from rlhf.models.init import InitModelConfig, init_hf_model

    paths["other_model"] = str(init_hf_model(InitModelConfig(hidden_size=48, num_layers=2, num_heads=4,
                                                             num_kv_heads=2, intermediate_size=64,
                                                             max_position_embeddings=64),
                                             build_char_tokenizer(), root / "other_model"))
    return paths


def _error_of(call) -> str:
    from rlhf.errors import CheckpointError

    try:
        call()
    except CheckpointError as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def _on_rank0(edit) -> None:
    import torch.distributed as dist

    if dist.get_rank() == 0:
        edit()
    dist.barrier()


def _tensorboard_steps(run: Path) -> list[int]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    return [event.step for event in events.Scalars("actor/pg_loss")]


def _replica_divergence() -> str | None:
    """The replica check on a model whose copy on rank 1 holds one shifted weight."""
    import torch
    import torch.distributed as dist

    from rlhf.checkpoint.verify import replica_problem

    model = torch.nn.Linear(3, 2)
    with torch.no_grad():
        model.weight.fill_(1.0 + dist.get_rank())
        model.bias.zero_()
    return replica_problem("actor", model, dist.group.WORLD)


def _export_cli(run: Path, out_dir: str) -> tuple[int, str]:
    """`rlhf export --run-dir <run> --checkpoint step_4`, in this world: (exit code, stderr)."""
    import contextlib
    import io

    from rlhf.cli.main import main

    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        code = main(["export", "--run-dir", str(run), "--checkpoint", "step_4", "--out", out_dir])
    return code, stderr.getvalue()


def _integrity_runs(paths: dict, root: str, marker: str) -> dict:
    from rlhf.metrics import read_jsonl

    run, out = Path(root) / "r", {}
    ckpt = run / "checkpoints"
    reward = Path(root) / "length_reward.py"  # a dense signal, so every update moves the weights
    reward.write_text("def score(data_source, solution, ground_truth, extra_info):\n"
                      "    return float(len(solution) % 2)\n")
    common = SETTINGS + ["reward.by_source={}", f"reward.function={reward}:score"]
    run_trainer(paths, root, common + ["trainer.total_steps=3"])
    again = run_trainer(paths, root, common + ["trainer.total_steps=3", f"checkpoint.resume={ckpt}/step_1"])
    out["steps_after_resume"] = [row["step"] for row in read_jsonl(run / "metrics.jsonl")]
    out["tensorboard_after_resume"] = _tensorboard_steps(run) if (run / "tensorboard").exists() else None
    _on_rank0(lambda: _flip(ckpt / "step_3" / "actor_model_r1.safetensors"))
    fallback = run_trainer(paths, root, common + ["trainer.total_steps=4"])
    out["fallback_steps"] = [row["step"] for row in fallback]
    out["fallback_equals_uninterrupted"] = _comparable(fallback[0]) == _comparable(again[-1])
    out["grad_norm"] = fallback[0]["actor/grad_norm"]
    out["steps_after_fallback"] = [row["step"] for row in read_jsonl(run / "metrics.jsonl")]
    out["tensorboard_after_fallback"] = _tensorboard_steps(run) if (run / "tensorboard").exists() else None
    out["log"] = (run / "rank0.log").read_text()
    config_before = (run / "config.yaml").read_bytes()
    out["model_error"] = _error_of(lambda: run_trainer(paths, root, common + ["trainer.total_steps=5",
                                                                              f"model.path={paths['other_model']}"]))
    out["config_unchanged"] = (run / "config.yaml").read_bytes() == config_before
    out["manifest"] = json.loads((ckpt / "step_4" / "manifest.json").read_text())["files"]
    out["divergence_error"] = _replica_divergence()

    def plant():
        for name in ("rank0.safetensors", "actor_model_r0.safetensors"):
            (ckpt / "step_4" / name).write_bytes(pickle.dumps(WritesMarker(marker)))
            resign(ckpt / "step_4", name)

    _on_rank0(plant)
    out["export"] = _export_cli(run, f"{root}/exported")
    out["resume_error"] = _error_of(lambda: run_trainer(paths, root, common + [
        "trainer.total_steps=5", f"checkpoint.resume={ckpt}/step_4"]))
    return out


def _comparable(row):
    return {k: v for k, v in row.items() if not k.startswith(("timing_s/", "perf/throughput", "memory/", "val/"))}


def test_resume_bookkeeping_corruption_divergence_and_planted_pickle(tiny, tmp_path):
    marker = tmp_path / "marker"
    results = run_distributed(_integrity_runs, 2, tiny, str(tmp_path), str(marker), timeout_s=900)
    out = results[0]
    ckpt = tmp_path / "r" / "checkpoints"
    # Resuming from step 1 of a 3-step run rewrites the metrics to step 1 first: no step appears twice.
    assert out["steps_after_resume"] == [0, 1, 2, 3] and out["tensorboard_after_resume"] == [1, 2, 3]
    # A flipped shard of step_3 is skipped with one line naming it; step_2 resumes exactly.
    skip = (f"checkpoint: skipping step_3: {ckpt}/step_3/actor_model_r1.safetensors does not match its sha256 in the "
            "manifest (corrupted)")
    assert skip in out["log"] and f"resumed from {ckpt}/step_2 (step 2)" in out["log"]
    assert out["fallback_steps"] == [3, 4] and out["fallback_equals_uninterrupted"] and out["grad_norm"] > 0
    assert out["steps_after_fallback"] == [0, 1, 2, 3, 4] and out["tensorboard_after_fallback"] == [1, 2, 3, 4]
    # Another model: refused before config.yaml is touched (export would otherwise build the wrong model).
    assert out["model_error"].startswith(f"CheckpointError: checkpoint {ckpt}/step_4 has models=")
    assert "'hidden_size': 32" in out["model_error"] and "'hidden_size': 48" in out["model_error"]
    assert out["config_unchanged"]
    # Written once across DP: every rank keeps a share of the full weights and Adam moments (no copy per replica).
    kinds = ("model", "exp_avg", "exp_avg_sq")
    assert sorted(out["manifest"]) == sorted(["rank0.safetensors", "rank1.safetensors"] +
                                             [f"actor_{kind}_r{rank}.safetensors" for kind in kinds for rank in (0, 1)])
    # One weight of rank 1's copy shifted: the replica check names the role and ranks.
    assert out["divergence_error"] == ("the actor's DP replicas differ after loading the checkpoint: rank 0 and "
                                       "rank 1 hold different weight (a corrupted or mixed checkpoint)")
    # A pickle planted as rank0's state file and weight shard (checksums re-signed) is refused on export and on
    # resume; it never ran.
    refused = f"{ckpt}/step_4/rank0.safetensors is not an rlhf state file"
    assert out["resume_error"].startswith(f"CorruptCheckpointError: {refused}")
    unreadable = f"{ckpt}/step_4/actor_model_r0.safetensors is not a readable safetensors file"
    for code, stderr in (r["export"] for r in results):  # `rlhf export --run`: one line per rank, exit 3 (checkpoint)
        errors = [line for line in stderr.splitlines() if line.startswith("rlhf export: error: ")]
        assert code == 3 and len(errors) == 1 and errors[0].startswith(f"rlhf export: error: {unreadable}"), stderr
    assert not (tmp_path / "exported").exists()
    assert not marker.exists()
    pickle.loads((ckpt / "step_4" / "rank0.safetensors").read_bytes())  # the control: the payload does run code
    assert marker.exists()
