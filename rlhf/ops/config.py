"""Config sections of the training alerts and the Prometheus endpoint, free of torch (the owners: alerts.py,
prometheus.py)."""

from __future__ import annotations

from dataclasses import dataclass

from rlhf.errors import ConfigError

NAN_POLICIES = ("skip", "abort")


@dataclass(kw_only=True)
class AlertsConfig:
    """Which step metrics raise an alert. Spikes: robust z-score (median/MAD over the last `window` steps) above
    `spike_z`; collapse / throughput drop: below a ratio of the window median; detectors wait for `min_history`
    steps. `reward_flat_steps`: mean reward unchanged (within `reward_flat_tolerance`) that many steps (0: off).
    `nan_policy`: `skip` the update of a non-finite step and go on, or `abort` with a dump of the batch."""

    enable: bool = True  # run the detectors on every step's metrics
    nan_policy: str = "skip"  # a non-finite loss or gradient: skip the update, or abort with the batch dumped
    window: int = 20  # steps of history the spike / collapse / drop detectors compare with
    min_history: int = 5  # steps a detector waits before judging
    spike_z: float = 8.0  # robust z-score (median / MAD) above which a loss or grad norm is a spike
    length_collapse_ratio: float = 0.25  # mean response length below this share of the window median
    empty_ratio: float = 0.5  # share of empty generations in a step that raises an alert
    reward_flat_steps: int = 10  # mean reward unchanged this many steps; 0: off
    reward_flat_tolerance: float = 1e-6  # how close two mean rewards count as unchanged
    throughput_drop_ratio: float = 0.5  # throughput below this share of the window median
    webhook_url: str = ""  # POST every alert as JSON to this http(s) URL; empty: none
    webhook_timeout_s: float = 5.0  # deadline of one webhook POST (connect to reply); the run end waits <= 2x

    def __post_init__(self) -> None:
        if self.nan_policy not in NAN_POLICIES:
            raise ConfigError(f"alerts.nan_policy={self.nan_policy!r} is not one of {', '.join(NAN_POLICIES)}")
        if not 1 <= self.min_history <= self.window:
            raise ConfigError(f"alerts.min_history={self.min_history} must be in [1, alerts.window={self.window}]")
        if not self.spike_z > 0:
            raise ConfigError(f"alerts.spike_z={self.spike_z} must be > 0")
        for name in ("length_collapse_ratio", "empty_ratio", "throughput_drop_ratio"):
            if not 0 <= getattr(self, name) <= 1:
                raise ConfigError(f"alerts.{name}={getattr(self, name)} must be in [0, 1]")
        if self.reward_flat_steps < 0 or self.reward_flat_steps == 1:
            raise ConfigError(f"alerts.reward_flat_steps={self.reward_flat_steps} must be 0 (off) or >= 2")
        if self.webhook_url and not self.webhook_url.startswith(("http://", "https://")):
            raise ConfigError(f"alerts.webhook_url={self.webhook_url!r} must be an http:// or https:// URL")
        if not self.webhook_timeout_s > 0:
            raise ConfigError(f"alerts.webhook_timeout_s={self.webhook_timeout_s} must be > 0")



@dataclass(kw_only=True)
class MetricsConfig:
    """`prometheus_port`: 0 = no endpoint, -1 = any free port (logged, and written to `<run>/prometheus.port`).
    `prometheus_host`: the interface rank 0 binds; the default 127.0.0.1 answers this host only. The endpoint has
    no authentication: set `0.0.0.0` (every interface) or one address only for a Prometheus on another host of a
    trusted network. At most `prometheus_max_connections` are served at once (more are closed unanswered), each
    closed `prometheus_timeout_s` after it opened (an idle or trickling client holds no thread longer)."""

    prometheus_port: int = 0  # rank 0 serves /metrics here; 0: off, -1: any free port
    prometheus_host: str = "127.0.0.1"  # interface the endpoint binds; 0.0.0.0: every interface (opt-in)
    prometheus_max_connections: int = 8  # connections served at once; more are closed unanswered
    prometheus_timeout_s: float = 10.0  # deadline of one connection: request read and reply written

    def __post_init__(self) -> None:
        if not -1 <= self.prometheus_port <= 65535:
            raise ConfigError(f"metrics.prometheus_port={self.prometheus_port} must be 0 (off), -1 (any free "
                              "port) or a port number up to 65535")
        if self.prometheus_max_connections < 1:
            raise ConfigError(f"metrics.prometheus_max_connections={self.prometheus_max_connections} must be >= 1")
        if not self.prometheus_timeout_s > 0:
            raise ConfigError(f"metrics.prometheus_timeout_s={self.prometheus_timeout_s} must be > 0")
