"""reasoning-gym rewards for datasets made by `rlhf data make`: the task's own `score_answer`, or exact match.

The task comes from `data_source` (`reasoning_gym/<task>`); its config and the item's metadata come from
`extra_info` (`task_config`, `metadata`, both JSON strings). `score_answer` gives partial credit (e.g. 0.5 for
"15" when the answer is "5"), so the exact scorer is the one to use where only a right answer should count.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any

from rlhf.data.make import decode_metadata

SOURCE_PREFIX = "reasoning_gym/"
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def task_of(data_source: str) -> str:
    """The reasoning-gym task named by a `reasoning_gym/<task>` data source."""
    if not data_source.startswith(SOURCE_PREFIX):
        raise ValueError(f"data_source {data_source!r} is not of the form '{SOURCE_PREFIX}<task>'")
    return data_source[len(SOURCE_PREFIX):]


@functools.lru_cache(maxsize=64)
def _dataset(task: str, task_config_json: str) -> Any:
    import reasoning_gym  # slow to import (every task module): only the score_answer path needs it

    return reasoning_gym.create_dataset(task, **json.loads(task_config_json), size=1, seed=0)


def response_answer(solution_str: str) -> str:
    """The answer inside the last `<answer>...</answer>` when present, else the whole response, stripped."""
    tagged = _ANSWER_TAG.findall(solution_str)
    return (tagged[-1] if tagged else solution_str).strip()


def score_reasoning_gym(data_source: str, solution_str: str, ground_truth: str | None,
                        extra_info: dict[str, Any]) -> float:
    """The task's `score_answer` on the response's answer (may give partial credit)."""
    if ground_truth is None:
        raise ValueError("reasoning-gym scoring needs reward_model.ground_truth")
    dataset = _dataset(task_of(data_source), extra_info.get("task_config") or "{}")
    entry = {"answer": ground_truth, "metadata": decode_metadata(extra_info.get("metadata") or "{}")}
    return float(dataset.score_answer(response_answer(solution_str), entry))


def score_reasoning_gym_exact(data_source: str, solution_str: str, ground_truth: str | None,
                              extra_info: dict[str, Any]) -> float:
    """1.0 only when the response's answer equals the ground truth exactly (after stripping spaces)."""
    if ground_truth is None:
        raise ValueError("reasoning-gym scoring needs reward_model.ground_truth")
    return 1.0 if response_answer(solution_str) == ground_truth.strip() else 0.0
