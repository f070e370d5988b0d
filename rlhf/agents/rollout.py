"""A multi-turn rollout call: n trajectories per prompt, run by the agent function on one engine replica with
turn-batched generation; a group whose tool or environment broke past its retry budget is dropped whole."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from rlhf.agents.agent import AgentContext, AgentFunction, InfrastructureFailure, tool_agent
from rlhf.agents.config import TurnLimits
from rlhf.agents.render import ChatRenderer
from rlhf.agents.scheduler import TurnBatcher, TurnStats
from rlhf.agents.tool_calls import ToolCallParser
from rlhf.agents.tools import ToolBox
from rlhf.agents.trajectory import Trajectory
from rlhf.data.records import PromptRecord
from rlhf.rollout.engine import RolloutEngine
from rlhf.rollout.sampling_params import SamplingParams


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

    @property
    def kept(self) -> list[GroupResult]:
        return [group for group in self.groups if group.dropped is None]


class MultiTurnRollout:
    """Everything a rollout rank needs to run agents: tokenizer, tools, limits, the agent function."""

    def __init__(self, tokenizer: Any, limits: TurnLimits, toolbox: ToolBox | None = None,
                 agent: AgentFunction = tool_agent, tool_threads: int = 8, list_tools: bool = True) -> None:
        """`list_tools=False` keeps the tool schemas out of the prompt (a policy trained to call them without)."""
        self.tokenizer, self.limits, self.toolbox, self.agent = tokenizer, limits, toolbox, agent
        self.renderer = ChatRenderer(tokenizer, tools=toolbox.schemas if toolbox and list_tools else None)
        self.parser = ToolCallParser(tokenizer) if toolbox else None
        self.tool_threads = tool_threads

    def collect(self, engine: RolloutEngine, records: list[PromptRecord], params: SamplingParams,
                pad_token_id: int) -> MultiTurnResult:
        """`params.n` trajectories per record (consecutive), turn-batched on `engine`."""
        batcher = TurnBatcher(engine, params, pad_token_id, tool_threads=self.tool_threads)
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
