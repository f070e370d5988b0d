"""Sampling parameters for one `generate` call, validated on construction."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from rlhf.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """Greedy is `temperature=0`; `top_k=-1` and `top_p=1.0` switch those filters off.

    `seed` is combined with the engine's DP rank, so every TP rank of one replica samples the same tokens
    and different replicas sample different ones.
    """

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    n: int = 1
    seed: int = 0
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ConfigError(f"sampling max_new_tokens={self.max_new_tokens!r} must be an integer >= 1")
        if self.temperature < 0:
            raise ConfigError(f"sampling temperature={self.temperature} is negative; use temperature=0 for "
                              "greedy decoding or a positive value to sample")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"sampling top_p={self.top_p} must be in (0, 1]; use top_p=1.0 to disable it")
        if not isinstance(self.top_k, int) or self.top_k == 0 or self.top_k < -1:
            raise ConfigError(f"sampling top_k={self.top_k!r} must be -1 (disabled) or a positive integer")
        if not isinstance(self.n, int) or self.n < 1:
            raise ConfigError(f"sampling n={self.n!r} (samples per prompt) must be an integer >= 1")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ConfigError(f"sampling stop_token_ids={self.stop_token_ids!r} must be non-negative token ids")
        if self.greedy:
            self._check_greedy()

    def _check_greedy(self) -> None:
        if self.top_p != 1.0 or self.top_k != -1:
            raise ConfigError(f"sampling temperature=0 (greedy) ignores top_p={self.top_p} and "
                              f"top_k={self.top_k}; set top_p=1.0 and top_k=-1, or use temperature > 0 to sample")
        if self.n > 1:
            raise ConfigError(f"sampling temperature=0 (greedy) with n={self.n} gives {self.n} identical "
                              "responses per prompt; use n=1 or temperature > 0")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def replica_seed(seed: int, dp_rank: int) -> int:
    """Distinct, reproducible seeds per DP replica (seed s on dp rank 1 is not seed s+1 on dp rank 0)."""
    return (seed * 1_000_003 + dp_rank) % (2**63)


def request_seed(seed: int, dp_rank: int, index: int) -> int:
    """A reproducible seed per (call seed, DP replica, request): identical prompts sample independently.

    Hashed (56 bits), so seeds of neighbouring requests are far apart: vLLM seeds a request's n samples
    with seed, seed + 1, ..., seed + n - 1.
    """
    digest = hashlib.blake2b(f"{seed}:{dp_rank}:{index}".encode(), digest_size=7).digest()
    return int.from_bytes(digest, "little")
