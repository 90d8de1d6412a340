"""Hypothesis strategies for batches of per-token values with response masks (float64)."""

import attrs
import numpy as np
import torch
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

__all__ = ["TokenBatch", "token_batches", "finite_floats", "group_ids"]


def finite_floats(bound: float = 100.0) -> st.SearchStrategy[float]:
    return st.floats(-bound, bound, allow_nan=False, allow_infinity=False, allow_subnormal=False)


@attrs.frozen(eq=False)
class TokenBatch:
    values: torch.Tensor  # float64 [b, t]
    mask: torch.Tensor  # bool [b, t]


@st.composite
def token_batches(
    draw,
    min_rows: int = 1,
    max_rows: int = 6,
    min_len: int = 1,
    max_len: int = 8,
    bound: float = 100.0,
    full_rows: bool = False,
    holes: bool = True,
    nonempty_rows: bool = False,
    nonempty: bool = False,
) -> TokenBatch:
    """A ``[b, t]`` float64 tensor and a bool mask.

    Masks are a valid prefix per row (response then padding); with ``holes`` some valid positions
    inside the prefix may be masked too (observation tokens in multi-turn). ``full_rows`` makes
    every position valid; ``nonempty_rows`` gives every row at least one valid token;
    ``nonempty`` at least one valid token in the batch.
    """
    b = draw(st.integers(min_rows, max_rows))
    t = draw(st.integers(min_len, max_len))
    values = draw(arrays(np.float64, (b, t), elements=finite_floats(bound)))
    if full_rows:
        mask = np.ones((b, t), dtype=bool)
    else:
        lo = 1 if nonempty_rows else 0
        lengths = draw(st.lists(st.integers(lo, t), min_size=b, max_size=b))
        mask = np.arange(t)[None, :] < np.array(lengths)[:, None]
        if holes and draw(st.booleans()):
            hole = draw(arrays(np.bool_, (b, t)))
            first = np.zeros((b, t), dtype=bool)
            first[:, 0] = True  # keep each row's first token so holes never empty a row
            mask = mask & (~hole | first)
        if nonempty and not mask.any():
            mask[0, 0] = True
    return TokenBatch(torch.from_numpy(values), torch.from_numpy(mask))


def group_ids(b: int, draw) -> torch.Tensor:
    """Random group ids for ``b`` rows (any partition, ids not necessarily contiguous)."""
    ids = draw(st.lists(st.integers(0, max(b - 1, 0)), min_size=b, max_size=b))
    return torch.tensor(ids, dtype=torch.int64)
