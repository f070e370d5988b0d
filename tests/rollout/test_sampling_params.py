"""SamplingParams rejects bad input with messages that name the value and the fix."""

import pytest

from rlhf.errors import ConfigError
from rlhf.rollout.sampling_params import SamplingParams, request_seed


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=-0.5), r"temperature=-0.5 is negative; use temperature=0 for greedy"),
    (dict(top_p=0.0), r"top_p=0.0 must be in \(0, 1\]; use top_p=1.0 to disable it"),
    (dict(top_p=1.5), r"top_p=1.5 must be in \(0, 1\]"),
    (dict(top_k=0), r"top_k=0 must be -1 \(disabled\) or a positive integer"),
    (dict(top_k=-2), r"top_k=-2 must be -1"),
    (dict(max_new_tokens=0), r"max_new_tokens=0 must be an integer >= 1"),
    (dict(n=0), r"n=0 \(samples per prompt\) must be an integer >= 1"),
    (dict(temperature=0.0, top_p=0.9), r"temperature=0 \(greedy\) ignores top_p=0.9 and top_k=-1; set top_p=1.0"),
    (dict(temperature=0.0, top_k=5), r"ignores top_p=1.0 and top_k=5"),
    (dict(temperature=0.0, n=4), r"with n=4 gives 4 identical responses per prompt; use n=1"),
    (dict(stop_token_ids=(3, -1)), r"stop_token_ids=\(3, -1\) must be non-negative"),
])
def test_bad_values_raise_config_error(kwargs, message):
    kwargs.setdefault("max_new_tokens", 8)
    with pytest.raises(ConfigError, match=message):
        SamplingParams(**kwargs)


def test_valid_values():
    greedy = SamplingParams(max_new_tokens=4, temperature=0.0)
    assert greedy.greedy and greedy.top_k == -1
    sampled = SamplingParams(max_new_tokens=4, temperature=0.7, top_p=0.9, top_k=20, n=3)
    assert not sampled.greedy and sampled.n == 3


def test_request_seeds_are_reproducible_and_apart_per_replica_and_request():
    seeds = [request_seed(seed, dp_rank, index) for seed in (0, 1000) for dp_rank in range(2) for index in range(64)]
    assert seeds == [request_seed(seed, dp_rank, index) for seed in (0, 1000) for dp_rank in range(2)
                     for index in range(64)]
    assert len(set(seeds)) == len(seeds) and all(0 <= s < 2**56 for s in seeds)
    # vLLM seeds the n samples of a request with seed .. seed + n - 1: no two requests' ranges may overlap
    ordered = sorted(seeds)
    assert min(b - a for a, b in zip(ordered, ordered[1:])) > 1024
