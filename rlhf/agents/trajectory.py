"""The token record of one multi-turn rollout, built turn by turn and frozen when it ends.

A trajectory is one or more training rows. A row is a token sequence whose loss mask is 1 exactly on tokens the
policy sampled (prompt, tool output and template tokens are 0, also inside the response: interior zeros); each
sampled token keeps the logprob and policy version it was sampled with. A new row starts only when the chat
template rewrote history (`render.HistoryPolicy.FORK`): the new row holds what the model read next; all rows of a
trajectory share its rollout id, reward and (in GRPO) advantage.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from rlhf.errors import ConfigError


class Termination(str, Enum):
    """Why a trajectory ended (reported per trajectory in metrics and dumps)."""

    STOP = "stop"  # the policy answered without a tool call
    LENGTH = "length"  # a turn hit its max_new_tokens without a stop token
    MAX_TURNS = "max_turns"
    TOKEN_BUDGET = "token_budget"  # the trajectory's token budget is spent
    TOOL_TIMEOUT = "tool_timeout"
    ENV_DONE = "env_done"  # the environment said done
    ENV_ERROR = "env_error"  # a tool or environment failed past its retry budget


@dataclass(frozen=True, kw_only=True)
class Row:
    """One training row: `tokens` is what the model read and wrote; `prompt_length` tokens come first."""

    tokens: tuple[int, ...]
    prompt_length: int
    loss_mask: tuple[int, ...]  # per response token (tokens[prompt_length:]): 1 = policy-sampled
    logprobs: tuple[float, ...]  # per response token, 0.0 where loss_mask is 0
    versions: tuple[int, ...]  # per response token: the policy version that sampled it, 0 where not sampled

    @property
    def response(self) -> tuple[int, ...]:
        return self.tokens[self.prompt_length:]

    @property
    def num_sampled(self) -> int:
        return sum(self.loss_mask)


@dataclass(frozen=True, kw_only=True)
class Trajectory:
    """A finished rollout: its rows, why it ended, and its per-turn trace."""

    rows: tuple[Row, ...]
    termination: Termination
    num_turns: int
    final_turn: tuple[int, ...] = ()  # the last turn's sampled tokens (what a rule reward scores)
    num_tool_calls: int = 0
    num_tool_errors: int = 0
    prefix_mismatches: int = 0  # turns where the template's rendering did not extend what the model had read
    tool_latency_s: float = 0.0
    reward: float | None = None  # an environment's accumulated reward (None: the scorer decides)
    turn_rewards: tuple[float, ...] = ()

    @property
    def num_forks(self) -> int:
        return len(self.rows) - 1


@dataclass
class TrajectoryBuilder:
    """Accumulates one rollout's tokens while its turns run (the only mutable piece; `finish` freezes it)."""

    prompt: list[int]
    token_budget: int  # prompt + every response and observation token of the current row
    rows: list[Row] = field(default_factory=list)
    response: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    last_sampled: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.prompt:
            raise ConfigError("a trajectory needs a non-empty prompt")

    @property
    def tokens(self) -> list[int]:
        """Everything the model has read so far in the current row (the next turn's prompt starts with it)."""
        return self.prompt + self.response

    @property
    def budget_left(self) -> int:
        return self.token_budget - len(self.prompt) - len(self.response)

    def add_sampled(self, token_ids: list[int], logprobs: list[float], version: int) -> None:
        assert len(token_ids) == len(logprobs), (len(token_ids), len(logprobs))
        self.last_sampled = list(token_ids)
        self.response += token_ids
        self.mask += [1] * len(token_ids)
        self.logprobs += [float(lp) for lp in logprobs]
        self.versions += [version] * len(token_ids)

    def add_observation(self, token_ids: list[int]) -> None:
        """Tokens the model reads but did not sample (tool output, user turns, template markers), cut to what the
        row's token budget leaves: a row never outgrows `token_budget` (packing budgets are sized by it), and the
        cut tail is never read (nothing is generated after it: the trajectory ends on its budget)."""
        token_ids = token_ids[:max(self.budget_left, 0)]
        self.response += token_ids
        self.mask += [0] * len(token_ids)
        self.logprobs += [0.0] * len(token_ids)
        self.versions += [0] * len(token_ids)

    def fork(self, prompt: list[int]) -> None:
        """Close the current row and start one whose prompt is `prompt` (the template's rewritten history)."""
        self.rows.append(self._row())
        self.prompt, self.response, self.mask, self.logprobs, self.versions = list(prompt), [], [], [], []

    def _row(self) -> Row:
        return Row(tokens=tuple(self.tokens), prompt_length=len(self.prompt), loss_mask=tuple(self.mask),
                   logprobs=tuple(self.logprobs), versions=tuple(self.versions))

    def finish(self, termination: Termination, **trace) -> Trajectory:
        """The frozen trajectory; a last row with nothing sampled (a fork right before the end) is dropped."""
        rows = self.rows + [self._row()]
        rows = [row for row in rows if row.num_sampled] or rows[:1]
        return Trajectory(rows=tuple(rows), termination=termination, final_turn=tuple(self.last_sampled), **trace)
