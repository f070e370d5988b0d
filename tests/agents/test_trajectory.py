"""TrajectoryBuilder: a row never outgrows its token budget (packing budgets are sized by it)."""

from rlhf.agents.trajectory import Termination, TrajectoryBuilder


def test_an_observation_is_cut_to_the_rows_token_budget():
    builder = TrajectoryBuilder(prompt=[1, 2, 3], token_budget=10)
    builder.add_sampled([4, 5, 6, 7], [-0.5] * 4, version=2)
    builder.add_observation([8, 9, 10, 11, 12, 13])  # a tool result past the budget: 3 of its 6 tokens fit
    assert builder.tokens == list(range(1, 11)) and builder.budget_left == 0
    builder.add_observation([14])  # a full row takes nothing more
    (row,) = builder.finish(Termination.TOKEN_BUDGET, num_turns=1).rows
    assert row.tokens == tuple(range(1, 11)) and row.loss_mask == (1, 1, 1, 1, 0, 0, 0)
    assert row.logprobs == (-0.5,) * 4 + (0.0,) * 3 and row.versions == (2,) * 4 + (0,) * 3
