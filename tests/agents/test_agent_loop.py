"""The built-in tool loop and environment adapter on a scripted engine: masks, limits, terminations, failures,
turn batching. (The engine is a test double here: what is under test is the loop; tests with a real engine
check logprob alignment.)"""

import pytest

from rlhf.agents.agent import environment_agent
from rlhf.agents.config import HistoryPolicy, TurnLimits
from rlhf.agents.rollout import MultiTurnRollout
from rlhf.agents.tools import Calculator
from rlhf.agents.trajectory import Termination
from rlhf.errors import ConfigError
from rlhf.rollout.sampling_params import SamplingParams
from tests.agents.scripted import CALL, ScriptedEngine, record, run, toolbox

def test_tool_loop_masks_tokens_and_batches_turns(chat_tokenizer):
    script = {"12*30?": [CALL % ("calculator", "12*30"), "360"], "2+2?": ["4"]}
    result, engine = run(chat_tokenizer, script, [record("12*30?"), record("2+2?", 1)], n=2)
    assert engine.calls == [4, 2]  # turn 1 of all four trajectories in one call; turn 2 for the two left
    first, second = result.groups
    (row,) = first.trajectories[0].rows
    traj = first.trajectories[0]
    assert (traj.termination, traj.num_turns, traj.num_tool_calls, traj.prefix_mismatches) == (
        Termination.STOP, 2, 1, 0)
    sampled = [chat_tokenizer.encode(t, add_special_tokens=False) + [chat_tokenizer.eos_token_id]
               for t in script["12*30?"]]
    assert row.num_sampled == sum(len(s) for s in sampled)
    text = chat_tokenizer.decode(row.tokens)
    assert text.endswith("<|im_start|>tool\n360<|im_end|>\n<|im_start|>assistant\n360<|im_end|>")
    masked = [tok for tok, m in zip(row.response, row.loss_mask) if m]
    assert masked == sampled[0] + sampled[1]  # exactly the sampled tokens carry the loss
    tool_span = [tok for tok, m in zip(row.response, row.loss_mask) if not m]
    assert chat_tokenizer.decode(tool_span) == "\n<|im_start|>tool\n360<|im_end|>\n<|im_start|>assistant\n"
    assert [lp for lp, m in zip(row.logprobs, row.loss_mask) if m][:2] == pytest.approx([-0.01, -0.02])
    assert set(v for v, m in zip(row.versions, row.loss_mask) if m) == {3}
    assert second.trajectories[0].termination is Termination.STOP
    assert result.stats.rows_per_call == [4, 2] and result.stats.generate_calls == 2


def test_limits(chat_tokenizer):
    loop = [CALL % ("calculator", "1+1")] * 5
    result, _ = run(chat_tokenizer, {"q": loop}, [record("q")], max_turns=3)
    traj = result.groups[0].trajectories[0]
    assert (traj.termination, traj.num_turns, traj.num_tool_calls) == (Termination.MAX_TURNS, 3, 2)
    result, _ = run(chat_tokenizer, {"q": loop}, [record("q")], token_budget=700)
    traj = result.groups[0].trajectories[0]
    assert traj.termination is Termination.TOKEN_BUDGET and len(traj.rows[0].tokens) == 700


def test_tool_errors_are_shown_to_the_model(chat_tokenizer):
    script = {"q": [CALL % ("calculator", "1/0"), '<tool_call>{"name": "nope"}</tool_call>', "<tool_call>{x</tool_call>",
                    "done"]}
    result, _ = run(chat_tokenizer, script, [record("q")], max_turns=4)
    traj = result.groups[0].trajectories[0]
    text = chat_tokenizer.decode(traj.rows[0].tokens)
    assert "error: calculator: ZeroDivisionError: division by zero" in text
    assert "error: unknown tool 'nope'; available: ['calculator', 'flaky', 'hang']" in text
    assert "error: tool call is not valid JSON" in text
    assert (traj.termination, traj.num_tool_errors) == (Termination.STOP, 3)


def test_failure_retries_then_drops_the_whole_group(chat_tokenizer):
    script = {"q": [CALL % ("flaky", "1"), "done"], "r": ["fine"]}
    result, _ = run(chat_tokenizer, script, [record("q"), record("r", 1)], tool_retries=1, failures=1)
    assert result.groups[0].dropped is None  # one failure, one retry: it worked
    result, _ = run(chat_tokenizer, script, [record("q"), record("r", 1)], n=2, tool_retries=1, failures=3)
    dropped, kept = result.groups
    assert dropped.trajectories == () and dropped.dropped == (
        "tool 'flaky' failed 2 times: OSError: sandbox vanished")
    assert kept.dropped is None and len(kept.trajectories) == 2 and result.kept == [kept]


def test_hanging_tool_times_out(chat_tokenizer):
    script = {"q": ['<tool_call>{"name": "hang", "arguments": {}}</tool_call>', "never"]}
    result, _ = run(chat_tokenizer, script, [record("q")], tool_timeout_s=0.2)
    assert result.groups[0].trajectories[0].termination is Termination.TOOL_TIMEOUT


def test_fork_rows_share_the_rollout(rewriting_tokenizer):
    script = {"q": ["<think>hmm</think>" + CALL % ("calculator", "2*3"), "<think>so</think>6"]}
    engine = ScriptedEngine(rewriting_tokenizer, script)
    rollout = MultiTurnRollout(rewriting_tokenizer, TurnLimits(history=HistoryPolicy.FORK), toolbox(calculator=Calculator()))
    result = rollout.collect(engine, [record("q")], SamplingParams(max_new_tokens=256), pad_token_id=0)
    traj = result.groups[0].trajectories[0]
    assert traj.num_forks == 1 and traj.prefix_mismatches == 1
    first, second = traj.rows
    assert "<think>hmm</think>" in rewriting_tokenizer.decode(first.tokens)
    assert "<think>hmm</think>" not in rewriting_tokenizer.decode(second.tokens[:second.prompt_length])
    assert rewriting_tokenizer.decode(second.response) == "<think>so</think>6<|im_end|>"
    assert sum(r.num_sampled for r in traj.rows) == sum(
        len(rewriting_tokenizer.encode(t, add_special_tokens=False)) + 1 for t in script["q"])


class Counter:
    """Say numbers up to 3: reward 1 per correct count."""

    def reset(self, sample):
        self.n = 0
        return "start"

    def step(self, action):
        self.n += 1
        return f"said {action}", float(action == str(self.n)), self.n == 3, {}


def test_environment_agent(chat_tokenizer):
    engine = ScriptedEngine(chat_tokenizer, {"count": ["1", "2", "x"]})

    async def agent(ctx, sample):
        return await environment_agent(ctx, sample, Counter)

    for discount, score in ((1.0, 2.0), (0.5, 1.5)):  # rewards 1, 1, 0: 1 + discount * 1
        rollout = MultiTurnRollout(chat_tokenizer, TurnLimits(max_turns=5, turn_discount=discount), agent=agent)
        result = rollout.collect(engine, [record("count")], SamplingParams(max_new_tokens=64), pad_token_id=0)
        traj = result.groups[0].trajectories[0]
        assert (traj.termination, traj.turn_rewards, traj.reward) == (Termination.ENV_DONE, (1.0, 1.0, 0.0), score)
        assert "<|im_start|>user\nsaid 2<|im_end|>" in chat_tokenizer.decode(traj.rows[0].tokens)
    with pytest.raises(ConfigError, match=r"^multiturn\.limits\.turn_discount=0\.0 must be in \(0, 1\] \(1: the "
                                          r"plain sum of the per-turn rewards\)$"):
        TurnLimits(turn_discount=0.0)


def test_tool_schemas_in_the_prompt_unless_told_not_to(chat_tokenizer):
    box = toolbox(calculator=Calculator())
    listed = MultiTurnRollout(chat_tokenizer, TurnLimits(), box).renderer.prompt([{"role": "user", "content": "q"}])
    bare = MultiTurnRollout(chat_tokenizer, TurnLimits(), box, list_tools=False).renderer.prompt(
        [{"role": "user", "content": "q"}])
    assert '"name": "calculator"' in chat_tokenizer.decode(listed)
    assert chat_tokenizer.decode(bare) == "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n"
