"""Alerts and the Prometheus endpoint in a real 2-rank GRPO run: a crafted NaN in step 2's old logprobs (as a
forward that blew up would give; a NaN reward is a RewardError before any update) makes the loss NaN: the update
is skipped (no optimizer step, weights bitwise unchanged) or the run aborts with the batch dumped; rank 0's
/metrics is scraped after steps 1 and 2 and parsed strictly."""

import json
import math
import sys
import urllib.request
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "ops"))
from fixtures import make_tiny_setup, trainer_config  # noqa: E402
from test_prometheus import parse_exposition  # noqa: E402

from rlhf.metrics import read_jsonl  # noqa: E402
from rlhf.testing.distributed import run_distributed  # noqa: E402
from rlhf.testing.webhook import WebhookReceiver  # noqa: E402

NAN_STEP = 2


def _instrumented_fit(paths, root, overrides):
    """Fit with one NaN old logprob at step 2; records per step: weights, optimizer steps, a scrape of rank 0."""
    import torch
    import torch.distributed as dist

    from rlhf.errors import NonFiniteError
    from rlhf.run_dir import close_run, setup_run
    from rlhf.orchestration.loop import Trainer
    from rlhf.orchestration.preflight import preflight

    cfg = trainer_config(paths, root, overrides)
    preflight(cfg, dist.get_world_size())
    run_dir = setup_run(cfg.run, cfg, defer_config=True)
    trainer = Trainer(cfg, run_dir)
    current = {"step": 0}
    actor = trainer.train_side.actor
    logprobs, step_fn = actor.logprobs, trainer._step

    def crafted_logprobs(batch, **options):
        logprobs_bt = logprobs(batch, **options)
        if current["step"] == NAN_STEP:  # the same global batch on every rank
            logprobs_bt[0, 0] = math.nan
        return logprobs_bt

    seen = []

    def recorded_step(step):
        current["step"] = step
        row = step_fn(step)
        seen.append({"step": step, "num_steps": actor.engine.num_steps,
                     "weights": [p.detach().clone() for p in actor.model.parameters()]})
        if trainer.exporter is not None:  # every rank's watchdog published a heartbeat when it started
            url = f"http://127.0.0.1:{trainer.exporter.port}/metrics"
            with urllib.request.urlopen(url, timeout=60) as reply:
                seen[-1]["scrape"] = reply.read().decode()
        return row

    actor.logprobs, trainer._step = crafted_logprobs, recorded_step
    try:
        history, error = trainer.fit(), None
    except NonFiniteError as raised:
        history, error = None, str(raised)
    finally:
        close_run()
    for before, after in zip(seen, seen[1:]):
        after["unchanged"] = all(torch.equal(a, b) for a, b in zip(before["weights"], after["weights"]))
    return {"history": history, "error": error, "run": str(run_dir.path),
            "steps": [{k: v for k, v in s.items() if k != "weights"} for s in seen]}


def _runs(paths, root, hook_url):
    common = ["trainer.val_before_train=false", "data.val_files=[]", f"alerts.webhook_url={hook_url}"]
    skip = _instrumented_fit(paths, f"{root}/skip", common + [
        "trainer.total_steps=3", "metrics.prometheus_port=-1", "metrics.prometheus_host=127.0.0.1"])
    abort = _instrumented_fit(paths, f"{root}/abort", common + ["trainer.total_steps=2", "alerts.nan_policy=abort"])
    return skip, abort


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_setup(tmp_path_factory.mktemp("tiny"))


def test_nan_skip_and_abort_alerts_and_prometheus_scrape_on_2_ranks(tiny, tmp_path):
    from safetensors.torch import load_file

    hook = WebhookReceiver("/alerts")
    try:
        results = run_distributed(_runs, 2, tiny, str(tmp_path), hook.url, timeout_s=400)
    finally:
        hook.server.shutdown()
    skip, abort = results[0]
    # skip: step 2's update is skipped on every rank (weights bitwise unchanged, no optimizer step); step 3 trains
    for rank_skip, _ in results:
        assert [(s["num_steps"], s.get("unchanged")) for s in rank_skip["steps"]] == [(1, None), (1, True), (2, False)]
    rows = {row["step"]: row for row in skip["history"]}
    assert rows[2]["alerts/nan"] == 1.0 and rows[2]["actor/skipped_steps"] == 1.0
    assert math.isnan(rows[2]["actor/pg_loss"])
    assert rows[1]["alerts/count"] == rows[3]["alerts/count"] == 0.0 and "alerts/nan" not in rows[3]
    assert read_jsonl(Path(skip["run"]) / "metrics.jsonl")[1]["alerts/nan"] == 1.0
    line = ("alert nan at step 2: non-finite loss or gradient (actor/pg_loss=nan, actor/skipped_steps=1); the "
            "optimizer skipped the update")
    assert [text for text in (Path(skip["run"]) / "rank0.log").read_text().splitlines()
            if " alert " in text][0].endswith(f"WARNING rlhf.alerts: {line}")
    assert " alert " not in (Path(skip["run"]) / "rank1.log").read_text(), "rank 0 alone reports"
    # the endpoint, scraped during the run
    port = int((Path(skip["run"]) / "prometheus.port").read_text())
    first, second = (parse_exposition(s["scrape"]) for s in skip["steps"][:2])
    assert first["rlhf_step"] == {(): 1.0} and second["rlhf_step"] == {(): 2.0} and port > 0
    assert first["rlhf_world_size"] == {(): 2.0}
    assert first["rlhf_rank_heartbeat"] == {(("rank", "0"),): 1.0, (("rank", "1"),): 1.0}
    assert set(first["rlhf_heartbeat_age_seconds"]) == {(("rank", "0"),), (("rank", "1"),)}
    assert first["rlhf_metric"][(("name", "actor/grad_norm"),)] == rows[1]["actor/grad_norm"]
    assert first["rlhf_step_seconds"] == {(): rows[1]["timing_s/step"]}
    assert first["rlhf_throughput_tokens_per_second"] == {(): rows[1]["perf/throughput_tok_s"]}
    assert first["rlhf_reward_mean"] == {(): rows[1]["critic/score/mean"]}
    assert {"gen", "update_actor", "update_weights"} <= {dict(k)["phase"] for k in first["rlhf_phase_seconds"]}
    assert first["rlhf_alerts_total"][(("alert", "nan"),)] == 0.0
    assert second["rlhf_alerts_total"][(("alert", "nan"),)] == 1.0 and second["rlhf_nonfinite_metrics"][()] >= 1
    # abort: every rank raises the same one-line error after rank 0 dumped the batch
    dump = Path(abort["run"]) / "nan_dumps" / "step_2"
    message = (f"step 2: {line.split(': ', 1)[1]}; batch dumped to {dump} (batch.safetensors + batch.json); "
               "aborting as alerts.nan_policy='abort' (set 'skip' to skip such steps)")
    assert [r[1]["error"] for r in results] == [message, message]
    assert [s["num_steps"] for s in abort["steps"]] == [1], "step 2 ended before its row; no update was applied"
    tensors = load_file(dump / "batch.safetensors")
    assert tensors["old_logprobs_bt"].isnan().nonzero().tolist() == [[0, 0]]
    assert tensors["scores_b"].isfinite().all() and tensors["tokens_bs"].shape[0] == 16
    info = json.loads((dump / "batch.json").read_text())
    assert info["step"] == 2 and info["fields"]["old_logprobs_bt"]["non_finite"] == 1
    assert not (Path(abort["run"]) / "checkpoints" / "step_2").exists()
    # the webhook got both runs' NaN alert
    assert [(post["run"], post["alert"], post["step"]) for post in hook.received] == [("t", "nan", 2), ("t", "nan", 2)]
