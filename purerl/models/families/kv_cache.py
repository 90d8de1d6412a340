"""The static KV cache of the shared decoder's decoding (:mod:`.decode`) and the attention of one
new token per row over it.

Decoding through the HF module grows a ``DynamicCache`` (one ``torch.cat`` per layer and token, so
O(T²) copying). :class:`StaticCache` is preallocated for a call's capacity and written in place;
every layer keeps its whole cache (a sliding layer masks the slots further back than its window
instead of dropping them). Rows that repeat a prompt read its keys and values once per group
(:class:`SharedPrefix`, :func:`shared_prefix_attention`).

Shapes: ``b`` rows, ``t`` cache capacity, ``h`` query heads, ``k`` key/value heads, ``d`` head size.
"""

from typing import Protocol, runtime_checkable

import attrs
import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

__all__ = ["CacheShape", "SharedPrefix", "StaticCache", "one_query_attention", "shared_prefix_attention",
           "window_slots", "window_slots_of_last"]


@runtime_checkable
class CacheShape(Protocol):
    """The sizes a cache is made of (a :class:`~purerl.models.families.weights.Layout`)."""

    layers: int
    kv_heads: int
    head_dim: int


@attrs.frozen
class SharedPrefix:
    """The keys and values of the ``P`` slots that each group of ``n`` consecutive rows shares (a
    prompt and its samples), once per group: ``[g, K, P, D]`` per layer. A decoding step reads
    them once per group instead of once per row (:func:`shared_prefix_attention`)."""

    keys: list[Tensor]
    values: list[Tensor]
    n: int

    @property
    def length(self) -> int:
        return self.keys[0].shape[2]


@attrs.define
class StaticCache:
    """Keys and values of every layer, ``[b, K, t, D]`` each, filled in place; ``valid[b, t]`` marks
    the positions that are real tokens (left padding and unwritten slots are not). ``shared``:
    the first slots' keys and values once per group of rows, when the rows repeat them (set by
    :meth:`repeat_rows`; any other copy drops it)."""

    keys: list[Tensor]
    values: list[Tensor]
    valid: Bool[Tensor, "b t"]
    length: int = 0
    shared: SharedPrefix | None = None

    @classmethod
    def empty(cls, layout: CacheShape, rows: int, capacity: int, *, dtype: torch.dtype,
              device: torch.device) -> "StaticCache":
        shape = (rows, layout.kv_heads, capacity, layout.head_dim)
        # zeros, not empty: masked slots still enter the products (and NaN · 0 is NaN)
        return cls([torch.zeros(shape, dtype=dtype, device=device) for _ in range(layout.layers)],
                   [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layout.layers)],
                   torch.zeros((rows, capacity), dtype=torch.bool, device=device))

    def repeat_rows(self, n: int) -> "StaticCache":
        """Every row ``n`` times in a row (``repeat_interleave``): one prefilled prompt per sample;
        the written slots also kept once per prompt (``shared``)."""
        # copies of the written slots only: the prompt rows' whole capacity need not stay alive
        shared = SharedPrefix([k[:, :, :self.length].clone() for k in self.keys],
                              [v[:, :, :self.length].clone() for v in self.values], n)
        return StaticCache([k.repeat_interleave(n, 0) for k in self.keys],
                           [v.repeat_interleave(n, 0) for v in self.values],
                           self.valid.repeat_interleave(n, 0), self.length, shared)

    def select_rows(self, rows: Int[Tensor, " r"]) -> "StaticCache":
        """Only ``rows``, copied (the batch without its finished rows)."""
        return StaticCache([k[rows] for k in self.keys], [v[rows] for v in self.values], self.valid[rows], self.length)

    def grown(self, capacity: int) -> "StaticCache":
        """A copy with room for ``capacity`` slots (the written ones kept): an earlier turn's cache,
        continued by the next."""
        def grow(x: Tensor) -> Tensor:  # [b, K, t, D] keys/values or [b, t] validity: slots on dim 2 or 1
            dim = 2 if x.dim() == 4 else 1
            out = x.new_zeros((*x.shape[:dim], capacity, *x.shape[dim + 1:]))
            out.narrow(dim, 0, self.length).copy_(x.narrow(dim, 0, self.length))
            return out

        return StaticCache([grow(k) for k in self.keys], [grow(v) for v in self.values], grow(self.valid), self.length)


def one_query_attention(q: Float[Tensor, "b h 1 d"], keys: Float[Tensor, "b k t d"], values: Float[Tensor, "b k t d"],
                        mask: Bool[Tensor, "b 1 1 t"], scale: float) -> Float[Tensor, "b h 1 d"]:
    """Attention of one new token per row over its cache, as two batched products with the query
    heads grouped by the key-value head they share (query head ``h`` reads key-value head
    ``h // (h_q / h_kv)``, as grouped-query attention repeats them), the softmax in float32 (or
    the inputs' wider dtype).
    What ``scaled_dot_product_attention`` computes; on a CPU its kernel for one query costs up to
    12× this (bfloat16) and is never faster."""
    b, heads, _, dim = q.shape
    kv_heads = keys.shape[1]
    grouped = q.reshape(b, kv_heads, heads // kv_heads, dim)
    weights = _attention_weights(torch.matmul(grouped, keys.transpose(-1, -2)), mask, scale, values.dtype)
    return torch.matmul(weights, values).reshape(b, heads, 1, dim)


def _attention_weights(scores: Tensor, mask: Tensor, scale: float, dtype: torch.dtype) -> Tensor:
    """Softmax of the scaled, masked scores, in float32 (or the scores' wider dtype), cast to ``dtype``."""
    scores = scores.to(torch.promote_types(scores.dtype, torch.float32)) * scale
    return torch.softmax(scores.masked_fill(~mask, float("-inf")), -1).to(dtype)


def shared_prefix_attention(q: Float[Tensor, "b h 1 d"], prefix: SharedPrefix, i: int, keys: Float[Tensor, "b k t d"],
                            values: Float[Tensor, "b k t d"], mask: Bool[Tensor, "b 1 1 t"],
                            scale: float) -> Float[Tensor, "b h 1 d"]:
    """:func:`one_query_attention` over a cache whose first ``P = prefix.length`` slots each group
    of ``prefix.n`` rows shares: those keys and values are read once per group (layer ``i`` of
    ``prefix``; the per-row copies in ``keys``/``values`` are not read), the rest per row, under
    one softmax. The same attention, products summed in another order."""
    b, heads, _, dim = q.shape
    n, p = prefix.n, prefix.length
    g, kv_heads = b // n, keys.shape[1]
    per = heads // kv_heads
    grouped = q.reshape(b, kv_heads, per, dim)
    # each group's rows' queries side by side against its shared keys: [g, K, n·G, P]
    by_group = grouped.reshape(g, n, kv_heads, per, dim).transpose(1, 2).reshape(g, kv_heads, n * per, dim)
    shared = torch.matmul(by_group, prefix.keys[i].transpose(-1, -2))
    shared = shared.reshape(g, kv_heads, n, per, p).transpose(1, 2).reshape(b, kv_heads, per, p)
    own = torch.matmul(grouped, keys[:, :, p:].transpose(-1, -2))
    weights = _attention_weights(torch.cat((shared, own), -1), mask, scale, values.dtype)
    on_shared = weights[..., :p].reshape(g, n, kv_heads, per, p).transpose(1, 2).reshape(g, kv_heads, n * per, p)
    out = torch.matmul(on_shared, prefix.values[i])
    out = out.reshape(g, kv_heads, n, per, dim).transpose(1, 2).reshape(b, kv_heads, per, dim)
    return (out + torch.matmul(weights[..., p:], values[:, :, p:])).reshape(b, heads, 1, dim)


def window_slots(valid: Bool[Tensor, "b stop"], start: int, window: int) -> Bool[Tensor, "b 1 s stop"]:
    """Which of the ``stop`` slots are within ``window`` attended slots of each query slot
    ``start … stop-1`` (the query itself counts; later slots too, which the causal mask removes).
    Counted in attended slots, not positions: a row's tokens are at consecutive positions, as the
    engine places them, so the cache needs no positions (and its unattended slots, rows that
    finished early in a kept cache, do not count)."""
    counts = valid.long().cumsum(-1)
    return ((counts[:, start:, None] - counts[:, None, :]) < window)[:, None]


def window_slots_of_last(valid: Bool[Tensor, "b t"], window: int) -> Bool[Tensor, "b 1 1 t"]:
    """:func:`window_slots` of a fixed-shape step's one query, the row's last attended slot (every
    shape fixed: the whole capacity, unwritten slots unattended)."""
    return ((valid.sum(-1, keepdim=True) - valid.long().cumsum(-1)) < window)[:, None, None]
