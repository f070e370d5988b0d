"""Rule rewards dispatched on each sample's `data_source`; every sample is scored exactly once.

A scorer has verl's `compute_score` signature: `fn(data_source, solution_str, ground_truth, extra_info) ->
float` (or a dict with the total under "score" and, as verl's reward_extra_info, named reward components beside
it: what GDPO's `gdpo_reward_keys` name; a plain float is the one component "score"). A scorer that raises, or
returns NaN/inf or a non-number, or lacks a component asked for, is a `RewardError` naming the sample — never a
silent 0.
"""

from __future__ import annotations

import fnmatch
import importlib
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from rlhf.data.records import PromptRecord
from rlhf.errors import ConfigError, RewardError
from rlhf.rewards.config import BUILTINS, RewardConfig, is_user_spec
from rlhf.rewards.inputs import RewardInputs
from rlhf.rewards.remote import RemoteReward
from rlhf.rewards.user_fn import load_user_function

Scorer = Callable[[str, str, "str | None", dict], Any]

DEFAULT_BY_SOURCE = {
    "openai/gsm8k": "gsm8k", "gsm8k": "gsm8k",
    "lighteval/MATH": "math", "DigitalLearningGmbH/MATH-lighteval": "math", "HuggingFaceH4/MATH-500": "math",
    "math": "math",
    "reasoning_gym/*": "reasoning_gym",
}


def build_reward(config: RewardConfig) -> RuleReward | RemoteReward:
    """The reward the config asks for; both kinds score with `score(samples, responses) -> rewards_b`."""
    return RemoteReward(config.remote) if config.remote is not None else RuleReward(config)


def _match(table: dict[str, str], data_source: str) -> str | None:
    if data_source in table:
        return table[data_source]
    return next((name for pattern, name in table.items() if fnmatch.fnmatchcase(data_source, pattern)), None)


def _one_line(text: str, limit: int = 300) -> str:
    return " ".join(text.split())[:limit]


def _as_float(value: Any) -> float | None:
    """The reward as a float, or None when it is not a number (dicts carry it under "score")."""
    if isinstance(value, dict):
        value = value.get("score")
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    try:
        return float(value) if not isinstance(value, (str, bytes)) else None
    except (TypeError, ValueError):
        return None


class RuleReward:
    """Scores batches of responses with the scorer each sample's data_source resolves to."""

    def __init__(self, config: RewardConfig) -> None:
        self.config = config
        self._loaded: dict[str, Scorer] = {}
        for name in [config.function, *config.by_source.values()]:
            if name is not None:
                self._load(name)  # a bad user file fails at start-up, not at the first batch

    def _load(self, name: str) -> Scorer:
        if name not in self._loaded:
            if is_user_spec(name):
                self._loaded[name] = load_user_function(name)
            else:
                module, _, attribute = BUILTINS[name].partition(":")
                self._loaded[name] = getattr(importlib.import_module(module), attribute)
        return self._loaded[name]

    def scorer_name(self, data_source: str) -> str:
        """The built-in name or `file.py:fn` a data_source resolves to; unknown sources are a ConfigError."""
        name = _match(self.config.by_source, data_source) or self.config.function \
            or _match(DEFAULT_BY_SOURCE, data_source)
        if name is None:
            raise ConfigError(f"no reward function for data_source {data_source!r}; map it in reward.by_source "
                              f"to one of {', '.join(BUILTINS)} or 'file.py:fn', or set reward.function")
        return name

    def check_sources(self, data_sources: Iterable[str]) -> None:
        """Resolve every distinct data_source up front so a dataset with an unknown one fails before training."""
        for data_source in sorted(set(data_sources)):
            self._load(self.scorer_name(data_source))

    def score(self, samples: Sequence[PromptRecord] | RewardInputs, responses: Sequence[str]) -> torch.Tensor:
        """One float32 reward per response (`rewards_b`); sample i pairs `samples[i]` with `responses[i]`."""
        return self.score_components(samples, responses, ())[0]

    def score_components(self, samples: Sequence[PromptRecord] | RewardInputs, responses: Sequence[str],
                         keys: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """(`rewards_b`, `components_bk`): each response's reward and the float32 components named `keys`, in
        that order, from the scorer's dict (a plain float is the component "score")."""
        inputs = samples if isinstance(samples, RewardInputs) else RewardInputs.from_records(samples)
        if len(inputs.data_sources) != len(responses):
            raise RewardError(f"got {len(responses)} responses for {len(inputs.data_sources)} samples")
        rewards_b = torch.empty(len(responses), dtype=torch.float32)
        components_bk = torch.empty(len(responses), len(keys), dtype=torch.float32)
        for i, response in enumerate(responses):
            value, rewards_b[i] = self._score_one(inputs, i, response)
            for k, key in enumerate(keys):
                components_bk[i, k] = self._component(inputs, i, value, key)
        return rewards_b, components_bk

    def _where(self, inputs: RewardInputs, i: int) -> str:
        return f"reward for sample {i} (index {inputs.indices[i]}, data_source {inputs.data_sources[i]!r})"

    def _component(self, inputs: RewardInputs, i: int, value: Any, key: str) -> float:
        named = value if isinstance(value, dict) else {"score": value}
        if key not in named:
            raise RewardError(f"{self._where(inputs, i)} has no component {key!r} (algo.advantage.gdpo_reward_keys):"
                              f" the scorer returned {_one_line(repr(sorted(named)), 120)}; return a dict with every "
                              "gdpo_reward_keys entry, or list only the keys it returns")
        component = _as_float(named[key])
        if component is None or not math.isfinite(component):
            raise RewardError(f"{self._where(inputs, i)} returned component {key!r} = "
                              f"{_one_line(repr(named[key]), 80)}, not a finite number")
        return component

    def _score_one(self, inputs: RewardInputs, i: int, response: str) -> tuple[Any, float]:
        """The scorer's raw value and its reward."""
        data_source = inputs.data_sources[i]
        where = self._where(inputs, i)
        scorer = self._load(self.scorer_name(data_source))
        try:
            value = scorer(data_source, response, inputs.ground_truths[i], inputs.extra_infos[i])
        except Exception as error:
            raise RewardError(f"{where} raised {type(error).__name__}: {_one_line(str(error))}") from error
        reward = _as_float(value)
        if reward is None:
            raise RewardError(f"{where} returned {_one_line(repr(value), 80)} ({type(value).__name__}), not a number")
        if not math.isfinite(reward):
            raise RewardError(f"{where} returned {reward}")
        return value, reward
