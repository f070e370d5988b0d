"""reasoning-gym rewards: the task's score_answer (partial credit, metadata-aware) and exact match."""

import json

import pytest
import reasoning_gym

from rlhf.rewards.reasoning_gym import response_answer, score_reasoning_gym, score_reasoning_gym_exact


def chain_sum_extra(index=0):
    dataset = reasoning_gym.create_dataset("chain_sum", seed=3, size=index + 1)
    entry = dataset[index]
    return entry, {"metadata": json.dumps(entry["metadata"]), "task_config": "{}"}


def test_reasoning_gym_uses_the_task_scorer_with_partial_credit():
    entry, extra = chain_sum_extra()
    answer = entry["answer"]
    assert score_reasoning_gym("reasoning_gym/chain_sum", answer, answer, extra) == 1.0
    assert score_reasoning_gym("reasoning_gym/chain_sum", f"<answer>{answer}</answer>", answer, extra) == 1.0
    partial = score_reasoning_gym("reasoning_gym/chain_sum", answer + "0", answer, extra)
    dataset = reasoning_gym.create_dataset("chain_sum", seed=0, size=1)
    assert partial == dataset.score_answer(answer + "0", entry)


def test_reasoning_gym_exact_gives_no_partial_credit():
    assert score_reasoning_gym_exact("reasoning_gym/chain_sum", "15", "5", {}) == 0.0
    assert score_reasoning_gym("reasoning_gym/chain_sum", "15", "5", {}) == 0.5  # what exact avoids
    assert score_reasoning_gym_exact("reasoning_gym/chain_sum", " 5\n", "5", {}) == 1.0
    assert score_reasoning_gym_exact("reasoning_gym/chain_sum", "x <answer>5</answer>", "5", {}) == 1.0


def test_reasoning_gym_task_metadata_reaches_score_answer():
    dataset = reasoning_gym.create_dataset("countdown", seed=1, size=1)
    entry = dataset[0]
    extra = {"metadata": json.dumps(entry["metadata"]), "task_config": "{}"}
    # countdown accepts any expression that reaches the target with the given numbers
    assert score_reasoning_gym("reasoning_gym/countdown", entry["answer"], entry["answer"], extra) == 1.0
    assert score_reasoning_gym("reasoning_gym/countdown", "1+1", entry["answer"], extra) < 1.0


def test_reasoning_gym_bad_source():
    with pytest.raises(ValueError, match="is not of the form 'reasoning_gym/<task>'"):
        score_reasoning_gym("chain_sum", "1", "1", {})
    assert response_answer("  7 ") == "7"


@pytest.mark.parametrize("response", ["<answer> 12 </answer>", "<answer>3</answer> then <answer>\n12\n</answer>",
                                      "12", "<answer>12", "think <answer>12</answer> done"])
def test_answer_extraction_agrees_with_reasoning_gym(response):
    from reasoning_gym.utils import extract_answer

    expected = extract_answer(response)
    assert response_answer(response) == (expected if expected is not None else response.strip())
