"""Turn-batched generation for many agent coroutines on one engine replica, inside the SPMD program.

Every trajectory's agent runs as a coroutine; `ctx.generate` parks its request. When every unfinished
trajectory is parked (the others' tools have returned), all requests go into ONE `engine.generate` call and
each coroutine resumes with its own tokens. Tools run on threads between turns, concurrently across
trajectories; while any runs, the engine waits — `TurnStats` measures that share (`multiturn/engine_idle_share`).
No wall-clock value decides what is generated: batches form only when every trajectory is parked, so the same
seed gives the same tokens.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from rlhf.rollout.engine import RolloutEngine
from rlhf.rollout.sampling_params import SamplingParams
from rlhf.rollout.types import FinishReason, PromptBatch

T = TypeVar("T")


@dataclass(frozen=True)
class Generation:
    """One turn's sampled tokens (token-out): ids, their logprobs, why it stopped, the sampling policy version."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    policy_version: int


@dataclass
class TurnStats:
    """Wall-clock split of a rollout's multi-turn phase (reported, never used to decide anything)."""

    generate_calls: int = 0
    generate_s: float = 0.0
    total_s: float = 0.0
    rows_per_call: list[int] = field(default_factory=list)

    @property
    def engine_idle_share(self) -> float:
        """Share of the phase's time the engine was not generating (tools, rendering, scheduling)."""
        return 1.0 - self.generate_s / self.total_s if self.total_s > 0 else 0.0


@dataclass
class _Request:
    token_ids: list[int]
    max_new_tokens: int
    future: asyncio.Future


class TurnBatcher:
    """Runs agent coroutines to completion with batched generation; one per rollout call."""

    def __init__(self, engine: RolloutEngine, params: SamplingParams, pad_token_id: int,
                 tool_threads: int = 8) -> None:
        self.engine, self.params, self.pad_token_id = engine, params, pad_token_id
        self.tool_threads = tool_threads
        self.stats = TurnStats()
        self._pending: list[_Request] = []
        self._active = 0
        self._wake: asyncio.Event | None = None
        self._slots: asyncio.Semaphore | None = None

    async def generate(self, token_ids: list[int], max_new_tokens: int) -> Generation:
        """Park a request for the next batched call (at most the sampling's max_new_tokens)."""
        future = asyncio.get_running_loop().create_future()
        self._pending.append(_Request(list(token_ids), min(max_new_tokens, self.params.max_new_tokens), future))
        self._wake.set()
        return await future

    async def in_thread(self, fn: Callable[..., T], *args: Any) -> T:
        """Run blocking work (a tool call) on a daemon thread while other trajectories go on (at most
        `tool_threads` at once). A call abandoned at its timeout keeps its thread but never blocks the exit."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def work() -> None:
            try:
                outcome = (fn(*args), None)
            except BaseException as error:  # handed to the awaiting coroutine
                outcome = (None, error)
            try:
                loop.call_soon_threadsafe(_settle, future, *outcome)
            except RuntimeError:  # an abandoned call outlived the rollout's event loop: nobody waits for it
                pass

        async with self._slots:
            threading.Thread(target=work, name="rlhf-tool", daemon=True).start()
            return await future

    def run(self, agents: Sequence[Callable[[], Awaitable[T]]]) -> list[T]:
        """Each agent's result, in order."""
        started = time.perf_counter()
        results = asyncio.run(self._drive(agents))
        self.stats.total_s += time.perf_counter() - started
        return results

    async def _drive(self, agents: Sequence[Callable[[], Awaitable[T]]]) -> list[T]:
        self._wake, self._slots = asyncio.Event(), asyncio.Semaphore(self.tool_threads)
        tasks = [asyncio.ensure_future(agent()) for agent in agents]
        self._active = len(tasks)
        for task in tasks:
            task.add_done_callback(self._finished)
        while self._active:
            await self._wake.wait()
            self._wake.clear()
            failed = next((task for task in tasks if task.done() and task.exception() is not None), None)
            if failed is not None:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                raise failed.exception()
            if self._pending and len(self._pending) == self._active:
                self._flush()
        return [task.result() for task in tasks]

    def _finished(self, task: asyncio.Task) -> None:
        self._active -= 1
        self._wake.set()

    def _flush(self) -> None:
        """Every parked request in one generate call (the call's seed is the step's seed and the call count)."""
        requests, self._pending = self._pending, []
        prompts = PromptBatch.from_token_lists([r.token_ids for r in requests], pad_token_id=self.pad_token_id)
        width = max(r.max_new_tokens for r in requests)
        params = SamplingParams(max_new_tokens=width, temperature=self.params.temperature, top_p=self.params.top_p,
                                top_k=self.params.top_k, seed=self.params.seed * 1_000_003 + self.stats.generate_calls,
                                stop_token_ids=self.params.stop_token_ids, ignore_eos=self.params.ignore_eos)
        started = time.perf_counter()
        rollouts = self.engine.generate(prompts, params)
        self.stats.generate_s += time.perf_counter() - started
        self.stats.generate_calls += 1
        self.stats.rows_per_call.append(len(requests))
        scaled = rollouts.response_scaled_logprobs_rt
        logprobs_rt = scaled if scaled is not None else rollouts.response_logprobs_rt
        for row, request in enumerate(requests):
            length = min(int(rollouts.response_lengths_r[row]), request.max_new_tokens)
            reason = rollouts.finish_reasons[row]
            if length < int(rollouts.response_lengths_r[row]):
                reason = FinishReason.LENGTH  # cut to this request's own budget
            request.future.set_result(Generation(
                token_ids=rollouts.response_tokens_rt[row, :length].tolist(),
                logprobs=logprobs_rt[row, :length].float().tolist(), finish_reason=reason,
                policy_version=rollouts.policy_version))


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.cancelled():  # its caller timed out and moved on
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
