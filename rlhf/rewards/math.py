"""MATH rule reward with HF `math-verify`: 1.0 when the response's final answer (`\\boxed{}` first, then the
last expression) is mathematically equal to the ground truth, else 0.0."""

from __future__ import annotations

import functools
import threading
from typing import Any

from math_verify import parse, verify

TIMEOUT_S = 5


def _timeout_s() -> int | None:
    # math-verify times out with signal.alarm, which only the main thread may use.
    return TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


@functools.lru_cache(maxsize=4096)  # GRPO scores each prompt's ground truth once per sample in its group
def parse_ground_truth(ground_truth: str) -> tuple:
    """Parse a ground truth given bare (`\\frac{1}{2}`), in `$...$` or in `\\boxed{}`; unparseable raises."""
    text = ground_truth if ("$" in ground_truth or "\\boxed" in ground_truth) else f"${ground_truth}$"
    gold = parse(text, fallback_mode="no_fallback", parsing_timeout=_timeout_s())
    if not gold:
        raise ValueError(f"math ground truth {ground_truth!r:.60} could not be parsed")
    return tuple(gold)


def score_math(data_source: str, solution_str: str, ground_truth: str | None, extra_info: dict[str, Any]) -> float:
    """math-verify equivalence of the response's answer with the ground truth."""
    if ground_truth is None:
        raise ValueError("math scoring needs reward_model.ground_truth")
    gold = parse_ground_truth(ground_truth)
    answer = parse(solution_str, parsing_timeout=_timeout_s())
    if not answer:
        return 0.0
    return 1.0 if verify(list(gold), answer, timeout_seconds=_timeout_s()) else 0.0
