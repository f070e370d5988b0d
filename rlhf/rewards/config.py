"""Config sections of the reward sources, free of torch (the owners: registry.py, remote.py)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Literal

from rlhf.errors import ConfigError


BUILTINS = {
    "gsm8k": "rlhf.rewards.gsm8k:score_gsm8k",
    "math": "rlhf.rewards.math:score_math",
    "reasoning_gym": "rlhf.rewards.reasoning_gym:score_reasoning_gym",
    "reasoning_gym_exact": "rlhf.rewards.reasoning_gym:score_reasoning_gym_exact",
}


def is_user_spec(name: str) -> bool:
    return ".py:" in name


@dataclass(kw_only=True)
class RemoteRewardConfig:
    """Where the service is and how hard to try: each attempt must finish (connect, send, whole reply of at
    most `max_reply_bytes`) within `timeout_s`; `max_retries` more attempts after the first, the wait doubling
    from `retry_backoff_s`; up to `max_in_flight` batches of `batch_size` are sent at once."""

    url: str  # http(s) endpoint taking {samples: [...]} and answering {scores: [...]}
    batch_size: int = 64  # samples per request
    timeout_s: float = 30.0  # deadline of one attempt (connect, send, reply)
    max_reply_bytes: int = 16 * 2**20  # largest reply accepted
    max_retries: int = 3  # attempts after the first
    retry_backoff_s: float = 0.5  # first wait between attempts (doubles each time)
    max_in_flight: int = 4  # requests sent at once

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ConfigError(f"reward.remote.url={self.url!r} must start with http:// or https://")
        for name in ("batch_size", "max_in_flight", "max_reply_bytes"):
            if getattr(self, name) < 1:
                raise ConfigError(f"reward.remote.{name}={getattr(self, name)} must be >= 1")
        if self.timeout_s <= 0 or self.max_retries < 0 or self.retry_backoff_s < 0:
            raise ConfigError(f"reward.remote needs timeout_s > 0, max_retries >= 0 and retry_backoff_s >= 0; got "
                              f"{self.timeout_s}, {self.max_retries}, {self.retry_backoff_s}")


@dataclass(kw_only=True)
class RewardConfig:
    """`by_source` maps data_source patterns (fnmatch, e.g. `reasoning_gym/*`) to a built-in name or a
    `file.py:fn`; `function` is used for every source no pattern matches; the built-in table comes last.
    With `remote` set, every sample is scored by that HTTP service instead. With `model_path` (an HF
    sequence-classification folder) a reward model on the reward mesh scores training rollouts; the rule
    functions then serve validation only. `model_offload` parks its weights on the host during rollouts."""

    function: str | None = None  # rule reward for every data_source: a built-in name or `file.py:function`
    # data_source pattern (fnmatch) -> built-in name or `file.py:function`
    by_source: dict[str, str] = field(default_factory=dict)
    # an HTTP reward service that scores every sample (the section below); null: none
    remote: RemoteRewardConfig | None = None
    model_path: str = ""  # HF sequence-classification folder of a reward model scoring training rollouts
    model_offload: bool = False  # park the reward model on the host during rollouts
    model_micro_batch_size: int = 8  # sequences per reward-model forward on each DP rank
    # packed reward-model micro-batches of at most this many tokens; auto: model_micro_batch_size x the longest
    # row; 0: row counts (model_micro_batch_size sequences a forward)
    model_max_tokens_per_microbatch: int | Literal["auto"] = "auto"

    def __post_init__(self) -> None:
        self.model_path = os.path.expanduser(self.model_path)
        if self.model_micro_batch_size < 1:
            raise ConfigError(f"reward.model_micro_batch_size={self.model_micro_batch_size} must be >= 1")
        budget = self.model_max_tokens_per_microbatch
        if budget != "auto" and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 0):
            raise ConfigError(f"reward.model_max_tokens_per_microbatch={budget!r} must be auto, 0 (row-count "
                              "micro-batches) or a token count >= 1")
        if self.model_offload and not self.model_path:
            raise ConfigError("reward.model_offload=true needs a reward model to offload; set reward.model_path "
                              "or drop reward.model_offload")
        if self.model_path and self.remote is not None:
            raise ConfigError("reward.model_path and reward.remote both score every sample; keep one")
        if self.remote is not None and (self.function or self.by_source):
            raise ConfigError("reward.remote scores every sample; unset reward.function and reward.by_source "
                              "or drop reward.remote")
        named = [(f"reward.by_source[{pattern!r}]", name) for pattern, name in self.by_source.items()]
        if self.function is not None:
            named.append(("reward.function", self.function))
        for label, name in named:
            if name not in BUILTINS and not is_user_spec(name):
                raise ConfigError(f"{label}={name!r} is neither a built-in reward "
                                  f"({', '.join(BUILTINS)}) nor 'path/to/file.py:function_name'")
