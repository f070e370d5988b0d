"""GSM8K rule reward: the last `#### n` against the ground truth (bare number or full solution)."""

import pytest

from rlhf.rewards.gsm8k import extract_final_answer, score_gsm8k


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
