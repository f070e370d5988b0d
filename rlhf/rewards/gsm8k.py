"""GSM8K rule reward: 1.0 when the response's last `#### <number>` equals the ground truth, else 0.0."""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Any

_FINAL_ANSWER = re.compile(r"####\s*\$?\s*(-?[0-9][0-9.,]*)")


def _normalize(number: str) -> str:
    return number.replace(",", "").replace("$", "").strip().rstrip(".")


def extract_final_answer(text: str) -> str | None:
    """The number after the last `####` marker (commas and `$` removed), or None when there is none."""
    matches = _FINAL_ANSWER.findall(text)
    return _normalize(matches[-1]) if matches else None


def _as_decimal(number: str | None) -> Decimal | None:
    try:
        return Decimal(number) if number else None
    except InvalidOperation:
        return None


def score_gsm8k(data_source: str, solution_str: str, ground_truth: str | None, extra_info: dict[str, Any]) -> float:
    """Strict GSM8K scoring; the ground truth may be the bare number or a full solution ending in `#### n`."""
    if ground_truth is None:
        raise ValueError("gsm8k scoring needs reward_model.ground_truth")
    truth = extract_final_answer(ground_truth) if "####" in ground_truth else _normalize(ground_truth)
    truth_number = _as_decimal(truth)
    if truth_number is None:
        raise ValueError(f"gsm8k ground truth {ground_truth!r:.60} has no number")
    return 1.0 if _as_decimal(extract_final_answer(solution_str)) == truth_number else 0.0
