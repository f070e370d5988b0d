"""Training alerts on crafted metric sequences: each alert fires at its step, with its line, metric and webhook."""

import json
import logging
import math
import socket
import sys
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).parents[1] / "orchestration"))
from fixtures import scored_batch  # noqa: E402

from rlhf.config import from_dict  # noqa: E402
from rlhf.orchestration.schema import RlhfConfig  # noqa: E402
from rlhf.errors import ConfigError, NonFiniteError  # noqa: E402
from rlhf.http_post import DeadlineExceeded  # noqa: E402
from rlhf.ops import alerts as alerts_module  # noqa: E402
from rlhf.ops.alerts import (Alert, AlertDetectors, AlertMonitor, AlertsConfig, WebhookSender,  # noqa: E402
                             alert_metrics, post_webhook)
from rlhf.checkpoint.state_file import decode_state, encode_state  # noqa: E402
from rlhf.testing.webhook import WebhookReceiver  # noqa: E402


def _steady(step: int) -> dict[str, float]:
    """A healthy step: small noise around fixed levels (deterministic in the step number)."""
    wiggle = ((step * 7) % 5 - 2) / 100  # -0.02 .. 0.02
    return {"actor/pg_loss": 0.1 + wiggle, "actor/grad_norm": 1.0 + wiggle, "critic/score/mean": 0.3 + wiggle,
            "response_length/mean": 20.0 + 10 * wiggle, "response_length/empty_ratio": 0.0,
            "perf/throughput_tok_s": 1000.0 + 1000 * wiggle, "actor/skipped_steps": 0.0}


def _run(cfg: AlertsConfig, changes: dict[int, dict[str, float]], num_steps: int = 12) -> dict[int, list[str]]:
    detectors = AlertDetectors(cfg)
    return {step: [a.name for a in detectors.check(step, _steady(step) | changes.get(step, {}))]
            for step in range(1, num_steps + 1)}


@pytest.mark.parametrize("changes, expected", [
    ({8: {"actor/pg_loss": math.nan, "actor/grad_norm": math.nan, "actor/skipped_steps": 1.0}}, {8: ["nan"]}),
    ({3: {"actor/grad_norm": math.inf}}, {3: ["nan"]}),  # no history needed
    ({9: {"actor/pg_loss": 5.0}}, {9: ["loss_spike"]}),
    ({9: {"actor/grad_norm": 40.0}}, {9: ["grad_norm_spike"]}),
    ({9: {"response_length/mean": 3.0}}, {9: ["response_length_collapse"]}),
    ({9: {"perf/throughput_tok_s": 300.0}}, {9: ["throughput_drop"]}),
    ({s: {"response_length/empty_ratio": 0.75} for s in (7, 8, 9)}, {7: ["empty_generations"]}),
])
def test_each_alert_fires_at_the_crafted_step_only(changes, expected):
    fired = _run(AlertsConfig(reward_flat_steps=0), changes)
    assert {step: names for step, names in fired.items() if names} == expected


def test_reward_flat_for_k_steps_and_grad_norm_drop_is_no_spike():
    flat = {s: {"critic/score/mean": 0.25} for s in range(5, 13)}
    fired = _run(AlertsConfig(reward_flat_steps=4), flat)
    assert {step: names for step, names in fired.items() if names} == {8: ["reward_flat"]}
    assert not any(_run(AlertsConfig(reward_flat_steps=0), {9: {"actor/grad_norm": 0.01}}).values())


def test_alerts_config_errors():
    with pytest.raises(ConfigError, match=r"^alerts.nan_policy='ignore' is not one of skip, abort$"):
        AlertsConfig(nan_policy="ignore")
    with pytest.raises(ConfigError, match=r"^alerts.min_history=30 must be in \[1, alerts.window=20\]$"):
        AlertsConfig(min_history=30)
    with pytest.raises(ConfigError, match=r"^alerts.webhook_url='localhost:9' must be an http:// or https:// URL$"):
        from_dict(RlhfConfig, {"alerts": {"webhook_url": "localhost:9"}})
    assert from_dict(RlhfConfig, {"alerts": {"nan_policy": "abort"}}).alerts.nan_policy == "abort"


def _batch():
    return scored_batch(tokens_bs=torch.arange(12).reshape(2, 6), prompt_lengths_b=torch.tensor([3, 2]),
                        response_lengths_b=torch.tensor([3, 4]), response_mask_bt=torch.ones(2, 4, dtype=torch.bool),
                        group_index_b=torch.tensor([0, 0]), scores_b=torch.tensor([math.nan, 1.0]))


def test_monitor_logs_one_line_posts_the_webhook_and_counts(tmp_path, caplog):
    hook = WebhookReceiver()
    try:
        monitor = AlertMonitor(AlertsConfig(webhook_url=hook.url, reward_flat_steps=0), tmp_path / "myrun",
                               is_rank0=True)
        with caplog.at_level(logging.WARNING, logger="rlhf.alerts"):
            metrics = monitor.observe(1, {"actor/pg_loss": math.nan, "actor/skipped_steps": 1.0})
            quiet = monitor.observe(2, {"actor/pg_loss": 0.1, "actor/skipped_steps": 0.0})
            monitor.close()  # delivers the queued posts
    finally:
        hook.close()
    line = ("alert nan at step 1: non-finite loss or gradient (actor/pg_loss=nan, actor/skipped_steps=1); "
            "the optimizer skipped the update")
    assert [r.getMessage() for r in caplog.records] == [line]
    assert metrics == {"alerts/count": 1.0, "alerts/nan": 1.0} and quiet == {"alerts/count": 0.0}
    assert hook.received == [{"alert": "nan", "step": 1, "run": "myrun", "count": 1, "message": line.split(": ", 1)[1]}]
    assert monitor.counts["nan"] == 1 and sum(monitor.counts.values()) == 1
    assert alert_metrics([]) == {"alerts/count": 0.0}
    timed = [Alert("throughput_drop", 3, "slow"), Alert("loss_spike", 3, "up")]
    assert alert_metrics(timed) == {"alerts/count": 1.0, "alerts/loss_spike": 1.0, "perf/throughput_drop": 1.0}


def test_unreachable_webhook_is_one_warning_and_training_goes_on(tmp_path, caplog):
    hook = WebhookReceiver()
    hook.close()  # nothing listens there any more
    monitor = AlertMonitor(AlertsConfig(webhook_url=hook.url), tmp_path, is_rank0=True)
    with caplog.at_level(logging.WARNING, logger="rlhf.alerts"):
        monitor.observe(1, {"actor/grad_norm": math.inf})
        monitor.close()
    assert len(caplog.records) == 2 and caplog.records[1].getMessage().startswith(
        f"alerts: webhook {hook.url} failed (") and caplog.records[1].getMessage().endswith("); training goes on")


class _TricklingHook:
    """A webhook that answers 200 and then one byte of its promised body every 20 ms, until the client hangs up
    (each byte restarts a socket timeout: only an overall deadline ends the POST)."""

    def __init__(self):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}/hook"
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        conn, _ = self.listener.accept()
        with conn:
            conn.recv(65536)
            try:
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 1000000\r\n\r\n")
                while not self.stop.wait(0.02):  # pacing the trickle, not waiting for an outcome
                    conn.sendall(b" ")
            except OSError:
                pass  # the client cut the connection: done

    def close(self):
        self.stop.set()
        self.thread.join()
        self.listener.close()


def test_a_trickling_webhook_misses_its_deadline_and_close_returns(tmp_path, caplog):
    hook = _TricklingHook()
    try:
        assert post_webhook(hook.url, {"alert": "nan"}, 0.3) == (
            f"alerts: webhook {hook.url} failed (no full reply within alerts.webhook_timeout_s=0.3s); "
            "training goes on")
    finally:
        hook.close()
    hook = _TricklingHook()
    try:
        monitor = AlertMonitor(AlertsConfig(webhook_url=hook.url, webhook_timeout_s=0.3), tmp_path, is_rank0=True)
        sender = monitor._webhook
        with caplog.at_level(logging.WARNING, logger="rlhf.alerts"):
            monitor.observe(1, {"actor/grad_norm": math.inf})
            monitor.close()  # used to join the sender forever
    finally:
        hook.close()
    assert not sender._thread.is_alive()
    assert [r.getMessage() for r in caplog.records][1:] == [
        f"alerts: webhook {hook.url} failed (no full reply within alerts.webhook_timeout_s=0.3s); training goes on"]


class _StuckPost:
    """A POST that only ever ends when cut (as if its own timer never fired)."""
    started = threading.Event()

    def __init__(self, url, body, *, timeout_s, max_reply_bytes):
        self.url, self.timeout_s, self._cut = url, timeout_s, threading.Event()

    def cut(self):
        self._cut.set()

    def send(self):
        _StuckPost.started.set()
        self._cut.wait()
        raise DeadlineExceeded("cut")


def test_close_waits_one_deadline_then_cuts_the_post_in_flight_and_drops_the_rest(monkeypatch, caplog):
    monkeypatch.setattr(alerts_module, "DeadlinePost", _StuckPost)
    sender = WebhookSender("http://127.0.0.1:9/hook", timeout_s=0.2)
    with caplog.at_level(logging.WARNING, logger="rlhf.alerts"):
        sender.send({"alert": "nan", "step": 1})
        sender.send({"alert": "nan", "step": 2})
        _StuckPost.started.wait()
        sender.close()
    assert not sender._thread.is_alive()
    assert [r.getMessage() for r in caplog.records] == [
        "alerts: webhook http://127.0.0.1:9/hook failed (no full reply within alerts.webhook_timeout_s=0.2s); "
        "training goes on",
        "alerts: 1 webhook post(s) to http://127.0.0.1:9/hook dropped at shutdown (alerts.webhook_timeout_s=0.2 "
        "spent)"]


def test_abort_dumps_the_batch_as_safetensors_and_json_and_names_the_step(tmp_path):
    monitor = AlertMonitor(AlertsConfig(nan_policy="abort"), tmp_path, is_rank0=True)
    folder = tmp_path / "nan_dumps" / "step_4"
    with pytest.raises(NonFiniteError) as error:
        monitor.observe(4, {"actor/pg_loss": math.nan, "actor/skipped_steps": 1.0}, _batch())
    assert str(error.value) == (
        "step 4: non-finite loss or gradient (actor/pg_loss=nan, actor/skipped_steps=1); the optimizer skipped the "
        f"update; batch dumped to {folder} (batch.safetensors + batch.json); aborting as alerts.nan_policy='abort' "
        "(set 'skip' to skip such steps)")
    tensors = load_file(folder / "batch.safetensors")
    assert torch.equal(tensors["tokens_bs"], torch.arange(12).reshape(2, 6))
    assert torch.equal(tensors["scores_b"].isnan(), torch.tensor([True, False]))
    info = json.loads((folder / "batch.json").read_text())
    assert info["step"] == 4 and info["metrics"]["actor/pg_loss"] == "nan"
    assert info["fields"]["scores_b"] == {"shape": [2], "dtype": "float32", "non_finite": 1}
    assert info["fields"]["pad_token_id"] == 0 and "old_logprobs_bt" not in info["fields"]
    # skip (the default) goes on; a disabled monitor reports nothing
    assert AlertMonitor(AlertsConfig(), tmp_path, is_rank0=True).observe(4, {"actor/pg_loss": math.nan})["alerts/nan"]
    disabled = AlertMonitor(AlertsConfig(enable=False), tmp_path, is_rank0=True)
    assert disabled.observe(4, {"actor/pg_loss": math.nan}) == {}


def test_detector_state_round_trips_so_a_resumed_run_alerts_as_the_uninterrupted_one():
    changes = {9: {"actor/pg_loss": 5.0, "perf/throughput_tok_s": 100.0}, 10: {"critic/score/mean": 0.3}}
    full = AlertDetectors(AlertsConfig(reward_flat_steps=3))
    first = AlertDetectors(AlertsConfig(reward_flat_steps=3))
    for step in range(1, 7):
        full.check(step, _steady(step))
        first.check(step, _steady(step))
    resumed = AlertDetectors(AlertsConfig(reward_flat_steps=3))
    resumed.load_state_dict(decode_state(encode_state(first.state_dict()), "alerts"))  # as a checkpoint holds it
    for step in range(7, 13):
        values = _steady(step) | changes.get(step, {})
        assert [a.line() for a in resumed.check(step, values)] == [a.line() for a in full.check(step, values)]
    assert full.state_dict() == resumed.state_dict()
    assert AlertDetectors(AlertsConfig()).state_dict() != full.state_dict()
