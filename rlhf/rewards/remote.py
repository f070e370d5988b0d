"""A remote HTTP JSON reward service: batched POSTs under a deadline, retries with backoff, checked answers.

Request: `{"samples": [{"index", "data_source", "prompt", "response", "ground_truth", "extra_info"}, ...]}`.
Reply: `{"scores": [float, ...]}` in the same order. Each attempt has one deadline for connect + send + the
full reply (a trickling server cannot stall a step) and a reply-size cap. Connection errors, missed deadlines,
HTTP 429 and 5xx are retried; other HTTP errors, oversized or malformed replies and NaN/inf scores are a
`RewardError` naming the sample or batch.
"""

from __future__ import annotations

import http.client
import json
import math
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from rlhf.data.records import PromptRecord
from rlhf.errors import RewardError
from rlhf.http_post import DeadlineExceeded, DeadlinePost, ReplyTooLarge
from rlhf.rewards.config import RemoteRewardConfig
from rlhf.rewards.inputs import RewardInputs

RETRIED_STATUSES = frozenset({429, 500, 502, 503, 504})


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
        """One attempt under one deadline (`rlhf.http_post`)."""
        post = DeadlinePost(self.config.url, body, timeout_s=self.config.timeout_s,
                            max_reply_bytes=self.config.max_reply_bytes)
        try:
            reply = post.send()
        except DeadlineExceeded:
            raise _Retryable(self._missed_deadline()) from None
        except ReplyTooLarge:
            raise RewardError(f"{where} replied with more than reward.remote.max_reply_bytes="
                              f"{self.config.max_reply_bytes} bytes; raise the cap or lower reward.remote.batch_size"
                              ) from None
        except (OSError, http.client.HTTPException) as error:
            raise _Retryable(f"{type(error).__name__}: {error}") from None
        if reply.status >= 400:
            detail = " ".join(reply.body[:200].decode(errors="replace").split())
            if reply.status in RETRIED_STATUSES:
                raise _Retryable(f"HTTP {reply.status} {detail}")
            raise RewardError(f"{where} answered HTTP {reply.status}: {detail}")
        try:
            return json.loads(reply.body)
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise RewardError(f"{where} replied with non-JSON: {reply.body[:80]!r}") from None

    def _missed_deadline(self) -> str:
        return f"no full reply within reward.remote.timeout_s={self.config.timeout_s:g}s"

