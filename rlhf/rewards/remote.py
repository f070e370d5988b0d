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
import socket
import threading
import time
import urllib.parse
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from rlhf.data.records import PromptRecord
from rlhf.errors import RewardError
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
        """One attempt: a timer cuts the connection at the deadline, whatever phase it is in."""
        url = urllib.parse.urlsplit(self.config.url)
        connection_type = http.client.HTTPSConnection if url.scheme == "https" else http.client.HTTPConnection
        connection = connection_type(url.hostname, url.port, timeout=self.config.timeout_s)
        expired = threading.Event()
        timer = threading.Timer(self.config.timeout_s, _cut, args=(connection, expired))
        timer.start()
        try:
            target = (url.path or "/") + (f"?{url.query}" if url.query else "")
            connection.request("POST", target, body=body, headers={"Content-Type": "application/json"})
            response = connection.getresponse()
            text = self._read_capped(response, where)
        except (OSError, http.client.HTTPException) as error:
            # the socket's own per-operation timeout (also timeout_s) may fire before the timer on a busy host
            if expired.is_set() or isinstance(error, TimeoutError):
                raise _Retryable(self._missed_deadline()) from None
            raise _Retryable(f"{type(error).__name__}: {error}") from None
        finally:
            timer.cancel()
            connection.close()
        if expired.is_set():
            raise _Retryable(self._missed_deadline())
        if response.status >= 400:
            detail = " ".join(text[:200].decode(errors="replace").split())
            if response.status in RETRIED_STATUSES:
                raise _Retryable(f"HTTP {response.status} {detail}")
            raise RewardError(f"{where} answered HTTP {response.status}: {detail}")
        try:
            return json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise RewardError(f"{where} replied with non-JSON: {text[:80]!r}") from None

    def _read_capped(self, response: http.client.HTTPResponse, where: str) -> bytes:
        limit = self.config.max_reply_bytes
        chunks, size = [], 0
        while chunk := response.read1(65536):
            size += len(chunk)
            if size > limit:
                raise RewardError(f"{where} replied with more than reward.remote.max_reply_bytes={limit} bytes; "
                                  "raise the cap or lower reward.remote.batch_size")
            chunks.append(chunk)
        return b"".join(chunks)

    def _missed_deadline(self) -> str:
        return f"no full reply within reward.remote.timeout_s={self.config.timeout_s:g}s"


def _cut(connection: http.client.HTTPConnection, expired: threading.Event) -> None:
    """Deadline reached: shut the socket down so the blocked connect/send/read returns at once."""
    expired.set()
    sock = connection.sock
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
