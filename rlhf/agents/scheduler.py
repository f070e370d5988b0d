"""Turn-batched generation for many agent coroutines on one engine replica, inside the SPMD program.

Every trajectory's agent runs as a coroutine; `ctx.generate` parks its request. When every unfinished
trajectory is parked (the others' tools have returned), all requests go into ONE `engine.generate` call and
each coroutine resumes with its own tokens. Tools run on threads between turns, concurrently across
trajectories; while any runs, the engine waits — `TurnStats` measures that share (`multiturn/engine_idle_share`).
No wall-clock value decides what is generated: batches form only when every trajectory is parked, so the same
seed gives the same tokens. At rollout tp > 1 the TP group's first rank runs the agents and their tools and relays
each batched call's prompts to the other TP ranks (`TpRelay`), so all of them generate from identical prompts.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.distributed as dist

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
                 tool_threads: int = 8, relay: TpRelay | None = None) -> None:
        self.engine, self.params, self.pad_token_id = engine, params, pad_token_id
        self.tool_threads, self.relay = tool_threads, relay
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
        try:
            results = asyncio.run(self._drive(agents))
        finally:
            if self.relay is not None:  # the other TP ranks stop following (also when an agent raised)
                self.relay.stop()
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
        caps_b = torch.tensor([r.max_new_tokens for r in requests], dtype=torch.long)
        prompts = PromptBatch.from_token_lists([r.token_ids for r in requests], pad_token_id=self.pad_token_id,
                                               max_new_tokens_b=caps_b)
        width = int(caps_b.max())
        if self.relay is not None:
            self.relay.send(prompts, width)
        params = turn_params(self.params, width, self.stats.generate_calls)
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
                reason = FinishReason.LENGTH  # an engine that ignores the caps: cut to this request's own
            request.future.set_result(Generation(
                token_ids=rollouts.response_tokens_rt[row, :length].tolist(),
                logprobs=logprobs_rt[row, :length].float().tolist(), finish_reason=reason,
                policy_version=rollouts.policy_version))


def turn_params(params: SamplingParams, max_new_tokens: int, call_index: int) -> SamplingParams:
    """One batched call's sampling: the rollout's, its own width, a seed from the step's seed and the call count."""
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=params.temperature, top_p=params.top_p,
                          top_k=params.top_k, seed=params.seed * 1_000_003 + call_index,
                          stop_token_ids=params.stop_token_ids, ignore_eos=params.ignore_eos)


@dataclass(frozen=True)
class TpRelay:
    """Rollout tp > 1: the TP group's first rank (`src`, a global rank) leads — it runs the agents and tools and
    broadcasts each batched call's prompts, caps and width (int64 tensors); the others follow with the same call."""

    group: dist.ProcessGroup
    src: int

    @classmethod
    def over(cls, group: dist.ProcessGroup | None) -> TpRelay | None:
        """The relay of a rollout TP group (None at tp=1: nothing to relay)."""
        if group is None or dist.get_world_size(group) == 1:
            return None
        return cls(group, dist.get_process_group_ranks(group)[0])

    @property
    def leads(self) -> bool:
        return dist.get_rank() == self.src

    def send(self, prompts: PromptBatch, max_new_tokens: int) -> None:
        num_rows, width = prompts.prompt_tokens_bt.shape
        self._broadcast(torch.tensor([num_rows, width, max_new_tokens], dtype=torch.long))
        self._broadcast(prompts.prompt_tokens_bt.contiguous())
        self._broadcast(prompts.prompt_lengths_b.contiguous())
        self._broadcast(prompts.max_new_tokens_b.contiguous())

    def stop(self) -> None:
        self._broadcast(torch.zeros(3, dtype=torch.long))

    def follow(self, engine: RolloutEngine, params: SamplingParams, pad_token_id: int) -> int:
        """Make every call the leader makes, until it stops; returns the number of calls."""
        calls = 0
        while True:
            header = self._broadcast(torch.zeros(3, dtype=torch.long))
            num_rows, width, max_new_tokens = header.tolist()
            if num_rows == 0:
                return calls
            tokens_bt = self._broadcast(torch.empty(num_rows, width, dtype=torch.long))
            lengths_b = self._broadcast(torch.empty(num_rows, dtype=torch.long))
            caps_b = self._broadcast(torch.empty(num_rows, dtype=torch.long))
            prompts = PromptBatch(prompt_tokens_bt=tokens_bt, prompt_lengths_b=lengths_b, pad_token_id=pad_token_id,
                                  max_new_tokens_b=caps_b)
            engine.generate(prompts, turn_params(params, max_new_tokens, calls))
            calls += 1

    def _broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        dist.broadcast(tensor, self.src, group=self.group)
        return tensor


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.cancelled():  # its caller timed out and moved on
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
