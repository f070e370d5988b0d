"""A remote HTTP JSON reward service: batched POSTs with a timeout, retries with backoff, checked answers.

Request: `{"samples": [{"index", "data_source", "prompt", "response", "ground_truth", "extra_info"}, ...]}`.
Reply: `{"scores": [float, ...]}` in the same order. Connection errors, timeouts, HTTP 429 and 5xx are retried;
other HTTP errors, malformed replies and NaN/inf scores are a `RewardError` naming the sample or batch.
"""

from __future__ import annotations

import http.client
import json
import math
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from rlhf.data.records import PromptRecord
from rlhf.errors import ConfigError, RewardError
from rlhf.rewards.inputs import RewardInputs

RETRIED_STATUSES = frozenset({429, 500, 502, 503, 504})


@dataclass(kw_only=True)
class RemoteRewardConfig:
    """Where the service is and how hard to try: `max_retries` more attempts after the first, the wait
    doubling from `retry_backoff_s`; up to `max_in_flight` batches of `batch_size` are sent at once."""

    url: str
    batch_size: int = 64
    timeout_s: float = 30.0
    max_retries: int = 3
    retry_backoff_s: float = 0.5
    max_in_flight: int = 4

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ConfigError(f"reward.remote.url={self.url!r} must start with http:// or https://")
        for name in ("batch_size", "max_in_flight"):
            if getattr(self, name) < 1:
                raise ConfigError(f"reward.remote.{name}={getattr(self, name)} must be >= 1")
        if self.timeout_s <= 0 or self.max_retries < 0 or self.retry_backoff_s < 0:
            raise ConfigError(f"reward.remote needs timeout_s > 0, max_retries >= 0 and retry_backoff_s >= 0; got "
                              f"{self.timeout_s}, {self.max_retries}, {self.retry_backoff_s}")


class _Retryable(Exception):
    """A failure worth another attempt (the message says what happened)."""


class RemoteReward:
    """Scores batches by POSTing them to the service; same `score` contract as `RuleReward`."""

    def __init__(self, config: RemoteRewardConfig) -> None:
        self.config = config

    def score(self, samples: Sequence[PromptRecord] | RewardInputs, responses: Sequence[str]) -> torch.Tensor:
        """One float32 reward per response (`rewards_b`), each sample sent exactly once per successful call."""
        inputs = samples if isinstance(samples, RewardInputs) else RewardInputs.from_records(samples)
        if len(inputs.data_sources) != len(responses):
            raise RewardError(f"got {len(responses)} responses for {len(inputs.data_sources)} samples")
        size = self.config.batch_size
        starts = range(0, len(responses), size)
        with ThreadPoolExecutor(max_workers=self.config.max_in_flight) as pool:
            batches = pool.map(lambda start: self._score_batch(inputs, responses, start, start + size), starts)
            scores = [score for batch in batches for score in batch]
        return torch.tensor(scores, dtype=torch.float32)

    def _payload(self, inputs: RewardInputs, responses: Sequence[str], start: int, stop: int) -> bytes:
        samples = [{"index": inputs.indices[i], "data_source": inputs.data_sources[i],
                    "prompt": inputs.prompts[i] if inputs.prompts is not None else None, "response": responses[i],
                    "ground_truth": inputs.ground_truths[i], "extra_info": inputs.extra_infos[i]}
                   for i in range(start, min(stop, len(responses)))]
        return json.dumps({"samples": samples}).encode()

    def _score_batch(self, inputs: RewardInputs, responses: Sequence[str], start: int, stop: int) -> list[float]:
        stop = min(stop, len(responses))
        where = f"reward service {self.config.url} for samples {start}-{stop - 1}"
        reply = self._post_with_retries(self._payload(inputs, responses, start, stop), where)
        scores = reply.get("scores") if isinstance(reply, dict) else None
        if not isinstance(scores, list) or len(scores) != stop - start:
            raise RewardError(f"{where} replied without a 'scores' list of {stop - start} numbers")
        for offset, score in enumerate(scores):
            i = start + offset
            if isinstance(score, bool) or not isinstance(score, (int, float)) or not math.isfinite(score):
                raise RewardError(f"reward for sample {i} (index {inputs.indices[i]}, data_source "
                                  f"{inputs.data_sources[i]!r}) from {self.config.url} is {score!r}, "
                                  "not a finite number")
        return [float(score) for score in scores]

    def _post_with_retries(self, body: bytes, where: str) -> Any:
        attempts = self.config.max_retries + 1
        for attempt in range(attempts):
            try:
                return self._post(body, where)
            except _Retryable as error:
                if attempt == attempts - 1:
                    raise RewardError(f"{where} failed after {attempts} attempts: {error}") from None
                time.sleep(self.config.retry_backoff_s * 2 ** attempt)
        raise AssertionError("unreachable")

    def _post(self, body: bytes, where: str) -> Any:
        request = urllib.request.Request(self.config.url, data=body, method="POST",
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.config.timeout_s) as response:
                text = response.read()
        except urllib.error.HTTPError as error:
            detail = " ".join(error.read()[:200].decode(errors="replace").split())
            if error.code in RETRIED_STATUSES:
                raise _Retryable(f"HTTP {error.code} {detail}") from None
            raise RewardError(f"{where} answered HTTP {error.code}: {detail}") from None
        except (urllib.error.URLError, TimeoutError, ConnectionError, http.client.HTTPException) as error:
            raise _Retryable(f"{type(error).__name__}: {getattr(error, 'reason', error)}") from None
        try:
            return json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise RewardError(f"{where} replied with non-JSON: {text[:80]!r}") from None
