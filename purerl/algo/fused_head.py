"""The LM head fused with what is read from its logits, so that no ``[n, v]`` tensor ever exists.

A policy's head maps ``n`` hidden states (rows × response positions) to ``v`` logits (up to 262,144);
materialised, ``x = hidden @ weight.T`` and its gradient are ``2·n·v`` numbers at the peak of the
step, for the few numbers per row a loss reads: the log-probs of some ids, the entropy, ``Σπ²`` and
a teacher's top ``k``. :func:`head_outputs` visits the rows in blocks of at most ``chunk_size``,
computes a block's logits, reduces them to those numbers and the per-row statistics of
:mod:`purerl.algo.logprobs` (row max ``m`` and ``log Σ exp(z − m)``, in its ``log1p`` form), and
frees the block. Backward computes each block's logits again from the saved ``hidden`` and
``weight`` and turns them into the block's ``grad_hidden`` rows and its share of ``grad_weight``
(and ``grad_bias``), summed over blocks.

The logits, per row ``i`` and column ``u < vocab``::

    x = hidden @ weight.T + bias            (the inputs' dtype, one matmul per block)
    s = c · tanh(x / c)                     (with a soft-cap c; s = x without)
    z = s / τ                               (float32 for half-precision inputs)
    log p = z − logsumexp(z)

Gradient with respect to ``x``, for upstream gradients ``g [n, k]`` (log-probs of ``ids``) and
``g_H [n]`` (entropy)::

    ∂/∂x = (Σ_j g_j · (onehot(ids_j) − p) − g_H · p · (log p + H)) · (1 − tanh²(x / c)) / τ

then ``grad_hidden = ∂x @ weight``, ``grad_weight = ∂xᵀ @ hidden``, ``grad_bias = Σ_rows ∂x``
(zero on the columns at and beyond ``vocab``). ``Σπ²`` and the top ``k`` carry no gradient.

Memory: one block's logits (``chunk_size × v``; the inputs' dtype and three float32 copies at most,
in backward) at a time; the graph saves ``hidden``, ``weight``, ``bias``, ``ids`` and three floats
per row. ``grad_weight`` of half-precision weights is summed over blocks in float32 (``4·v·h`` bytes,
a [v, h] buffer, never [n, v]) and rounded once, so that it is as accurate as the single matmul of
the unfused head; one block writes it directly in the weight's dtype. ``top_k=0`` asks for every
column: that output is ``[n, v]`` by definition.

Precision: as :mod:`purerl.algo.logprobs`, whose block helpers this module uses: ``log p`` and
``1 − p`` of a confident token stay accurate in float32 (for logits ``[20, 3]``, ``1 − p ≈ 4e-8``
and the entropy ``≈ 7e-7`` to ~1e-7 relative), here for each of the ``k`` ids, repeated ids included.
Against the unfused path (:func:`~purerl.algo.logprobs.logprobs_from_logits` and its siblings on
materialised logits) the difference is float rounding: a block's matmul may round its logits
differently from one over all rows (BLAS picks kernels by the row count).
"""

from typing import Any

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor

from purerl.algo.logprobs import (
    DEFAULT_CHUNK_ROWS,
    block_centred,
    block_check_options,
    block_compute_dtype,
    block_normalised,
)
from purerl.checks import check_floating, check_rank
from purerl.tree import pytree

__all__ = ["BLOCK_ELEMENTS", "HeadOutputs", "block_rows", "head_outputs"]


@pytree
class HeadOutputs:
    """What :func:`head_outputs` reads from the head, float32 (float64 for float64 inputs).

    ``logprobs``: ``log p`` of the ``k`` ids per row; ``entropy``: ``H = −Σ_v p_v·log p_v``;
    ``sum_pi_squared``: ``Σ_v p_v²``; ``top_logprobs``/``top_ids``: the ``top_k`` largest ``log p``
    per row, descending, and their columns. Fields not asked for are None; ``logprobs`` and
    ``entropy`` carry gradients, the others none.
    """

    logprobs: Float[Tensor, "n k"]
    entropy: Float[Tensor, " n"] | None = None
    sum_pi_squared: Float[Tensor, " n"] | None = None
    top_logprobs: Float[Tensor, "n top"] | None = None
    top_ids: Int[Tensor, "n top"] | None = None


BLOCK_ELEMENTS = 1 << 25
"""A block's logits hold about this many numbers (128 MiB in float32): rows enough that each read of the head's
weight serves many (on a GPU the products stay compute-bound), few enough that a block is a small part of a step."""


def block_rows(vocab: int) -> int:
    """Rows per block for a ``vocab``-column head: :data:`BLOCK_ELEMENTS` of logits, between 16 and 1,024 rows
    (49,152 columns: 682; 151,936: 220; 262,144: 128)."""
    return max(16, min(DEFAULT_CHUNK_ROWS, BLOCK_ELEMENTS // vocab))


def head_outputs(
    hidden: Float[Tensor, "n h"],
    weight: Float[Tensor, "v h"],
    bias: Float[Tensor, " v"] | None,
    ids: Int[Tensor, "n k"],
    *,
    temperature: float = 1.0,
    softcap: float | None = None,
    entropy: bool = False,
    sum_pi_squared: bool = False,
    top_k: int | None = None,
    vocab: int | None = None,
    chunk_size: int | None = None,
) -> HeadOutputs:
    """The log-softmax of ``z = softcap(hidden @ weight.T + bias) / τ`` read at ``ids``, and, when
    asked, its entropy, ``Σπ²`` and ``top_k`` largest entries, without materialising ``z``.

    - ``softcap`` ``c``: ``s = c·tanh(x / c)`` before the temperature (Gemma's final soft-cap);
      None: ``s = x``.
    - ``vocab``: only the first ``vocab`` columns count (a teacher scored over a shorter
      vocabulary than its embedding's rows): ``weight[:vocab]``, ``bias[:vocab]``; the gradient of
      the rows beyond is zero. ``ids`` must lie in ``[0, vocab)`` (not checked: no data is read;
      out-of-range ids raise in ``gather`` on CPU).
    - ``ids [n, k]``: ``k = 1`` the sampled tokens; ``k > 1`` e.g. a teacher's top-k ids for a
      distillation loss; repeated ids in a row each get their ``log p`` (and gradients add).
    - ``entropy``: ``H = log Σ exp z − Σ p·z``, ``0 ≤ H ≤ log vocab``; ``sum_pi_squared``:
      ``Σ p² = Σ exp(2(z − m))·exp(−2·log Σ exp(z − m))``, in ``[1/vocab, 1]``, no gradient;
      ``top_k``: the ``min(top_k, vocab)`` largest ``log p`` and their ids, no gradient; ``0``:
      every column (sorted), as a teacher's full distribution.
    - ``chunk_size``: rows per block (the only ``[·, v]`` tensors are ``chunk_size`` rows); None:
      :func:`block_rows` of the vocabulary.

    Gradients reach ``hidden``, ``weight`` and ``bias`` through ``logprobs`` and ``entropy``, in
    their dtypes (formulas in the module note). A tied head passes the embedding as ``weight``:
    its gradient here adds to its other uses' as for any tensor. ``hidden``, ``weight`` and ``bias``
    share one floating dtype; outputs are float32 for half-precision inputs, computed in float32
    per block (the matmul runs in the inputs' dtype, as the unfused head's does). Raises
    ``ValueError`` on shapes that disagree, ``temperature <= 0``, ``softcap <= 0``, ``top_k < 0``,
    ``vocab`` outside ``[1, v]`` or ``chunk_size < 1``; ``TypeError`` on non-floating or mixed
    dtypes. ``n = 0`` gives empty outputs; every row is computed (no mask).
    """
    where = "head_outputs"
    chunk_size = block_rows(weight.shape[0]) if chunk_size is None else chunk_size
    check_rank(where, 2, hidden=hidden, weight=weight, ids=ids)
    check_rank(where, 1, bias=bias)
    check_floating(where, hidden=hidden, weight=weight, bias=bias)
    if weight.dtype != hidden.dtype or (bias is not None and bias.dtype != hidden.dtype):
        raise TypeError(f"{where}: hidden, weight and bias must share a dtype, got {hidden.dtype}, {weight.dtype}"
                        f"{'' if bias is None else f' and {bias.dtype}'}")
    if ids.is_floating_point() or ids.dtype == torch.bool:
        raise TypeError(f"{where}: ids must be an integer tensor, got {ids.dtype}")
    if weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"{where}: weight has shape {tuple(weight.shape)} but hidden has shape "
                         f"{tuple(hidden.shape)}; their last dimensions must agree")
    if ids.shape[0] != hidden.shape[0]:
        raise ValueError(f"{where}: ids has shape {tuple(ids.shape)} but hidden has {hidden.shape[0]} rows")
    if bias is not None and bias.shape[0] != weight.shape[0]:
        raise ValueError(f"{where}: bias has shape {tuple(bias.shape)} but weight has {weight.shape[0]} rows")
    block_check_options(where, temperature, chunk_size)
    if softcap is not None and not softcap > 0:
        raise ValueError(f"{where}: softcap must be positive, got {softcap}")
    if top_k is not None and top_k < 0:
        raise ValueError(f"{where}: top_k must be at least 0, got {top_k}")
    v = weight.shape[0]
    if vocab is None:
        vocab = v
    if not 1 <= vocab <= v:
        raise ValueError(f"{where}: vocab must be in [1, {v}] (weight's rows), got {vocab}")
    top = None if top_k is None else (vocab if top_k == 0 else min(top_k, vocab))
    logprobs, ent, spp, top_values, top_ids, _, _ = _FusedHead.apply(
        hidden, weight, bias, ids.long(), float(temperature), None if softcap is None else float(softcap),
        bool(entropy), bool(sum_pi_squared), top, int(vocab), int(chunk_size))
    return HeadOutputs(logprobs, ent if entropy else None, spp if sum_pi_squared else None,
                       *((top_values, top_ids) if top is not None else (None, None)))


def _rows(n: int, chunk_size: int) -> range:
    return range(0, n, chunk_size)


def _block_logits(hidden: Tensor, weight: Tensor, bias: Tensor | None, dtype: torch.dtype,
                  softcap: float | None) -> tuple[Tensor, Tensor | None]:
    """``(s, t)`` for one block of rows: ``s`` the (soft-capped) logits, ``t = tanh(x / c)`` (fresh,
    ``dtype``; None without a soft-cap). ``x = hidden @ weight.T + bias`` is one matmul in the
    inputs' dtype; ``s = x`` (not upcast: the callers' helpers upcast it) or ``t·c`` in ``dtype``
    (a fresh tensor, as ``torch.tanh(x / c) * c`` computes it)."""
    x = F.linear(hidden, weight, bias)
    if softcap is None:
        return x, None
    t = torch.div(x.to(dtype), softcap).tanh_()
    return t * softcap, t


def _label_grads(log_p: Tensor, ids: Tensor, g: Tensor) -> tuple[Tensor, Tensor]:
    """``(G, Σ_j g_j·onehot(ids_j) − G·p at ids)`` per row and id, ``G = Σ_j g_j``.

    At an id column ``y`` with ``G_y = Σ_{j: ids_j = y} g_j`` the log-prob part of the gradient is
    ``G_y·(1 − p_y) − (G − G_y)·p_y``, written ``−G_y·expm1(log p_y) − (G − G_y)·p_y`` so that
    ``1 − p_y`` stays accurate when ``p_y`` is close to 1 (``k = 1``: logprobs.py's
    ``−g·expm1(log p_y)``); repeated ids get the same value.
    """
    total = g.sum(-1)
    if ids.shape[-1] == 1:
        own = g
    else:
        own = torch.where(ids[:, :, None] == ids[:, None, :], g[:, None, :], 0.0).sum(-1)
    return total, torch.expm1(log_p).mul_(-own).sub_((total[:, None] - own).mul_(log_p.exp()))


class _FusedHead(torch.autograd.Function):
    """``(log p at ids, H, Σπ², top log p, top ids, row max, log Σ exp(z − max))``; only the first
    two are differentiable. Outputs not asked for are empty tensors."""

    @staticmethod
    def forward(hidden: Tensor, weight: Tensor, bias: Tensor | None, ids: Tensor, temperature: float,
                softcap: float | None, entropy: bool, sum_pi_squared: bool, top: int | None, vocab: int,
                chunk_size: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
        n, k = ids.shape
        dtype = block_compute_dtype(hidden.dtype)
        w, b = weight[:vocab], None if bias is None else bias[:vocab]
        new = hidden.new_empty
        logprobs = new((n, k), dtype=dtype)
        peak, log_norm = new(n, dtype=dtype), new(n, dtype=dtype)
        ent = new(n if entropy else 0, dtype=dtype)
        spp = new(n if sum_pi_squared else 0, dtype=dtype)
        top_values = new((n, top) if top is not None else 0, dtype=dtype)
        top_ids = new((n, top) if top is not None else 0, dtype=torch.int64)
        for i in _rows(n, chunk_size):
            r = slice(i, i + chunk_size)
            s = _block_logits(hidden[r], w, b, dtype, softcap)[0]
            z, block_peak, block_norm = block_normalised(s, dtype, temperature)
            del s
            peak[r], log_norm[r] = block_peak, block_norm
            logprobs[r] = z.gather(-1, ids[r]) - block_norm[:, None]
            if sum_pi_squared:  # Σ exp(2z')·exp(−2·log Σ exp z'): one rounding for the normaliser
                spp[r] = torch.exp(z * 2).sum(-1).mul_(torch.exp(block_norm * -2))
            if top is not None or entropy:
                log_p = z - block_norm[:, None]
                if top is not None:
                    top_values[r], top_ids[r] = log_p.topk(top, dim=-1)
                if entropy:  # as entropy_from_logits: log Σ exp z' − Σ p·z'
                    ent[r] = block_norm - (log_p.exp_() * z).sum(-1)
        return logprobs, ent, spp, top_values, top_ids, peak, log_norm

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, ...]) -> None:
        hidden, weight, bias, ids, temperature, softcap, entropy, _, _, vocab, chunk_size = inputs
        _, ent, spp, top_values, top_ids, peak, log_norm = output
        ctx.save_for_backward(hidden, weight, bias, ids, peak, log_norm, ent)
        ctx.mark_non_differentiable(spp, top_values, top_ids, peak, log_norm)
        ctx.set_materialize_grads(False)
        ctx.temperature, ctx.softcap, ctx.entropy, ctx.vocab, ctx.chunk_size = (
            temperature, softcap, entropy, vocab, chunk_size)

    @staticmethod
    def backward(ctx: Any, grad_logprobs: Tensor | None, grad_entropy: Tensor | None,
                 *_non_differentiable: Tensor | None) -> tuple[Tensor | None, ...]:
        hidden, weight, bias, ids, peak, log_norm, ent = ctx.saved_tensors
        nones = (None,) * 8
        if not ctx.entropy:
            grad_entropy = None
        if (grad_logprobs is None and grad_entropy is None) or not any(ctx.needs_input_grad[:3]):
            return None, None, None, *nones
        tau, softcap, vocab, chunk_size = ctx.temperature, ctx.softcap, ctx.vocab, ctx.chunk_size
        n = hidden.shape[0]
        dtype = log_norm.dtype
        w, b = weight[:vocab], None if bias is None else bias[:vocab]
        want_hidden, want_weight, want_bias = ctx.needs_input_grad[:3]
        # one block writes grad_weight in its dtype; more sum in float32 and round once at the end
        acc_dtype = weight.dtype if n <= chunk_size else dtype
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        grad_weight = torch.zeros_like(weight, dtype=acc_dtype) if want_weight else None
        grad_bias = torch.zeros_like(bias, dtype=dtype) if want_bias else None
        # the upstream gradients over τ, in the computation dtype (the entropy's with its minus sign)
        g = None if grad_logprobs is None else grad_logprobs.to(dtype) / tau
        g_h = None if grad_entropy is None else grad_entropy.to(dtype) / -tau
        mean = None if g_h is None else log_norm - ent  # E_p[z'] = log Σ exp z' − H
        for i in _rows(n, chunk_size):
            r = slice(i, i + chunk_size)
            s, t = _block_logits(hidden[r], w, b, dtype, softcap)
            z = block_centred(s, dtype, tau, peak[r])
            del s
            norm = log_norm[r, None]
            if g_h is not None:  # −g_H·p·(z' − E_p[z']) = −g_H·p·(log p + H), as entropy_from_logits
                p = (z - norm).exp_()
                label_log_p = None if g is None else z.gather(-1, ids[r]).sub_(norm)
                grad = z.sub_(mean[r, None]).mul_(p).mul_(g_h[r, None])
                if g is not None:
                    at_ids = grad.gather(-1, ids[r])
                    total, label_grad = _label_grads(label_log_p, ids[r], g[r])
                    grad.addcmul_(p, total[:, None], value=-1.0).scatter_(-1, ids[r], label_grad.add_(at_ids))
                del p
            else:  # −G·p everywhere, the accurate value at the ids (:func:`_label_grads`)
                log_p = z.sub_(norm)
                total, label_grad = _label_grads(log_p.gather(-1, ids[r]), ids[r], g[r])
                grad = log_p.exp_().mul_(-total[:, None]).scatter_(-1, ids[r], label_grad)
            if t is not None:  # ∂s/∂x = 1 − tanh²(x / c)
                grad.mul_(t.mul_(t).neg_().add_(1.0))
                del t
            if grad_bias is not None:
                grad_bias[:vocab] += grad.sum(0)
            grad_x = grad.to(weight.dtype)
            del grad
            if grad_hidden is not None:
                grad_hidden[r] = grad_x @ w
            if grad_weight is not None:
                if acc_dtype == weight.dtype:
                    grad_weight[:vocab].addmm_(grad_x.T, hidden[r])
                else:
                    grad_weight[:vocab] += grad_x.T @ hidden[r]
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        if grad_bias is not None:
            grad_bias = grad_bias.to(bias.dtype)
        return grad_hidden, grad_weight, grad_bias, *nones
