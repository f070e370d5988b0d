"""The `multiturn` config section (torch-free): whether rollouts are multi-turn, which agent runs them, the
tools it may call and the limits of one trajectory."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from rlhf.errors import ConfigError


class HistoryPolicy(str, Enum):
    """What a turn does when the chat template's rendering does not extend the tokens the model read."""

    APPEND = "append"  # keep what the model read, append only the new messages' tokens
    FORK = "fork"  # start a new training row holding the template's rendering


@dataclass(frozen=True, kw_only=True)
class TurnLimits:
    """Per-trajectory limits. Tool time counts against `tool_timeout_s` per call and `trajectory_timeout_s` per
    trajectory; generation never does (so the same seed gives the same tokens)."""

    max_turns: int = 4  # assistant turns per trajectory
    max_tool_calls_per_turn: int = 1  # calls beyond it are answered with an error
    max_tool_response_tokens: int = 256  # a tool result is cut to this many tokens
    tool_response_truncation: str = "right"  # right: keep the start of a long tool result; left: keep its end
    token_budget: int = 1024  # prompt + every response and observation token of a row
    tool_timeout_s: float = 10.0  # one tool call's wall-clock limit (then the trajectory ends: tool_timeout)
    trajectory_timeout_s: float = 120.0  # all tool calls of one trajectory together
    tool_retries: int = 1  # retries of a broken tool/environment (not a bad call) before its group is dropped
    history: HistoryPolicy = HistoryPolicy.APPEND  # a template that rewrites history: append or fork
    turn_discount: float = 1.0  # an environment's score: sum over turns t of turn_discount^(t-1) * reward_t

    def __post_init__(self) -> None:
        for name in ("max_turns", "max_tool_calls_per_turn", "max_tool_response_tokens", "token_budget"):
            if getattr(self, name) < 1:
                raise ConfigError(f"multiturn.limits.{name}={getattr(self, name)} must be >= 1")
        for name in ("tool_timeout_s", "trajectory_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"multiturn.limits.{name}={getattr(self, name)} must be > 0")
        if not 0 < self.turn_discount <= 1:
            raise ConfigError(f"multiturn.limits.turn_discount={self.turn_discount} must be in (0, 1] (1: the "
                              "plain sum of the per-turn rewards)")
        if self.tool_retries < 0:
            raise ConfigError(f"multiturn.limits.tool_retries={self.tool_retries} must be >= 0")
        try:  # the config loader hands the enum's value over as its string
            object.__setattr__(self, "history", HistoryPolicy(self.history))
        except ValueError:
            raise ConfigError(f"multiturn.limits.history={self.history!r}: use "
                              f"{' or '.join(p.value for p in HistoryPolicy)}") from None
        if self.tool_response_truncation not in ("left", "right"):
            raise ConfigError(f"multiturn.limits.tool_response_truncation={self.tool_response_truncation!r}: use "
                              "'right' (keep the start) or 'left' (keep the end)")


@dataclass(kw_only=True)
class MultiTurnConfig:
    """Multi-turn rollouts (`enable`): each trajectory runs `agent` — `tools`, the built-in tool loop over the
    tools of `tool_config` (verl's YAML format), or `file.py:function`, an `async def run(ctx, sample)` agent
    function — token-in/token-out, turn-batched on the rollout engine. `list_tools=false` keeps the tool schemas
    out of the prompt (a policy trained to call them without). `sampling.max_new_tokens` caps each turn,
    `limits.token_budget` the whole row. Loss, KL and advantages see only the tokens the policy sampled."""

    enable: bool = False  # multi-turn rollouts instead of one response per sample
    agent: str = "tools"  # tools: the built-in tool loop; or path/to/file.py:function
    tool_config: str = ""  # YAML tool config (tools: [{class_name, config, tool_schema}]); needed by agent=tools
    list_tools: bool = True  # render the tool schemas into the prompt (the chat template's `tools`)
    tool_threads: int = 8  # tool calls running at once on a rollout rank
    # trajectory: one score per trajectory on all its tokens; turn: each turn's tokens scored by its discounted
    # return-to-go (limits.turn_discount), the advantage estimated per (prompt, turn) (rlhf.algo.turn_credit)
    credit: str = "trajectory"
    limits: TurnLimits = field(default_factory=TurnLimits)

    def __post_init__(self) -> None:
        if not self.enable:
            return
        if self.agent == "tools" and not self.tool_config:
            raise ConfigError("multiturn.agent=tools needs multiturn.tool_config (a YAML file listing the tools); "
                              "or set multiturn.agent=path/to/file.py:function for an agent of your own")
        if self.agent != "tools" and ".py:" not in self.agent:
            raise ConfigError(f"multiturn.agent={self.agent!r}: use 'tools' or path/to/file.py:function")
        if self.credit not in ("trajectory", "turn"):
            raise ConfigError(f"multiturn.credit={self.credit!r}: use 'trajectory' (one score per trajectory) or "
                              "'turn' (each turn scored by its discounted return-to-go)")
        if self.tool_threads < 1:
            raise ConfigError(f"multiturn.tool_threads={self.tool_threads} must be >= 1")
