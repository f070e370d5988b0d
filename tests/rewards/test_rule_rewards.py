"""Built-in rule scorers: gsm8k `#### n`, math via math-verify, reasoning-gym score_answer and exact match."""

import json

import pytest
import reasoning_gym

from rlhf.rewards.gsm8k import extract_final_answer, score_gsm8k
from rlhf.rewards.math import score_math
from rlhf.rewards.reasoning_gym import response_answer, score_reasoning_gym, score_reasoning_gym_exact


@pytest.mark.parametrize("response, truth, expected", [
    ("3 + 4 = 7 so #### 7", "7", 1.0),
    ("#### 1,234.", "1234", 1.0),
    ("#### $18", "18", 1.0),
    ("#### 72.0", "72", 1.0),
    ("#### -5", "-5", 1.0),
    ("#### 5 then I changed my mind #### 6", "5", 0.0),  # the last marker counts
    ("The answer is 7", "7", 0.0),                       # strict: no marker, no credit
    ("#### 8", "Natalia sold 48/2 = 24 clips.\n#### 72", 0.0),
    ("#### 72", "Natalia sold 48/2 = 24 clips.\n#### 72", 1.0),
])
def test_gsm8k(response, truth, expected):
    assert score_gsm8k("openai/gsm8k", response, truth, {}) == expected


def test_gsm8k_extraction_and_errors():
    assert extract_final_answer("no marker") is None
    assert extract_final_answer("#### 3,000") == "3000"
    with pytest.raises(ValueError, match="needs reward_model.ground_truth"):
        score_gsm8k("gsm8k", "#### 1", None, {})
    with pytest.raises(ValueError, match="has no number"):
        score_gsm8k("gsm8k", "#### 1", "none", {})


@pytest.mark.parametrize("response, truth, expected", [
    (r"so the answer is \boxed{\frac{1}{2}}", "0.5", 1.0),
    (r"\boxed{2}", r"\frac{4}{2}", 1.0),
    (r"\boxed{x^2+2x+1}", "(x+1)^2", 1.0),
    (r"\boxed{\{1,2\}}", r"\{2,1\}", 1.0),
    (r"\boxed{4}", "5", 0.0),
    ("I do not know", "5", 0.0),
    (r"\boxed{3}", r"$\boxed{3}$", 1.0),
])
def test_math(response, truth, expected):
    assert score_math("math", response, truth, {}) == expected


def test_math_unparseable_ground_truth_raises():
    with pytest.raises(ValueError, match=r"math ground truth '\\\\frac\{' could not be parsed"):
        score_math("math", r"\boxed{1}", "\\frac{", {})


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
