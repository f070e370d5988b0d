"""Trajectories as training rows: masks, side tensors, groups and forks; the multiturn/* metrics."""

import torch

from rlhf.agents.batch import TERMINATIONS, to_rows
from rlhf.agents.config import HistoryPolicy, TurnLimits
from rlhf.agents.rollout import MultiTurnRollout
from rlhf.agents.tools import Calculator
from rlhf.agents.trajectory import Termination
from rlhf.rollout.sampling_params import SamplingParams
from tests.agents.scripted import CALL, ScriptedEngine, record, run, toolbox


def test_rows_carry_masks_logprobs_versions_and_groups(chat_tokenizer):
    script = {"a": [CALL % ("calculator", "2*3"), "6"], "b": ["x"], "c": [CALL % ("flaky", "1"), "y"]}
    result, _ = run(chat_tokenizer, script, [record("a"), record("c", 2), record("b", 1)], n=2,
                    tool_retries=0, failures=1)
    rows = to_rows(result, pad_token_id=0, num_samples=2)
    # group "c" (the second) is dropped whole (one failure, no retries): two rows with nothing to train on
    assert rows.group_index_b.tolist() == [0, 0, 1, 1, 2, 2] and rows.rollout_index_b.tolist() == [0, 1, -1, -1, 2, 3]
    assert rows.kept_b.tolist() == [True, True, False, False, True, True]
    assert not rows.loss_mask_bt[2:4].any() and rows.response_lengths_b[2:4].tolist() == [1, 1]
    for b, traj in zip([0, 1, 4, 5], rows.trajectories):
        (row,) = traj.rows
        length = int(rows.response_lengths_b[b])
        assert torch.equal(rows.tokens_bs[b, :len(row.tokens)], torch.tensor(row.tokens))
        assert int(rows.loss_mask_bt[b].sum()) == row.num_sampled
        assert rows.response_mask_bt[b, :length].all() and not rows.response_mask_bt[b, length:].any()
        assert torch.equal(rows.rollout_logprobs_bt[b] != 0, rows.loss_mask_bt[b])
        assert set(rows.policy_version_bt[b][rows.loss_mask_bt[b]].tolist()) == {3}
    assert not rows.truncated_b.any()
    metrics = result.metrics()
    assert metrics["multiturn/dropped_groups"] == 1.0 and metrics["multiturn/turns_mean"] == 1.5
    assert metrics["multiturn/termination/stop"] == 1.0 and metrics["multiturn/tool_calls_mean"] == 0.5
    assert 0.0 <= metrics["multiturn/engine_idle_share"] <= 1.0


def test_forked_rows_share_group_and_rollout(rewriting_tokenizer):
    script = {"q": ["<think>a</think>" + CALL % ("calculator", "1+1"), "<think>b</think>2"]}
    engine = ScriptedEngine(rewriting_tokenizer, script)
    rollout = MultiTurnRollout(rewriting_tokenizer, TurnLimits(history=HistoryPolicy.FORK),
                               toolbox(calculator=Calculator()))
    result = rollout.collect(engine, [record("q")], SamplingParams(max_new_tokens=128, n=2), pad_token_id=0)
    rows = to_rows(result, pad_token_id=0, num_samples=2)
    assert rows.group_index_b.tolist() == [0, 0, 0, 0] and rows.rollout_index_b.tolist() == [0, 0, 1, 1]
    assert rows.termination_b.tolist() == [TERMINATIONS.index(Termination.STOP)] * 4
    assert result.metrics()["multiturn/forks_mean"] == 1.0
