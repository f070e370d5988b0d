"""MATH rule reward: math-verify equivalence of the response's final answer with the ground truth."""

import pytest

from rlhf.rewards.math import score_math


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
