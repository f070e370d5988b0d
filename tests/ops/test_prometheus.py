"""The Prometheus endpoint served on 127.0.0.1 and parsed strictly, and launch/monitoring checked against it."""

import json
import math
import re
import select
import socket
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch.distributed as dist
import yaml

from rlhf.errors import ConfigError
from rlhf.ops.prometheus import FAMILIES, MetricsConfig, PrometheusExporter, check_listen
from rlhf.parallel.watchdog import _PREFIX

MONITORING = Path(__file__).resolve().parents[2] / "launch" / "monitoring"
_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{((?:[a-zA-Z_]\w*="(?:[^"\\]|\\.)*",?)*)\})? (\S+)$')
_LABEL = re.compile(r'([a-zA-Z_]\w*)="((?:[^"\\]|\\.)*)"')
STEP = {"timing_s/step": 2.5, "timing_s/gen": 1.0, "timing_s/update_actor": 0.75, "perf/throughput_tok_s": 1234.5,
        "memory/train/peak_gb": 3.25, "critic/score/mean": 0.5, "actor/kl_loss": 0.01, "actor/pg_loss": math.nan,
        "critic/vf_loss": 0.2, "actor/grad_norm": math.inf, "critic/grad_norm": 1.5, "response_length/mean": 7.0}


def parse_exposition(text: str) -> dict[str, dict[tuple, float]]:
    """{family: {sorted label items: value}}; fails on any line the 0.0.4 text format does not allow."""
    families: dict[str, dict[tuple, float]] = {}
    declared: dict[str, set] = {}
    assert text.endswith("\n")
    for line in text.splitlines():
        if line.startswith("# "):
            kind, family, rest = line[2:].split(" ", 2)
            assert kind in ("HELP", "TYPE") and kind not in declared.setdefault(family, set()), line
            declared[family].add(kind)
            assert kind == "HELP" or rest in ("gauge", "counter"), line
            continue
        match = _SAMPLE.match(line)
        assert match, f"not an exposition line: {line!r}"
        family, labels, value = match.groups()
        assert declared.get(family) == {"HELP", "TYPE"}, f"{family} sampled before its HELP and TYPE"
        key = tuple(sorted(_LABEL.findall(labels or "")))
        assert key not in families.setdefault(family, {}), f"duplicate sample {line!r}"
        families[family][key] = float(value)
    return families


def _scrape(port: int, path: str = "/metrics") -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=30) as reply:
        assert reply.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
        return reply.read().decode()


@pytest.fixture
def exporter():
    store = dist.HashStore()
    store.set(f"{_PREFIX}/heartbeat/0", json.dumps({"time": time.time() - 5.0, "phase": "rl_step 3",
                                                     "phase_s": 1.25}))
    exporter = PrometheusExporter(MetricsConfig(prometheus_port=-1, prometheus_host="127.0.0.1"), world_size=2,
                                  store=store)
    yield exporter
    exporter.close()


def test_scrape_exports_the_step_the_alerts_and_every_ranks_heartbeat(exporter):
    before = parse_exposition(_scrape(exporter.port))
    assert before["rlhf_world_size"] == {(): 2.0} and "rlhf_step" not in before, "nothing before the first step"
    exporter.update(3, STEP, {"nan": 2, "loss_spike": 0})
    families = parse_exposition(_scrape(exporter.port))
    assert families["rlhf_step"] == {(): 3.0} and families["rlhf_step_seconds"] == {(): 2.5}
    assert families["rlhf_phase_seconds"] == {(("phase", "gen"),): 1.0, (("phase", "update_actor"),): 0.75}
    assert families["rlhf_throughput_tokens_per_second"] == {(): 1234.5}
    assert families["rlhf_memory_gb"] == {(("kind", "peak"), ("phase", "train")): 3.25}
    assert families["rlhf_reward_mean"] == {(): 0.5}
    assert families["rlhf_kl"] == {(("name", "actor/kl_loss"),): 0.01}
    assert families["rlhf_grad_norm"] == {(("role", "actor"),): math.inf, (("role", "critic"),): 1.5}
    assert math.isnan(families["rlhf_loss"][(("name", "pg_loss"), ("role", "actor"))])
    assert families["rlhf_nonfinite_metrics"] == {(): 2.0}
    assert families["rlhf_alerts_total"] == {(("alert", "nan"),): 2.0, (("alert", "loss_spike"),): 0.0}
    assert families["rlhf_metric"][(("name", "response_length/mean"),)] == 7.0
    assert len(families["rlhf_metric"]) == len(STEP)
    assert families["rlhf_rank_heartbeat"] == {(("rank", "0"),): 1.0, (("rank", "1"),): 0.0}
    assert families["rlhf_heartbeat_age_seconds"][(("rank", "0"),)] >= 5.0
    assert set(families["rlhf_heartbeat_age_seconds"]) == {(("rank", "0"),)}, "a rank with no heartbeat has no age"
    assert families["rlhf_phase_elapsed_seconds"] == {(("rank", "0"),): 1.25}
    assert time.time() - families["rlhf_last_step_timestamp_seconds"][()] >= 0
    assert set(families) == set(FAMILIES), "every declared family is exported"
    with pytest.raises(urllib.error.HTTPError) as error:
        _scrape(exporter.port, "/other")
    assert error.value.code == 404


def test_port_config_errors(exporter):
    with pytest.raises(ConfigError, match=r"^metrics.prometheus_port=70000 must be 0 \(off\), -1 \(any free port\)"):
        MetricsConfig(prometheus_port=70000)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=rf"^metrics.prometheus_port={port}: cannot listen on 127.0.0.1:{port} "
                                              r"\(.+\); choose a free port or -1, or another "
                                              r"metrics.prometheus_host$"):
            PrometheusExporter(MetricsConfig(prometheus_port=port, prometheus_host="127.0.0.1"), world_size=1)
        with pytest.raises(ConfigError, match=rf"^metrics.prometheus_port={port}: cannot listen on 127.0.0.1:{port} "):
            check_listen(MetricsConfig(prometheus_port=port))
    check_listen(MetricsConfig(prometheus_port=port))  # free again
    check_listen(MetricsConfig(prometheus_port=0, prometheus_host="no-such-host.invalid"))  # no endpoint: no check
    with pytest.raises(ConfigError, match=r"^metrics.prometheus_port=-1: cannot listen on no-such-host.invalid:0 "):
        check_listen(MetricsConfig(prometheus_port=-1, prometheus_host="no-such-host.invalid"))
    with pytest.raises(ConfigError, match=r"^metrics.prometheus_max_connections=0 must be >= 1$"):
        MetricsConfig(prometheus_max_connections=0)
    with pytest.raises(ConfigError, match=r"^metrics.prometheus_timeout_s=0 must be > 0$"):
        MetricsConfig(prometheus_timeout_s=0)


def test_the_default_host_is_loopback_only():
    assert MetricsConfig().prometheus_host == "127.0.0.1"
    exporter = PrometheusExporter(MetricsConfig(prometheus_port=-1), world_size=1)
    try:
        assert exporter._server.server_address[0] == "127.0.0.1"
        assert parse_exposition(_scrape(exporter.port))["rlhf_world_size"] == {(): 1.0}
    finally:
        exporter.close()


def _closed_by_server(sock: socket.socket) -> bool:
    """The server hung up (EOF or reset) rather than answering."""
    try:
        return sock.recv(65536) == b""
    except ConnectionResetError:
        return True


def test_idle_and_trickling_connections_are_cut_at_the_timeout():
    exporter = PrometheusExporter(MetricsConfig(prometheus_port=-1, prometheus_timeout_s=0.3), world_size=1)
    try:
        with socket.create_connection(("127.0.0.1", exporter.port), timeout=60) as idle:
            assert _closed_by_server(idle), "an idle connection is closed at the timeout"
        with socket.create_connection(("127.0.0.1", exporter.port), timeout=60) as trickle:
            closed = False
            for _ in range(3000):  # one byte of a never-ending request line every 20 ms
                try:
                    trickle.sendall(b"G")
                except OSError:
                    closed = True
                    break
                if select.select([trickle], [], [], 0.02)[0]:
                    closed = _closed_by_server(trickle)
                    break
            assert closed, "each byte restarts a socket timeout; the connection's deadline still cuts it"
    finally:
        exporter.close()


def test_connections_over_the_cap_are_closed_unanswered_and_hold_no_thread():
    exporter = PrometheusExporter(MetricsConfig(prometheus_port=-1, prometheus_max_connections=2,
                                                prometheus_timeout_s=60), world_size=1)
    before = threading.active_count()
    held = [socket.create_connection(("127.0.0.1", exporter.port), timeout=60) for _ in range(2)]
    try:
        for _ in range(5):  # accepted in order after the two held ones: each finds no free slot
            with socket.create_connection(("127.0.0.1", exporter.port), timeout=60) as extra:
                extra.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
                assert _closed_by_server(extra), "a connection over the cap gets no reply"
        assert threading.active_count() <= before + 2 * 2  # per held connection: its handler and its deadline
    finally:
        for sock in held:
            sock.close()
        exporter.close()


def _names(expr: str) -> set[str]:
    return set(re.findall(r"\brlhf_[a-z_]+", expr))


def test_alert_rules_load_and_name_only_exported_metrics(exporter):
    exporter.update(3, STEP, {"nan": 0})
    exported = set(parse_exposition(_scrape(exporter.port)))
    rules = yaml.safe_load((MONITORING / "alerts.yml").read_text())
    named = {rule["alert"]: rule for group in rules["groups"] for rule in group["rules"]}
    assert {"RlhfStepStalled", "RlhfRankMissing", "RlhfThroughputDrop", "RlhfLossSpike", "RlhfNonFinite"} <= set(named)
    for name, rule in named.items():
        if rule["expr"] == 'up{job="rlhf"} == 0':  # Prometheus' own series for the scrape itself
            continue
        assert _names(rule["expr"]) and _names(rule["expr"]) <= exported, (name, rule["expr"])
        assert rule["labels"]["severity"] in ("warning", "critical") and rule["annotations"]["summary"]
    alert_names = set(re.findall(r'alert=~?"([a-z_|]+)"', (MONITORING / "alerts.yml").read_text()))
    from rlhf.ops.alerts import ALERT_NAMES

    assert {n for names in alert_names for n in names.split("|")} <= set(ALERT_NAMES)
    config = yaml.safe_load((MONITORING / "prometheus.yml").read_text())
    assert config["rule_files"] == ["alerts.yml"]
    dashboard = json.loads((MONITORING / "grafana-dashboard.json").read_text())
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    assert len(exprs) >= 10 and all(_names(e) and _names(e) <= exported for e in exprs)
