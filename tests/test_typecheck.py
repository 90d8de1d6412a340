"""The test suite runs purerl with jaxtyping + beartype checks switched on."""

import pytest
import torch

from purerl.algo.aggregation import token_mean


def test_annotations_are_checked_under_pytest():
    loss = torch.randn(2, 3)
    with pytest.raises(Exception, match="mask"):
        token_mean(loss, torch.ones(2, 4, dtype=torch.bool))  # t differs: 3 vs 4
    with pytest.raises(Exception, match="mask"):
        token_mean(loss, torch.ones(2, 3))  # float mask, annotated Bool
