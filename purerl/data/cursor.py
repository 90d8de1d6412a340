"""The data cursor: which prompts come next, as part of the train state (so resume is exact)."""

import random

from purerl.tree import pytree

__all__ = ["DataCursor", "next_indices"]


@pytree
class DataCursor:
    """Position in a shuffled pass over ``n`` records: epoch ``epoch``, offset ``index``.

    The order of an epoch is a permutation drawn from ``(seed, epoch)``, so the cursor alone
    (three ints) determines every future batch.
    """

    seed: int
    epoch: int = 0
    index: int = 0


def _epoch_order(n: int, seed: int, epoch: int) -> list[int]:
    order = list(range(n))
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return order


def next_indices(cursor: DataCursor, n_records: int, batch_size: int) -> tuple[list[int], DataCursor]:
    """The next ``batch_size`` record indices and the cursor after them (wrapping into new epochs)."""
    if n_records < 1 or batch_size < 1:
        raise ValueError(f"next_indices: need n_records ≥ 1 and batch_size ≥ 1, got {n_records}, {batch_size}")
    out: list[int] = []
    epoch, index = cursor.epoch, cursor.index
    while len(out) < batch_size:
        order = _epoch_order(n_records, cursor.seed, epoch)
        take = order[index : index + batch_size - len(out)]
        out.extend(take)
        index += len(take)
        if index >= n_records:
            epoch, index = epoch + 1, 0
    return out, DataCursor(cursor.seed, epoch, index)
