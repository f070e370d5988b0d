"""The `trainer.logger` backends: jsonl metrics and samples (resume drops later rows), TensorBoard scalars and
generation text, the console switch, one-line errors for unknown or absent loggers, and wandb / mlflow in offline
mode where they are installed."""

import importlib.util
import json

import pytest

from rlhf.errors import ConfigError
from rlhf.loggers import RunInfo, check_loggers, mlflow_name
from rlhf.metrics import MetricsSink, read_jsonl
from rlhf.run_dir import RunConfig, close_run, get_logger, setup_run
from rlhf.orchestration.config import TrainerConfig

SAMPLES = [{"index": 0, "data_source": "gsm8k", "prompt": "1+1=", "response": "2 | ok", "ground_truth": "2",
            "score": 1.0},
           {"index": 1, "data_source": "math", "prompt": "2+2=", "response": "5\nno", "ground_truth": "4",
            "score": 0.0}]
INFO = RunInfo(project="proj", experiment="exp", config={"trainer": {"total_steps": 2}})


def _write_two_steps(sink):
    for step in (0, 1, 2):
        sink.write(step, {"val/score/mean@1": 0.5 * step, "val/gsm8k/score/mean@4": float(step)})
        sink.write_samples(step, SAMPLES)
    sink.close()


def test_jsonl_and_tensorboard_keep_metrics_and_generations(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _write_two_steps(MetricsSink(tmp_path, enabled=True, loggers=["console", "jsonl", "tensorboard"], info=INFO))
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [row["step"] for row in rows] == [0, 1, 2] and rows[2]["val/gsm8k/score/mean@4"] == 2.0
    samples = read_jsonl(tmp_path / "samples.jsonl")
    assert samples == [{"step": step, **sample} for step in (0, 1, 2) for sample in SAMPLES]
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0}).Reload()
    assert [e.value for e in events.Scalars("val/score/mean@1")] == [0.0, 0.5, 1.0]
    text = events.Tensors("val/generations/text_summary")[-1].tensor_proto.string_val[0].decode()
    assert "| gsm8k | 1+1= | 2 \\| ok | 2 | 1 |" in text and "| math | 2+2= | 5<br>no | 4 | 0 |" in text
    # A run resuming at step 2 drops that step's earlier rows from both files.
    MetricsSink(tmp_path, enabled=True, loggers=["jsonl"], first_step=2).close()
    assert [row["step"] for row in read_jsonl(tmp_path / "metrics.jsonl")] == [0, 1]
    assert [row["step"] for row in read_jsonl(tmp_path / "samples.jsonl")] == [0, 0, 1, 1]
    # Not rank 0: nothing is written.
    MetricsSink(tmp_path / "other", enabled=False, loggers=["jsonl"]).write(1, {"a": 1.0})
    assert not (tmp_path / "other").exists()


def test_without_console_rank0_prints_only_warnings(tmp_path, capsys):
    run_dir = setup_run(RunConfig(output_dir=str(tmp_path), name="quiet"))
    try:
        MetricsSink(run_dir.path, enabled=True, loggers=["jsonl"]).close()
        get_logger("trainer").info("step 1: reward=0.5")
        get_logger("trainer").warning("a warning")
    finally:
        close_run()
    assert capsys.readouterr().out == "a warning\n"
    assert "step 1: reward=0.5" in (run_dir.path / "rank0.log").read_text()


def test_unknown_and_absent_loggers_are_one_line_errors(monkeypatch):
    with pytest.raises(ConfigError, match=r"^trainer.logger=\['jsonl', 'neptune'\] has unknown logger\(s\) neptune; "
                                          r"choose from console, jsonl, tensorboard, wandb, mlflow$"):
        TrainerConfig(logger=["jsonl", "neptune"])
    assert TrainerConfig(tensorboard=False).loggers == ["console", "jsonl"]
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name in ("wandb", "mlflow") else real(name))
    with pytest.raises(ConfigError, match=r"^trainer.logger lists wandb, but wandb is not installed; pip install "
                                          r"wandb \(or drop wandb from trainer.logger\)$"):
        check_loggers(["console", "wandb"])
    with pytest.raises(ConfigError, match="pip install mlflow"):
        check_loggers(["mlflow"])
    check_loggers(["console", "jsonl", "tensorboard"])


@pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason="wandb is not installed (optional)")
def test_wandb_offline_run_records_metrics_and_resumes(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    _write_two_steps(MetricsSink(tmp_path, enabled=True, loggers=["wandb"], info=INFO))
    run_id = (tmp_path / "wandb_run_id").read_text().strip()
    runs = list((tmp_path / "wandb").glob(f"offline-run-*-{run_id}"))
    assert len(runs) == 1 and (runs[0] / f"run-{run_id}.wandb").stat().st_size > 0
    MetricsSink(tmp_path, enabled=True, loggers=["wandb"], info=INFO, first_step=3).close()
    assert (tmp_path / "wandb_run_id").read_text().strip() == run_id, "a resumed run keeps its wandb id"


@pytest.mark.skipif(importlib.util.find_spec("mlflow") is None, reason="mlflow is not installed (optional)")
def test_mlflow_file_store_records_metrics_samples_and_resumes(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)  # the logger sets it for its own file store
    _write_two_steps(MetricsSink(tmp_path, enabled=True, loggers=["mlflow"], info=INFO))
    MetricsSink(tmp_path, enabled=True, loggers=["mlflow"], info=INFO, first_step=3).close()
    import mlflow

    client = mlflow.tracking.MlflowClient((tmp_path / "mlruns").resolve().as_uri())
    run = client.get_run((tmp_path / "mlflow_run_id").read_text().strip())
    assert run.info.run_name == "exp" and client.get_experiment(run.info.experiment_id).name == "proj"
    history = client.get_metric_history(run.info.run_id, mlflow_name("val/gsm8k/score/mean@4"))
    assert [(m.step, m.value) for m in history] == [(0, 0.0), (1, 1.0), (2, 2.0)]
    assert mlflow_name("val/gsm8k/score/mean@4") == "val/gsm8k/score/mean_at_4"
    artifact = client.download_artifacts(run.info.run_id, "samples/step_000002.jsonl", str(tmp_path / "dl"))
    assert [json.loads(line) for line in open(artifact)] == SAMPLES
    assert len(client.search_runs([run.info.experiment_id])) == 1, "the resumed sink reopened the same run"
