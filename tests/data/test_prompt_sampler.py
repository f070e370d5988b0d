"""The DP-sharded prompt sampler: order independent of DP size, epochs, exact resume, validation."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlhf.data.sampler import PromptSampler
from rlhf.errors import CheckpointError, ConfigError


def samplers(dp_size, **kwargs):
    return [PromptSampler(dp_rank=rank, dp_size=dp_size, **kwargs) for rank in range(dp_size)]


def global_steps(dp_size, steps, **kwargs):
    """Concatenate every rank's indices per step: the global batches as the DP ranks see them."""
    ranks = samplers(dp_size, **kwargs)
    return [sum((sampler.next_indices() for sampler in ranks), []) for _ in range(steps)]


@settings(max_examples=30, deadline=None)
@given(num_samples=st.integers(8, 60), per_rank=st.integers(1, 4), seed=st.integers(0, 2**32), steps=st.integers(1, 12))
def test_global_order_does_not_depend_on_dp_size(num_samples, per_rank, seed, steps):
    batch = 4 * per_rank
    if batch > num_samples:
        return
    kwargs = {"num_samples": num_samples, "global_batch_size": batch, "seed": seed}
    reference = global_steps(1, steps, **kwargs)
    assert global_steps(2, steps, **kwargs) == reference
    assert global_steps(4, steps, **kwargs) == reference


def test_each_epoch_is_a_fresh_permutation_without_the_tail():
    sampler = PromptSampler(num_samples=10, global_batch_size=3, dp_rank=0, dp_size=1, seed=5)
    epoch0 = sum((sampler.next_indices() for _ in range(3)), [])
    assert sampler.epoch == 1 and sampler.step_in_epoch == 0 and sampler.consumed_batches == 3
    epoch1 = sum((sampler.next_indices() for _ in range(3)), [])
    assert len(set(epoch0)) == 9 and len(set(epoch1)) == 9 and set(epoch0) <= set(range(10))
    assert epoch0 != epoch1
    again = PromptSampler(num_samples=10, global_batch_size=3, dp_rank=0, dp_size=1, seed=5)
    assert sum((again.next_indices() for _ in range(3)), []) == epoch0
    other_seed = PromptSampler(num_samples=10, global_batch_size=3, dp_rank=0, dp_size=1, seed=6)
    assert sum((other_seed.next_indices() for _ in range(3)), []) != epoch0


def test_no_shuffle_is_in_order():
    sampler = PromptSampler(num_samples=5, global_batch_size=4, dp_rank=1, dp_size=2, seed=0, shuffle=False)
    assert [sampler.next_indices() for _ in range(2)] == [[2, 3], [2, 3]]


def test_resume_continues_exactly_even_on_another_dp_size():
    kwargs = {"num_samples": 23, "global_batch_size": 4, "seed": 11}
    full = global_steps(1, 20, **kwargs)
    first = samplers(2, **kwargs)
    for _ in range(7):
        for sampler in first:
            sampler.next_indices()
    state = first[0].state_dict()
    assert state == first[1].state_dict() == {"epoch": 1, "step_in_epoch": 2, "num_samples": 23,
                                              "global_batch_size": 4, "seed": 11, "shuffle": True}
    resumed = samplers(4, **kwargs)
    for sampler in resumed:
        sampler.load_state_dict(dict(state))
    rest = [sum((sampler.next_indices() for sampler in resumed), []) for _ in range(13)]
    assert rest == full[7:]


def test_state_of_another_run_is_refused():
    sampler = PromptSampler(num_samples=20, global_batch_size=4, dp_rank=0, dp_size=1, seed=1)
    state = sampler.state_dict() | {"num_samples": 21, "seed": 2}
    with pytest.raises(CheckpointError) as info:
        sampler.load_state_dict(state)
    assert str(info.value) == ("the data sampler state does not match this run "
                               "(num_samples: checkpoint 21 vs now 20; seed: checkpoint 2 vs now 1)")
    with pytest.raises(CheckpointError, match="out of range: epoch 0, step 5 of 5"):
        sampler.load_state_dict(sampler.state_dict() | {"step_in_epoch": 5})


@pytest.mark.parametrize("kwargs, message", [
    ({"global_batch_size": 6, "dp_size": 4}, "data.prompts_per_step=6 must be a positive multiple of the data-parallel size 4"),
    ({"num_samples": 3}, "the dataset has 3 prompts, fewer than data.prompts_per_step=4"),
    ({"dp_rank": 2, "dp_size": 2}, r"dp_rank=2 must be in \[0, dp_size=2\)"),
    ({"seed": -1}, "data.seed=-1 must be >= 0"),
])
def test_bad_config(kwargs, message):
    args = {"num_samples": 10, "global_batch_size": 4, "dp_rank": 0, "dp_size": 1, "seed": 0} | kwargs
    with pytest.raises(ConfigError, match=message):
        PromptSampler(**args)
