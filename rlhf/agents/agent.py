"""Agent functions and the built-in tool loop.

An agent function is `async def run(ctx: AgentContext, sample: PromptRecord) -> Trajectory`. `ctx.generate`
is token-in/token-out; `ctx.next_prompt` renders only the new messages and runs the prefix check; `ctx.call_tool`
runs a tool in the pool with its timeout and retry budget. `tool_agent` is the loop most users want: generate,
parse `<tool_call>`s on the sampled ids, run the tools, append their results as `tool` messages, until the
policy answers without a call or a limit ends it. `environment_agent` wraps a gym-style environment the same way.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from rlhf.agents.config import TurnLimits
from rlhf.agents.render import ChatRenderer, Messages
from rlhf.agents.scheduler import Generation, TurnBatcher
from rlhf.agents.tool_calls import ToolCall, ToolCallParser
from rlhf.agents.tools import ToolBox, ToolError, ToolTimeout
from rlhf.agents.trajectory import Termination, Trajectory, TrajectoryBuilder
from rlhf.data.records import PromptRecord
from rlhf.rollout.types import FinishReason


class InfrastructureFailure(RuntimeError):
    """A tool or environment failed past its retry budget: its whole group is dropped from the batch."""


@dataclass
class AgentContext:
    """What an agent function sees of the rollout: generation, rendering, tools, limits."""

    batcher: TurnBatcher
    renderer: ChatRenderer
    limits: TurnLimits
    toolbox: ToolBox | None = None
    parser: ToolCallParser | None = None
    trace: dict[str, Any] = field(default_factory=lambda: {"tool_calls": 0, "tool_errors": 0, "mismatches": 0,
                                                           "tool_latency_s": 0.0})

    async def generate(self, token_ids: list[int], max_new_tokens: int) -> Generation:
        """At most `max_new_tokens`, the sampling's max_new_tokens and what the row's token budget leaves."""
        room = self.limits.token_budget - len(token_ids)
        if room < 1:
            raise ValueError(f"ctx.generate: {len(token_ids)} tokens already fill multiturn.limits.token_budget="
                             f"{self.limits.token_budget}; end the trajectory (Termination.TOKEN_BUDGET) instead")
        return await self.batcher.generate(token_ids, min(max_new_tokens, room))

    async def call_tool(self, call: ToolCall, sample_kwargs: dict[str, Any]) -> str:
        """The text the model reads back; ToolTimeout propagates (it ends the trajectory), a ToolError is text."""
        if call.error is not None:
            self.trace["tool_errors"] += 1
            return f"error: {call.error}"
        self.trace["tool_calls"] += 1
        for attempt in range(self.limits.tool_retries + 1):
            # the trajectory's own budget of tool time (generation never counts: it does not depend on it)
            timeout_s = min(self.limits.tool_timeout_s,
                            self.limits.trajectory_timeout_s - self.trace["tool_latency_s"])
            try:
                started = asyncio.get_running_loop().time()
                try:
                    return await asyncio.wait_for(self.batcher.in_thread(
                        self.toolbox.call, call.name, call.arguments, sample_kwargs), max(timeout_s, 0.0))
                finally:
                    self.trace["tool_latency_s"] += asyncio.get_running_loop().time() - started
            except asyncio.TimeoutError:
                raise ToolTimeout(f"{call.name}: no result within {timeout_s:g} s") from None
            except ToolTimeout:
                raise
            except ToolError as error:
                self.trace["tool_errors"] += 1
                return f"error: {error}"
            except Exception as error:  # a broken tool, not a bad call: retry, then give the group up
                if attempt == self.limits.tool_retries:
                    raise InfrastructureFailure(f"tool {call.name!r} failed {attempt + 1} times: "
                                                f"{type(error).__name__}: {error}") from error
        raise AssertionError("unreachable")

    def truncate(self, text: str) -> str:
        """A tool result cut to `max_tool_response_tokens` tokens on the configured side."""
        ids = self.renderer.encode(text)
        limit = self.limits.max_tool_response_tokens
        if len(ids) <= limit:
            return text
        kept = ids[:limit] if self.limits.tool_response_truncation == "right" else ids[-limit:]
        return self.renderer.tokenizer.decode(kept) + ("..." if self.limits.tool_response_truncation == "right"
                                                       else "")

    def advance(self, builder: TrajectoryBuilder, messages: Messages, new_messages: Messages) -> None:
        """Append the new messages' tokens (or fork) after the prefix check."""
        messages += new_messages
        nxt = self.renderer.next_prompt(builder.tokens, messages, new_messages, self.limits.history)
        self.trace["mismatches"] += int(nxt.mismatch)
        if nxt.fork:
            builder.fork(nxt.tokens)
        else:
            builder.add_observation(nxt.tokens[len(builder.tokens):])

    def finish(self, builder: TrajectoryBuilder, termination: Termination, num_turns: int, **extra) -> Trajectory:
        return builder.finish(termination, num_turns=num_turns, num_tool_calls=self.trace["tool_calls"],
                              num_tool_errors=self.trace["tool_errors"], prefix_mismatches=self.trace["mismatches"],
                              tool_latency_s=self.trace["tool_latency_s"], **extra)


def _assistant_text(ctx: AgentContext, generation: Generation) -> str:
    """The turn's text as the next canonical rendering's assistant message (its stop token left out)."""
    ids = generation.token_ids
    if generation.finish_reason is FinishReason.STOP and ids:
        ids = ids[:-1]
    return ctx.renderer.tokenizer.decode(ids)


def _messages(sample: PromptRecord) -> Messages:
    prompt = sample.prompt
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]


async def tool_agent(ctx: AgentContext, sample: PromptRecord) -> Trajectory:
    """The built-in tool loop (verl's tool agent loop, token-in/token-out)."""
    messages = _messages(sample)
    builder = TrajectoryBuilder(prompt=ctx.renderer.prompt(messages), token_budget=ctx.limits.token_budget)
    sample_kwargs = sample.extra_info.get("tools_kwargs", {}) if isinstance(sample.extra_info, dict) else {}
    for turn in range(1, ctx.limits.max_turns + 1):
        if builder.budget_left < 1:
            return ctx.finish(builder, Termination.TOKEN_BUDGET, turn - 1)
        generation = await ctx.generate(builder.tokens, builder.budget_left)
        builder.add_sampled(generation.token_ids, generation.logprobs, generation.policy_version)
        if generation.finish_reason is FinishReason.LENGTH:
            reason = Termination.TOKEN_BUDGET if builder.budget_left < 1 else Termination.LENGTH
            return ctx.finish(builder, reason, turn)
        calls = ctx.parser.parse(generation.token_ids, ctx.limits.max_tool_calls_per_turn) if ctx.parser else []
        if not calls:
            return ctx.finish(builder, Termination.STOP, turn)
        if turn == ctx.limits.max_turns:
            return ctx.finish(builder, Termination.MAX_TURNS, turn)
        try:
            results = await asyncio.gather(*(ctx.call_tool(call, sample_kwargs) for call in calls))
        except ToolTimeout:
            return ctx.finish(builder, Termination.TOOL_TIMEOUT, turn)
        messages.append({"role": "assistant", "content": _assistant_text(ctx, generation)})
        ctx.advance(builder, messages, [{"role": "tool", "content": ctx.truncate(text)} for text in results])
    raise AssertionError("unreachable: the last turn returns")


class Environment(Protocol):
    """A gym-style environment: text observations, the policy's text actions."""

    def reset(self, sample: PromptRecord) -> str: ...

    def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]: ...


async def environment_agent(ctx: AgentContext, sample: PromptRecord,
                            make_env: Callable[[], Environment]) -> Trajectory:
    """The tool loop with an environment in place of tools: each action is stepped, its observation becomes
    the next user turn; the score is the per-turn rewards' sum discounted by `limits.turn_discount`."""
    env = await _with_retries(ctx, lambda fresh: fresh.reset(sample), make_env)
    environment, observation = env
    messages = _messages(sample) + [{"role": "user", "content": observation}] if observation else _messages(sample)
    builder = TrajectoryBuilder(prompt=ctx.renderer.prompt(messages), token_budget=ctx.limits.token_budget)
    rewards: list[float] = []

    def end(reason: Termination, num_turns: int) -> Trajectory:
        discounted = sum(reward * ctx.limits.turn_discount ** turn for turn, reward in enumerate(rewards))
        return ctx.finish(builder, reason, num_turns, reward=discounted, turn_rewards=tuple(rewards))

    for turn in range(1, ctx.limits.max_turns + 1):
        if builder.budget_left < 1:
            return end(Termination.TOKEN_BUDGET, turn - 1)
        generation = await ctx.generate(builder.tokens, builder.budget_left)
        builder.add_sampled(generation.token_ids, generation.logprobs, generation.policy_version)
        action = _assistant_text(ctx, generation)
        try:
            observation, reward, done, _ = await asyncio.wait_for(
                ctx.batcher.in_thread(environment.step, action), ctx.limits.tool_timeout_s)
        except asyncio.TimeoutError:
            return end(Termination.TOOL_TIMEOUT, turn)
        except Exception as error:
            raise InfrastructureFailure(f"environment step failed: {type(error).__name__}: {error}") from error
        rewards.append(float(reward))
        if done or generation.finish_reason is FinishReason.LENGTH or turn == ctx.limits.max_turns:
            reason = (Termination.ENV_DONE if done else Termination.LENGTH
                      if generation.finish_reason is FinishReason.LENGTH else Termination.MAX_TURNS)
            return end(reason, turn)
        messages.append({"role": "assistant", "content": action})
        ctx.advance(builder, messages, [{"role": "user", "content": ctx.truncate(observation)}])
    raise AssertionError("unreachable: the last turn returns")


async def _with_retries(ctx: AgentContext, start: Callable[[Environment], str],
                        make_env: Callable[[], Environment]) -> tuple[Environment, str]:
    """A fresh environment reset, retried up to the budget; past it the group is given up."""
    for attempt in range(ctx.limits.tool_retries + 1):
        environment = make_env()
        try:
            return environment, await ctx.batcher.in_thread(start, environment)
        except Exception as error:
            if attempt == ctx.limits.tool_retries:
                raise InfrastructureFailure(f"environment reset failed {attempt + 1} times: "
                                            f"{type(error).__name__}: {error}") from error
    raise AssertionError("unreachable")


AgentFunction = Callable[[AgentContext, PromptRecord], Awaitable[Trajectory]]
