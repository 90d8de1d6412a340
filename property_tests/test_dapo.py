"""Properties of DAPO's overlong penalty and group filter."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from purerl.algo.dapo import overlong_penalty, varied_groups


@given(budget=st.integers(1, 64), data=st.data(), factor=st.floats(0.0, 4.0))
def test_the_overlong_penalty_ramps_linearly_over_the_buffer(budget, data, factor):
    buffer = data.draw(st.integers(1, budget))
    lengths = torch.arange(budget + 1)
    penalty = overlong_penalty(lengths, budget, buffer, factor)
    start = budget - buffer
    assert bool((penalty[: start + 1] == 0).all())  # nothing up to the buffer
    assert penalty[budget].item() == pytest.approx(-factor)  # the whole factor at the budget
    steps = penalty[start:].diff()
    torch.testing.assert_close(steps, torch.full_like(steps, -factor / buffer))  # linear in between


def test_the_overlong_buffer_must_fit_the_budget():
    with pytest.raises(ValueError, match="buffer must be in"):
        overlong_penalty(torch.tensor([3]), 8, 9)


@given(scores=st.lists(st.sampled_from([0.0, 0.5, 1.0]), min_size=1, max_size=24), data=st.data())
def test_varied_groups_keep_exactly_the_groups_whose_scores_differ(scores, data):
    group = torch.tensor(data.draw(st.lists(st.integers(0, 5), min_size=len(scores), max_size=len(scores))))
    x = torch.tensor(scores)
    kept = varied_groups(x, group)
    for g in group.unique():
        rows = group == g
        assert bool((kept[rows] == (x[rows].unique().numel() > 1)).all())
    order = torch.randperm(len(scores), generator=torch.Generator().manual_seed(len(scores)))
    assert torch.equal(varied_groups(x[order], group[order]), kept[order])  # row order does not matter
