"""A multi-turn rollout call: n trajectories per prompt, run by the agent function on one engine replica with
turn-batched generation; a group whose tool or environment broke past its retry budget is dropped whole. At
rollout tp > 1 only the TP group's first rank runs agents; the others follow its engine calls."""

from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass
from typing import Any

from rlhf.agents.agent import AgentContext, AgentFunction, InfrastructureFailure, tool_agent
from rlhf.agents.config import MultiTurnConfig, TurnLimits
from rlhf.agents.render import ChatRenderer
from rlhf.agents.scheduler import TpRelay, TurnBatcher, TurnStats
from rlhf.agents.tool_calls import ToolCallParser
from rlhf.agents.tools import ToolBox, load_toolbox
from rlhf.agents.trajectory import Termination, Trajectory
from rlhf.data.records import PromptRecord
from rlhf.rollout.engine import RolloutEngine
from rlhf.rollout.sampling_params import SamplingParams


TOTALS = ("multiturn/prefix_mismatch", "multiturn/dropped_groups")  # counts of the batch: summed over replicas


@dataclass(frozen=True)
class GroupResult:
    """One prompt's n trajectories, or why the group was dropped."""

    record: PromptRecord
    trajectories: tuple[Trajectory, ...]
    dropped: str | None = None


@dataclass(frozen=True)
class MultiTurnResult:
    groups: tuple[GroupResult, ...]
    stats: TurnStats

    @classmethod
    def merged(cls, results: list[MultiTurnResult]) -> MultiTurnResult:
        """One step's rollout calls (DAPO's generation rounds) as one result: their groups and summed timings."""
        stats = TurnStats(generate_calls=sum(r.stats.generate_calls for r in results),
                          generate_s=sum(r.stats.generate_s for r in results),
                          total_s=sum(r.stats.total_s for r in results),
                          rows_per_call=[rows for r in results for rows in r.stats.rows_per_call])
        return cls(tuple(group for r in results for group in r.groups), stats)

    @property
    def kept(self) -> list[GroupResult]:
        return [group for group in self.groups if group.dropped is None]

    def metrics(self) -> dict[str, float]:
        """`multiturn/*`: turns, tool calls and errors, forks, prefix mismatches, terminations, dropped groups,
        and the share of the phase the engine sat idle (tools, rendering)."""
        trajectories = [t for group in self.kept for t in group.trajectories]
        count = max(len(trajectories), 1)
        calls = sum(t.num_tool_calls for t in trajectories)
        metrics = {
            "multiturn/turns_mean": sum(t.num_turns for t in trajectories) / count,
            "multiturn/tool_calls_mean": calls / count,
            "multiturn/tool_errors_mean": sum(t.num_tool_errors for t in trajectories) / count,
            "multiturn/forks_mean": sum(t.num_forks for t in trajectories) / count,
            "multiturn/prefix_mismatch": float(sum(t.prefix_mismatches for t in trajectories)),
            "multiturn/dropped_groups": float(sum(group.dropped is not None for group in self.groups)),
            "multiturn/tool_latency_s_mean": sum(t.tool_latency_s for t in trajectories) / count,
            "multiturn/engine_idle_share": self.stats.engine_idle_share,
            "multiturn/generate_calls": float(self.stats.generate_calls),
        }
        ends = Counter(t.termination for t in trajectories)
        for termination in Termination:
            metrics[f"multiturn/termination/{termination.value}"] = ends[termination] / count
        return metrics


class MultiTurnRollout:
    """Everything a rollout rank needs to run agents: tokenizer, tools, limits, the agent function."""

    def __init__(self, tokenizer: Any, limits: TurnLimits, toolbox: ToolBox | None = None,
                 agent: AgentFunction = tool_agent, tool_threads: int = 8, list_tools: bool = True,
                 relay: TpRelay | None = None, credit: str = "trajectory") -> None:
        """`list_tools=False` keeps the tool schemas out of the prompt (a policy trained to call them without);
        `relay` is the rollout TP group's (None at tp=1); `credit` is `MultiTurnConfig.credit`."""
        self.tokenizer, self.limits, self.toolbox, self.agent = tokenizer, limits, toolbox, agent
        self.credit = credit
        self.relay = relay
        self.renderer = ChatRenderer(tokenizer, tools=toolbox.schemas if toolbox and list_tools else None)
        self.parser = ToolCallParser(tokenizer) if toolbox else None
        self.tool_threads = tool_threads

    @classmethod
    def from_config(cls, config: MultiTurnConfig, tokenizer: Any, relay: TpRelay | None = None) -> "MultiTurnRollout":
        from rlhf.rewards.user_fn import load_user_function

        toolbox = load_toolbox(config.tool_config) if config.tool_config else None
        agent = tool_agent if config.agent == "tools" else load_user_function(config.agent, "multiturn.agent")
        return cls(tokenizer, config.limits, toolbox, agent, tool_threads=config.tool_threads,
                   list_tools=config.list_tools, relay=relay, credit=config.credit)

    def final_texts(self, result: MultiTurnResult) -> list[tuple[PromptRecord, str]]:
        """(record, the last turn's text) of every kept trajectory, in row-group order (what a rule reward
        scores)."""
        return [(group.record, self.tokenizer.decode(list(t.final_turn), skip_special_tokens=True))
                for group in result.kept for t in group.trajectories]

    def collect(self, engine: RolloutEngine, records: list[PromptRecord], params: SamplingParams,
                pad_token_id: int) -> MultiTurnResult | None:
        """`params.n` trajectories per record (consecutive), turn-batched on `engine`; None on a TP rank that
        follows its leader's engine calls (it holds no trajectories)."""
        if self.relay is not None and not self.relay.leads:
            self.relay.follow(engine, params, pad_token_id)
            return None
        batcher = TurnBatcher(engine, params, pad_token_id, tool_threads=self.tool_threads, relay=self.relay)
        agents = [functools.partial(self._one, batcher, record) for record in records for _ in range(params.n)]
        outcomes = batcher.run(agents)
        groups = []
        for index, record in enumerate(records):
            own = outcomes[index * params.n:(index + 1) * params.n]
            failure = next((o for o in own if isinstance(o, InfrastructureFailure)), None)
            groups.append(GroupResult(record, () if failure else tuple(own),
                                      dropped=str(failure) if failure else None))
        return MultiTurnResult(tuple(groups), batcher.stats)

    async def _one(self, batcher: TurnBatcher, record: PromptRecord) -> Trajectory | InfrastructureFailure:
        ctx = AgentContext(batcher=batcher, renderer=self.renderer, limits=self.limits, toolbox=self.toolbox,
                           parser=self.parser)
        try:
            return await self.agent(ctx, record)
        except InfrastructureFailure as failure:
            return failure
