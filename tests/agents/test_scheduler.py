"""Turn batching at rollout tp > 1 (2 gloo ranks as one TP group): only the group's first rank runs agents and
tools; every batched call's prompts reach the other rank, whose engine makes the same calls on identical prompts
even where its tools would have answered differently."""

import torch.distributed as dist

from rlhf.agents.config import TurnLimits
from rlhf.agents.rollout import MultiTurnRollout
from rlhf.agents.scheduler import TpRelay
from rlhf.agents.tools import Calculator
from rlhf.data.char_tokenizer import build_chat_char_tokenizer
from rlhf.rollout.sampling_params import SamplingParams
from rlhf.testing.distributed import run_distributed
from tests.agents.scripted import CALL, ScriptedEngine, record, toolbox


class RecordingEngine(ScriptedEngine):
    def __init__(self, tokenizer, script):
        super().__init__(tokenizer, script)
        self.prompts, self.seeds = [], []

    def generate(self, prompts, params):
        self.prompts.append([prompts.prompt(i) for i in range(prompts.num_prompts)])
        self.seeds.append((params.seed, params.max_new_tokens))
        return super().generate(prompts, params)


class RankCalculator(Calculator):
    """A calculator whose answer depends on the rank it runs on (as a tool reading a rank-local state would)."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def call(self, arguments, **kwargs):
        self.calls += 1
        return str(int(super().call(arguments)) + 1000 * dist.get_rank())


async def broken_agent(ctx, sample):
    await ctx.generate(ctx.renderer.prompt(list(sample.prompt)), 4)
    raise RuntimeError("agent bug")


def _collect(relayed):
    tokenizer = build_chat_char_tokenizer()
    script = {"12*30?": [CALL % ("calculator", "12*30"), "360"], "2+2?": ["4"]}
    engine, tool = RecordingEngine(tokenizer, script), RankCalculator()
    relay = TpRelay.over(dist.group.WORLD) if relayed else None
    rollout = MultiTurnRollout(tokenizer, TurnLimits(), toolbox(calculator=tool), relay=relay)
    result = rollout.collect(engine, [record("12*30?"), record("2+2?", 1)],
                             SamplingParams(max_new_tokens=64, n=2, seed=5), pad_token_id=0)
    rows = None if result is None else [tokenizer.decode(t.rows[0].tokens) for g in result.groups
                                        for t in g.trajectories]
    return {"prompts": engine.prompts, "seeds": engine.seeds, "tool_calls": tool.calls, "rows": rows}


def _world():
    out = {"relayed": _collect(True), "unrelayed": _collect(False)}
    tokenizer = build_chat_char_tokenizer()
    engine = RecordingEngine(tokenizer, {"q": ["x"]})
    rollout = MultiTurnRollout(tokenizer, TurnLimits(), agent=broken_agent, relay=TpRelay.over(dist.group.WORLD))
    try:
        out["broken"] = rollout.collect(engine, [record("q")], SamplingParams(max_new_tokens=4), pad_token_id=0)
    except RuntimeError as error:
        out["broken"] = str(error)
    out["broken_calls"] = len(engine.prompts)
    return out


def test_tp_followers_generate_from_the_leaders_prompts():
    leader, follower = run_distributed(_world, 2, timeout_s=120)
    relayed = leader["relayed"]
    assert relayed["prompts"] == follower["relayed"]["prompts"] and len(relayed["prompts"]) == 2
    assert relayed["seeds"] == follower["relayed"]["seeds"]
    assert [len(call) for call in relayed["prompts"]] == [4, 2]
    assert (relayed["tool_calls"], follower["relayed"]["tool_calls"]) == (2, 0)  # tools on the leader only
    assert follower["relayed"]["rows"] is None
    assert all("<|im_start|>tool\n360<|im_end|>" in row for row in relayed["rows"][:2])
    # without the relay each rank runs its own tools: the second turn's prompts differ (what the relay prevents)
    unrelayed = leader["unrelayed"], follower["unrelayed"]
    assert unrelayed[0]["prompts"][0] == unrelayed[1]["prompts"][0]
    assert unrelayed[0]["prompts"][1] != unrelayed[1]["prompts"][1]
    # an agent that raises on the leader still releases the follower (it stops after the calls it made)
    assert leader["broken"] == "agent bug" and follower["broken"] is None
    assert leader["broken_calls"] == follower["broken_calls"] == 1
