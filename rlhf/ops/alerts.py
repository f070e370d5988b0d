"""Training alerts (`alerts.*`): each step's reduced metrics go through the detectors of `rlhf.ops.detectors`.

Every rank sees the same reduced metrics, so every rank finds the same alerts (an abort needs no vote). Rank 0
logs one warning line per alert, counts it (`alerts/<name>` metrics, the Prometheus counters) and POSTs it as
JSON to `alerts.webhook_url` (from a thread, each POST under `alerts.webhook_timeout_s`: a slow endpoint never
stalls a step, and the run's end waits on it at most that long). NaN/inf in a loss or gradient: the optimizer has
already skipped that update (no optimizer or scheduler step, `TrainEngine`); `nan_policy: abort` then writes the
step's batch as safetensors + JSON under `<run>/nan_dumps/step_<N>/` and ends every rank with a `NonFiniteError`
naming the step.
The detectors' windows are checkpointed: a resumed run alerts as the uninterrupted one. The throughput drop is
judged on wall time, so its metric is `perf/throughput_drop` (beside the other timing-derived values, which no
two runs share) and `alerts/count` leaves it out.
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import math
import queue
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from rlhf.errors import NonFiniteError
from rlhf.http_post import DeadlineExceeded, DeadlinePost, ReplyTooLarge
from rlhf.ops.config import AlertsConfig
from rlhf.ops.detectors import DropDetector, FlatDetector, SpikeDetector, non_finite
from rlhf.run_dir import get_logger

log = get_logger("alerts")
ALERT_NAMES = ("nan", "loss_spike", "grad_norm_spike", "response_length_collapse", "empty_generations",
               "reward_flat", "throughput_drop")
# Metrics whose NaN/inf means the step's update is unusable (the optimizer skips such updates).
FINITE_METRICS = ("actor/pg_loss", "actor/grad_norm", "actor/kl_loss", "actor/entropy", "critic/vf_loss",
                  "critic/grad_norm", "critic/score/mean", "critic/advantages/mean")
SKIP_METRICS = ("actor/skipped_steps", "critic/skipped_steps")
LOSSES = ("actor/pg_loss", "critic/vf_loss")
GRAD_NORMS = ("actor/grad_norm", "critic/grad_norm")


@dataclass(frozen=True)
class Alert:
    name: str
    step: int
    message: str

    def line(self) -> str:
        return f"alert {self.name} at step {self.step}: {self.message}"


class AlertDetectors:
    """Every detector of one run, fed one step's reduced metrics at a time (pure: no logging, no I/O)."""

    def __init__(self, cfg: AlertsConfig) -> None:
        self.cfg = cfg
        window = dict(window=cfg.window, min_history=cfg.min_history)
        self.loss = {name: SpikeDetector(**window, z_threshold=cfg.spike_z) for name in LOSSES}
        self.grad = {name: SpikeDetector(**window, z_threshold=cfg.spike_z, upward_only=True) for name in GRAD_NORMS}
        self.length = DropDetector(**window, ratio=cfg.length_collapse_ratio)
        self.throughput = DropDetector(**window, ratio=cfg.throughput_drop_ratio)
        self.reward = FlatDetector(steps=cfg.reward_flat_steps, tolerance=cfg.reward_flat_tolerance)
        self._empty = False

    def check(self, step: int, values: dict[str, float]) -> list[Alert]:
        found = self._nan(step, values)
        found += self._spikes(step, values)
        found += self._responses(step, values)
        if self.cfg.reward_flat_steps and "critic/score/mean" in values and self.reward.update(
                values["critic/score/mean"]):
            found.append(Alert("reward_flat", step, f"critic/score/mean={values['critic/score/mean']:.4g} has not "
                               f"changed for {self.cfg.reward_flat_steps} steps (no learning signal)"))
        if "perf/throughput_tok_s" in values:
            median = self.throughput.update(values["perf/throughput_tok_s"])
            if median is not None:
                found.append(Alert("throughput_drop", step,
                                   f"perf/throughput_tok_s={values['perf/throughput_tok_s']:.4g} "
                                   f"tokens/s is below {self.cfg.throughput_drop_ratio:g} x its recent median "
                                   f"{median:.4g}"))
        return found

    def detectors(self) -> dict:
        return {**{f"loss:{k}": v for k, v in self.loss.items()}, **{f"grad:{k}": v for k, v in self.grad.items()},
                "length": self.length, "throughput": self.throughput, "reward": self.reward}

    def state_dict(self) -> dict:
        return {"detectors": {name: d.state_dict() for name, d in self.detectors().items()}, "empty": self._empty}

    def load_state_dict(self, state: dict) -> None:
        for name, detector in self.detectors().items():
            detector.load_state_dict(state["detectors"][name])
        self._empty = bool(state["empty"])

    def _nan(self, step: int, values: dict[str, float]) -> list[Alert]:
        bad = non_finite(values, FINITE_METRICS)
        skipped = [f"{name}={values[name]:g}" for name in SKIP_METRICS if values.get(name, 0) > 0]
        if not bad and not skipped:
            return []
        what = ", ".join(bad + skipped)
        return [Alert("nan", step, f"non-finite loss or gradient ({what}); the optimizer skipped the update")]

    def _spikes(self, step: int, values: dict[str, float]) -> list[Alert]:
        found = []
        for kind, detectors in (("loss_spike", self.loss), ("grad_norm_spike", self.grad)):
            for name, detector in detectors.items():
                z = detector.update(values[name]) if name in values else None
                if z is not None:
                    found.append(Alert(kind, step, f"{name}={values[name]:.4g} is {z:+.3g} robust standard "
                                       f"deviations from its last {len(detector.history)} steps"))
        return found

    def _responses(self, step: int, values: dict[str, float]) -> list[Alert]:
        found = []
        if "response_length/mean" in values:
            median = self.length.update(values["response_length/mean"])
            if median is not None:
                found.append(Alert("response_length_collapse", step, f"response_length/mean="
                                   f"{values['response_length/mean']:.4g} fell below "
                                   f"{self.cfg.length_collapse_ratio:g} x its recent median {median:.4g}"))
        empty = values.get("response_length/empty_ratio", 0.0) > self.cfg.empty_ratio
        if empty and not self._empty:  # once per episode, not once per step
            found.append(Alert("empty_generations", step, f"{values['response_length/empty_ratio']:.0%} of the "
                               f"responses are empty (alerts.empty_ratio={self.cfg.empty_ratio:g})"))
        self._empty = empty
        return found


def alert_metrics(alerts: list[Alert]) -> dict[str, float]:
    """`alerts/count` every step, `alerts/<name>` = 1 for each alert raised in it (`perf/throughput_drop`)."""
    counted = [alert for alert in alerts if alert.name != "throughput_drop"]
    out = {"alerts/count": float(len(counted)), **{f"alerts/{alert.name}": 1.0 for alert in counted}}
    if len(counted) < len(alerts):
        out["perf/throughput_drop"] = 1.0
    return out


WEBHOOK_REPLY_BYTES = 1 << 16  # a webhook's reply is read (to complete the exchange) and dropped


def post_webhook(url: str, payload: dict, timeout_s: float) -> str | None:
    """POST `payload` as JSON under one deadline; the failure as one line (None when delivered). Never raises."""
    return _delivered(DeadlinePost(url, json.dumps(payload).encode(), timeout_s=timeout_s,
                                   max_reply_bytes=WEBHOOK_REPLY_BYTES))


def _delivered(post: DeadlinePost) -> str | None:
    try:
        post.send()
        return None
    except DeadlineExceeded:
        reason = f"no full reply within alerts.webhook_timeout_s={post.timeout_s:g}s"
    except ReplyTooLarge:
        reason = f"reply of more than {WEBHOOK_REPLY_BYTES} bytes"
    except (OSError, http.client.HTTPException, ValueError) as error:
        reason = str(error) or type(error).__name__
    return f"alerts: webhook {post.url} failed ({reason}); training goes on"


class WebhookSender:
    """POSTs payloads in order from a daemon thread, each under `timeout_s`. `close()` waits `timeout_s` for the
    queued ones, then cuts the POST in flight and drops the rest (one warning line): it returns within
    2 x `timeout_s` whatever the endpoint does."""

    def __init__(self, url: str, timeout_s: float) -> None:
        self.url, self.timeout_s = url, timeout_s
        self._queue: queue.Queue[dict | None] = queue.Queue()
        self._lock = threading.Lock()
        self._closing = False
        self._current: DeadlinePost | None = None
        self._thread = threading.Thread(target=self._run, name="rlhf-alert-webhook", daemon=True)
        self._thread.start()

    def send(self, payload: dict) -> None:
        self._queue.put(payload)

    def _run(self) -> None:
        dropped = 0
        while (payload := self._queue.get()) is not None:
            post = DeadlinePost(self.url, json.dumps(payload).encode(), timeout_s=self.timeout_s,
                                max_reply_bytes=WEBHOOK_REPLY_BYTES)
            with self._lock:
                if self._closing:
                    dropped += 1
                    continue
                self._current = post
            failure = _delivered(post)
            if failure:
                log.warning(failure)
        if dropped:
            log.warning("alerts: %d webhook post(s) to %s dropped at shutdown (alerts.webhook_timeout_s=%g spent)",
                        dropped, self.url, self.timeout_s)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(self.timeout_s)
        if self._thread.is_alive():
            with self._lock:
                self._closing = True
                if self._current is not None:
                    self._current.cut()
            self._thread.join(self.timeout_s)  # the cut POST returns at once (a connect within its socket timeout)


def dump_batch(batch: Any, folder: Path, info: dict) -> None:
    """The step's ScoredBatch as `batch.safetensors` (every tensor field) + `batch.json` (scalars, shapes, `info`)."""
    folder.mkdir(parents=True, exist_ok=True)
    tensors, fields = {}, {}
    for field in dataclasses.fields(batch):
        value = getattr(batch, field.name)
        if isinstance(value, torch.Tensor):
            tensors[field.name] = value.detach().cpu().clone()  # fields may share a tensor (masks)
            fields[field.name] = {"shape": list(value.shape), "dtype": str(value.dtype).removeprefix("torch."),
                                  "non_finite": int((~torch.isfinite(value)).sum()) if value.is_floating_point()
                                  else 0}
        elif value is not None:
            fields[field.name] = value
    save_file(tensors, str(folder / "batch.safetensors"))
    (folder / "batch.json").write_text(json.dumps({**info, "fields": fields}, indent=1, sort_keys=True) + "\n")


class AlertMonitor:
    """The run's alerts: detect on every rank, report on rank 0, apply `nan_policy`; counts per alert name."""

    def __init__(self, cfg: AlertsConfig, run_path: Path, *, is_rank0: bool) -> None:
        self.cfg, self.run_path, self.is_rank0 = cfg, run_path, is_rank0
        self.detectors = AlertDetectors(cfg)
        self.counts = dict.fromkeys(ALERT_NAMES, 0)
        self._webhook = (WebhookSender(cfg.webhook_url, cfg.webhook_timeout_s)
                         if cfg.enable and cfg.webhook_url and is_rank0 else None)

    def observe(self, step: int, values: dict[str, float], batch: Any = None) -> dict[str, float]:
        """The step's `alerts/*` metrics; under `nan_policy: abort`, dumps `batch` and raises on every rank."""
        if not self.cfg.enable:
            return {}
        alerts = self.detectors.check(step, values)
        for alert in alerts:
            self.counts[alert.name] += 1
            if self.is_rank0:
                self._report(alert)
        nan = next((alert for alert in alerts if alert.name == "nan"), None)
        if nan is not None and self.cfg.nan_policy == "abort":
            self._abort(nan, values, batch)
        return alert_metrics(alerts)

    def state_dict(self) -> dict:
        return {"detectors": self.detectors.state_dict(), "counts": dict(self.counts)}

    def load_state_dict(self, state: dict) -> None:
        self.detectors.load_state_dict(state["detectors"])
        self.counts.update({name: int(n) for name, n in state["counts"].items()})

    def close(self) -> None:
        """Deliver the webhook posts still queued (the run's end, or an abort)."""
        if self._webhook is not None:
            self._webhook.close()
            self._webhook = None

    def _report(self, alert: Alert) -> None:
        log.warning(alert.line())
        if self._webhook is not None:
            self._webhook.send({"alert": alert.name, "step": alert.step, "message": alert.message,
                                "run": self.run_path.name, "count": self.counts[alert.name]})

    def _abort(self, alert: Alert, values: dict[str, float], batch: Any) -> None:
        folder = self.run_path / "nan_dumps" / f"step_{alert.step}"
        if self.is_rank0 and batch is not None:
            metrics = {k: (v if math.isfinite(v) else str(v)) for k, v in sorted(values.items())}
            dump_batch(batch, folder, {"step": alert.step, "alert": alert.message, "metrics": metrics})
        self.close()
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()  # dump and webhook are done before any rank exits (a launcher then ends the others)
        dumped = f"batch dumped to {folder} (batch.safetensors + batch.json)" if batch is not None else "no batch"
        raise NonFiniteError(f"step {alert.step}: {alert.message}; {dumped}; aborting as alerts.nan_policy='abort' "
                             "(set 'skip' to skip such steps)")
