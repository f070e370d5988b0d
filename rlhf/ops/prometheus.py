"""`metrics.prometheus_port`: rank 0 serves the run's state in Prometheus' text exposition format (stdlib only).

    GET http://<host>:<port>/metrics
      rlhf_step, rlhf_last_step_timestamp_seconds, rlhf_step_seconds, rlhf_phase_seconds{phase}, throughput,
      memory, reward, KL, loss, grad norm, rlhf_alerts_total{alert}, and per rank (from the watchdog's
      heartbeats in the rendezvous store) rlhf_rank_heartbeat{rank} and rlhf_heartbeat_age_seconds{rank};
      every other step metric as rlhf_metric{name}.
The server is a daemon thread; a scrape renders the last completed step's snapshot and reads the heartbeats
then, so a stalled step shows as a growing heartbeat age and a stale `rlhf_last_step_timestamp_seconds`.
Bounded: at most `metrics.prometheus_max_connections` connections at once (two threads each, handler and
deadline; more are closed unanswered), each cut `metrics.prometheus_timeout_s` after it opened, whatever it does.
"""

from __future__ import annotations

import math
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from rlhf.errors import ConfigError
from rlhf.ops.config import MetricsConfig
from rlhf.parallel.watchdog import read_heartbeats

# name -> (type, help): every family the endpoint can export (launch/monitoring is validated against it).
FAMILIES = {
    "rlhf_world_size": ("gauge", "Ranks in the run."),
    "rlhf_step": ("gauge", "Last completed RL step."),
    "rlhf_last_step_timestamp_seconds": ("gauge", "Unix time the last step completed."),
    "rlhf_step_seconds": ("gauge", "Wall time of the last step (timing_s/step)."),
    "rlhf_phase_seconds": ("gauge", "Wall time of each phase of the last step (timing_s/<phase>)."),
    "rlhf_throughput_tokens_per_second": ("gauge", "Tokens per second per rank (perf/throughput_tok_s)."),
    "rlhf_memory_gb": ("gauge", "Memory per phase (memory/<phase>/<kind>_gb)."),
    "rlhf_reward_mean": ("gauge", "Mean sequence reward of the last step (critic/score/mean)."),
    "rlhf_kl": ("gauge", "KL to the reference (actor/kl_loss or actor/reward_kl_penalty)."),
    "rlhf_loss": ("gauge", "Losses of the last step (actor/pg_loss, critic/vf_loss)."),
    "rlhf_grad_norm": ("gauge", "Pre-clip gradient norm per trained role."),
    "rlhf_nonfinite_metrics": ("gauge", "Step metrics that were NaN or inf in the last step."),
    "rlhf_alerts_total": ("counter", "Training alerts raised since the run (re)started."),
    "rlhf_rank_heartbeat": ("gauge", "1 when the rank's watchdog has published a heartbeat, else 0."),
    "rlhf_heartbeat_age_seconds": ("gauge", "Seconds since the rank's last watchdog heartbeat."),
    "rlhf_phase_elapsed_seconds": ("gauge", "Seconds the rank has spent in its current watchdog phase."),
    "rlhf_metric": ("gauge", "Every step metric by its verl name."),
}
_KL = ("actor/kl_loss", "actor/reward_kl_penalty")
_LOSSES = ("actor/pg_loss", "critic/vf_loss")


def _number(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    escaped = (str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") for v in labels.values())
    return "{" + ",".join(f'{k}="{v}"' for k, v in zip(labels, escaped)) + "}"


def step_samples(step: int, values: dict[str, float], finished_at: float) -> list[tuple[str, dict, float]]:
    """(family, labels, value) for one step's reduced metrics."""
    samples = [("rlhf_step", {}, float(step)), ("rlhf_last_step_timestamp_seconds", {}, finished_at),
               ("rlhf_nonfinite_metrics", {}, float(sum(not math.isfinite(v) for v in values.values())))]
    for name, value in sorted(values.items()):
        samples.append(("rlhf_metric", {"name": name}, value))
        parts = name.split("/")
        if name == "timing_s/step":
            samples.append(("rlhf_step_seconds", {}, value))
        elif parts[0] == "timing_s":
            samples.append(("rlhf_phase_seconds", {"phase": "/".join(parts[1:])}, value))
        elif name == "perf/throughput_tok_s":
            samples.append(("rlhf_throughput_tokens_per_second", {}, value))
        elif parts[0] == "memory" and len(parts) == 3:
            samples.append(("rlhf_memory_gb", {"phase": parts[1], "kind": parts[2].removesuffix("_gb")}, value))
        elif name == "critic/score/mean":
            samples.append(("rlhf_reward_mean", {}, value))
        elif name in _KL:
            samples.append(("rlhf_kl", {"name": name}, value))
        elif name in _LOSSES:
            samples.append(("rlhf_loss", {"role": parts[0], "name": parts[1]}, value))
        elif len(parts) == 2 and parts[1] == "grad_norm":
            samples.append(("rlhf_grad_norm", {"role": parts[0]}, value))
    return samples


def heartbeat_samples(beats: dict[int, dict | None], now: float) -> list[tuple[str, dict, float]]:
    samples = []
    for rank, beat in sorted(beats.items()):
        samples.append(("rlhf_rank_heartbeat", {"rank": str(rank)}, float(beat is not None)))
        if beat is not None:
            samples.append(("rlhf_heartbeat_age_seconds", {"rank": str(rank)}, max(now - beat["time"], 0.0)))
            if beat.get("phase_s") is not None:
                samples.append(("rlhf_phase_elapsed_seconds", {"rank": str(rank)}, float(beat["phase_s"])))
    return samples


def render(samples: list[tuple[str, dict, float]]) -> str:
    """Text exposition format 0.0.4: HELP and TYPE once per family, then its samples."""
    by_family: dict[str, list[str]] = {}
    for family, labels, value in samples:
        assert family in FAMILIES, family
        by_family.setdefault(family, []).append(f"{family}{_labels(labels)} {_number(value)}")
    lines = []
    for family, rows in by_family.items():
        kind, help_text = FAMILIES[family]
        lines += [f"# HELP {family} {help_text}", f"# TYPE {family} {kind}", *rows]
    return "\n".join(lines) + "\n"


def _port(cfg: MetricsConfig) -> int:
    return 0 if cfg.prometheus_port == -1 else cfg.prometheus_port


def _listen_error(cfg: MetricsConfig, error: OSError) -> ConfigError:
    return ConfigError(f"metrics.prometheus_port={cfg.prometheus_port}: cannot listen on {cfg.prometheus_host}:"
                       f"{_port(cfg)} ({error.strerror or error}); choose a free port or -1, or another "
                       "metrics.prometheus_host")


def check_listen(cfg: MetricsConfig) -> None:
    """The endpoint's host:port can be bound (bound and let go at once): a taken port or an unknown host is a
    ConfigError before the run folder exists, with the same text the exporter raises."""
    if not cfg.prometheus_port:
        return
    try:
        socket.create_server((cfg.prometheus_host, _port(cfg))).close()
    except OSError as error:
        raise _listen_error(cfg, error) from None


class _BoundedServer(ThreadingHTTPServer):
    """One daemon thread per connection, at most `max_connections` of them, each cut at `timeout_s`."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type, *, max_connections: int, timeout_s: float) -> None:
        self._slots = threading.BoundedSemaphore(max_connections)
        self.timeout_s = timeout_s
        super().__init__(address, handler)

    def process_request(self, request: socket.socket, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)  # over the cap: closed unanswered, no thread
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: socket.socket, client_address: Any) -> None:
        timer = threading.Timer(self.timeout_s, _cut, args=(request,))
        timer.daemon = True
        timer.start()
        try:
            super().process_request_thread(request, client_address)
        finally:
            timer.cancel()
            self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that hung up or was cut; nothing for the run log


def _cut(request: socket.socket) -> None:
    try:
        request.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


class PrometheusExporter:
    """Rank 0's endpoint: `update()` after each step; `port` is the bound port (useful with port -1)."""

    def __init__(self, cfg: MetricsConfig, *, world_size: int, store: Any = None) -> None:
        self.world_size, self.store = world_size, store
        self._lock = threading.Lock()
        self._step: list[tuple[str, dict, float]] = []
        self._alerts: dict[str, int] = {}
        exporter = self

        class Handler(BaseHTTPRequestHandler):
            timeout = cfg.prometheus_timeout_s  # per socket operation; the whole connection: _BoundedServer

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                if self.path.split("?")[0] != "/metrics":
                    self.send_error(404, "only /metrics is served")
                    return
                body = exporter.scrape().encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:  # scrapes do not belong in the run log
                pass

        try:
            self._server = _BoundedServer((cfg.prometheus_host, _port(cfg)), Handler,
                                          max_connections=cfg.prometheus_max_connections,
                                          timeout_s=cfg.prometheus_timeout_s)
        except OSError as error:
            raise _listen_error(cfg, error) from None
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="rlhf-prometheus", daemon=True)
        self._thread.start()

    def update(self, step: int, values: dict[str, float], alert_counts: dict[str, int]) -> None:
        samples = step_samples(step, values, time.time())
        with self._lock:
            self._step, self._alerts = samples, dict(alert_counts)

    def scrape(self) -> str:
        with self._lock:
            samples = list(self._step)
            alerts = dict(self._alerts)
        samples.append(("rlhf_world_size", {}, float(self.world_size)))
        samples += [("rlhf_alerts_total", {"alert": name}, float(n)) for name, n in sorted(alerts.items())]
        if self.store is not None:
            samples += heartbeat_samples(read_heartbeats(self.store, self.world_size), time.time())
        return render(samples)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()
