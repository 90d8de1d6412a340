"""Loss aggregation as ``(sum, count)`` pairs, so micro-batching and data parallelism reduce exactly.

A per-token loss ``L[b, t]`` with mask ``m`` is reduced to a :class:`SumCount`. Adding the
``SumCount`` of the parts of a batch (micro-batches, data-parallel ranks) gives the ``SumCount``
of the whole batch, for every mode; the loss is ``total / count`` (``total`` when ``count == 0``).
To accumulate gradients over micro-batches exactly, compute the whole mini-batch's denominator
first with :func:`loss_denominator` (it depends only on the mask) and backpropagate
``part.total / denominator`` for each part.

Modes (verl 0.9.1 ``agg_loss`` with no global arguments; ``S_i = Σ_t L[i,t]·m[i,t]``,
``n_i = Σ_t m[i,t]``, ``e_i = [n_i > 0]``):

=========================  ==============================  =================  ===========
mode                       total                           count              denominator
=========================  ==============================  =================  ===========
token-mean                 ``Σ_i S_i``                     ``Σ_i n_i``        count
token-sum                  ``Σ_i S_i``                     ``0``              ``1``
seq-mean-token-sum         ``Σ_i S_i``                     ``Σ_i e_i``        count
seq-mean-token-mean        ``Σ_i S_i / (n_i + 1e-8)``      ``Σ_i e_i``        count
seq-mean-token-sum-norm    ``Σ_i S_i / norm``              ``Σ_i e_i``        count
row-mean                   ``Σ_i S_i / (n_i + 1e-8)``      ``B`` (all rows)   count
=========================  ==============================  =================  ===========

``token-sum`` (verl 0.9.1 ``masked_sum(L, m)``) divides by nothing. Its ``count`` is 0, which
:meth:`SumCount.value` reads as "a plain sum" (``value() = total``), so the ``SumCount`` of the
parts still adds up to the whole exactly (``0 + 0 = 0``; a count of 1 per part would turn the sum
of k parts into their mean); :func:`loss_denominator` gives 1 for it, the divisor of
``total / denominator``. Do not divide a ``token-sum`` total by its ``count``.

``row-mean`` is not a verl ``loss_agg_mode``: it is ``seq-mean-token-mean`` with every row counted,
empty ones included (verl's value when ``global_batch_size`` is the number of rows). It is the
aggregation of losses that average over all rows, such as GMPO (``geo_mean``).

Degenerate cases: empty rows never count in a seq-mean (verl's local default); a batch with
``count == 0`` has loss 0 in the mean modes (verl gives NaN for token-mean), whose totals are then
0 as well. ``norm`` for ``seq-mean-token-sum-norm`` defaults to the padded length ``T`` as in
verl, which makes the loss depend on padding; pass a fixed norm (the maximum response length) to
make it padding-invariant, as Dr.GRPO intends.
"""

from collections.abc import Callable

import attrs
import torch
from jaxtyping import Bool, Float
from torch import Tensor

from purerl.algo import registries
from purerl.algo.masked import masked_sum
from purerl.checks import check_bool, check_rank, check_same_shape
from purerl.registry import Registry
from purerl.tree import pytree

__all__ = [
    "Aggregation", "SumCount", "aggregate_loss", "loss_denominator", "LOSS_AGGREGATIONS", "token_mean", "token_sum",
    "row_mean",
]


@pytree
class SumCount:
    """An unreduced mean: ``value() = total / count``, or ``total`` when ``count == 0``.

    ``a + b`` is the ``SumCount`` of the union of the batches behind ``a`` and ``b``. A count of 0
    means either an empty batch of a mean (whose total is 0, so the value is 0) or a plain sum
    (``token-sum``), whose value is its total.
    """

    total: Float[Tensor, ""]
    count: Float[Tensor, ""]

    def value(self) -> Float[Tensor, ""]:
        safe = torch.where(self.count > 0, self.count, torch.ones_like(self.count))
        return torch.where(self.count > 0, self.total / safe, self.total)

    def __add__(self, other: "SumCount") -> "SumCount":
        return SumCount(self.total + other.total, self.count + other.count)

    def detach(self) -> "SumCount":
        return SumCount(self.total.detach(), self.count.detach())


AggregationFn = Callable[[Tensor, Tensor, float | None], SumCount]


@attrs.frozen
class Aggregation:
    """A registered aggregation mode: ``fn(loss [b, t], mask [b, t], norm) -> SumCount``, and whether it is a
    ``plain_sum`` (count 0, divided by 1: ``token-sum``)."""

    fn: AggregationFn
    plain_sum: bool = False

    def __call__(self, loss: Float[Tensor, "b t"], mask: Bool[Tensor, "b t"], norm: float | None = None) -> SumCount:
        return self.fn(loss, mask, norm)

    def denominator(self, mask: Bool[Tensor, "b t"]) -> Float[Tensor, ""]:
        """The divisor of this mode's total for ``mask`` (float32): its count for ``mask``, computed on a zero loss
        (1 for a plain sum)."""
        count = self.fn(torch.zeros(mask.shape, dtype=torch.float32, device=mask.device), mask, None).count
        return torch.ones_like(count) if self.plain_sum else count


LOSS_AGGREGATIONS: Registry[Aggregation] = registries.LOSS_AGGREGATIONS


def _mode(name: str, *, plain_sum: bool = False) -> Callable[[AggregationFn], AggregationFn]:
    """Register the decorated function as the mode ``name`` (:class:`Aggregation`); the function stays itself."""

    def add(fn: AggregationFn) -> AggregationFn:
        LOSS_AGGREGATIONS.register(name)(Aggregation(fn, plain_sum))
        return fn

    return add


def _row_sums(loss: Tensor, mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per-row ``S_i``, ``n_i`` (in the loss dtype) and the non-empty-row count ``Σ e_i``."""
    sums = masked_sum(loss, mask, dim=-1)
    lengths = mask.sum(-1).to(loss.dtype)
    return sums, lengths, (lengths > 0).sum().to(loss.dtype)


@_mode("token-mean")
def token_mean(loss: Float[Tensor, "b t"], mask: Bool[Tensor, "b t"], norm: float | None = None) -> SumCount:
    """Every valid token weighs the same: ``Σ L·m / Σ m``."""
    del norm
    return SumCount(masked_sum(loss, mask), mask.sum().to(loss.dtype))


@_mode("token-sum", plain_sum=True)
def token_sum(loss: Float[Tensor, "b t"], mask: Bool[Tensor, "b t"], norm: float | None = None) -> SumCount:
    """The plain token sum ``Σ L·m`` (verl 0.9.1), with count 0: ``value()`` is the total.

    Parts add up to the whole exactly; :func:`loss_denominator` gives 1 for this mode.
    """
    del norm
    return SumCount(masked_sum(loss, mask), torch.zeros((), dtype=loss.dtype, device=loss.device))


@_mode("seq-mean-token-sum")
def seq_mean_token_sum(
    loss: Float[Tensor, "b t"], mask: Bool[Tensor, "b t"], norm: float | None = None
) -> SumCount:
    """Mean over non-empty rows of each row's token sum."""
    del norm
    sums, _, rows = _row_sums(loss, mask)
    return SumCount(sums.sum(), rows)


@_mode("seq-mean-token-mean")
def seq_mean_token_mean(
    loss: Float[Tensor, "b t"], mask: Bool[Tensor, "b t"], norm: float | None = None
) -> SumCount:
    """Mean over non-empty rows of each row's token mean (``+1e-8`` as verl)."""
    del norm
    sums, lengths, rows = _row_sums(loss, mask)
    return SumCount((sums / (lengths + 1e-8)).sum(), rows)


@_mode("seq-mean-token-sum-norm")
def seq_mean_token_sum_norm(
    loss: Float[Tensor, "b t"], mask: Bool[Tensor, "b t"], norm: float | None = None
) -> SumCount:
    """Dr.GRPO: mean over non-empty rows of each row's token sum divided by ``norm``.

    ``norm`` defaults to the padded length ``T`` (verl); pass the maximum response length.
    """
    sums, _, rows = _row_sums(loss, mask)
    scale = float(loss.shape[-1]) if norm is None else float(norm)
    if scale <= 0:
        raise ValueError(f"seq-mean-token-sum-norm: norm must be positive, got {scale}")
    return SumCount(sums.sum() / scale, rows)


@_mode("row-mean")
def row_mean(loss: Float[Tensor, "b t"], mask: Bool[Tensor, "b t"], norm: float | None = None) -> SumCount:
    """Mean over all rows, empty ones included (count ``B``), of each row's token mean.

    Not a verl mode: ``seq-mean-token-mean`` with verl's ``global_batch_size`` = the number of rows.
    """
    del norm
    sums, lengths, _ = _row_sums(loss, mask)
    return SumCount((sums / (lengths + 1e-8)).sum(), torch.full((), loss.shape[0], dtype=loss.dtype,
                                                                device=loss.device))


def aggregate_loss(
    loss: Float[Tensor, "b t"], mask: Bool[Tensor, "b t"], mode: str = "token-mean", norm: float | None = None
) -> SumCount:
    """Reduce a per-token loss to a :class:`SumCount` with the named mode (see module docstring).

    Raises ``ValueError`` for an unknown mode or mismatched shapes, ``TypeError`` for a non-bool
    mask.
    """
    check_rank("aggregate_loss", 2, loss=loss)
    check_same_shape("aggregate_loss", loss=loss, mask=mask)
    check_bool("aggregate_loss", mask=mask)
    return LOSS_AGGREGATIONS[mode](loss, mask, norm)


def loss_denominator(mask: Bool[Tensor, "b t"], mode: str = "token-mean") -> Float[Tensor, ""]:
    """The divisor of the named mode's total for ``mask``, computed from the mask alone (float32).

    It is the ``count`` the mode gives for ``mask``, except for a plain sum (``token-sum``, count 0),
    where it is 1 (:meth:`Aggregation.denominator`). Compute it once over a whole mini-batch and
    backpropagate ``part.total / denominator`` for every micro-batch (clamp it to ≥ 1 for empty batches).
    A mode registered as a bare function counts as its count.
    """
    entry = LOSS_AGGREGATIONS[mode]
    return entry.denominator(mask) if isinstance(entry, Aggregation) else Aggregation(entry).denominator(mask)
