"""Token log-probabilities and entropies from vocabulary logits, without a full float32 copy.

Logits of a language model are ``[b, t, v]`` with ``v`` in the hundreds of thousands, usually in
bfloat16. Upcasting them whole (as ``log_softmax(logits.float())`` does, and as its autograd graph
does again in backward) costs ``4·b·t·v`` bytes at the peak of the step. The two functions here
are ``torch.autograd.Function``\\ s that visit the ``b·t`` positions in blocks of at most
``chunk_size`` rows, upcast one block at a time, and keep only per-row statistics between forward
and backward (the row max ``m`` and ``n = log Σ exp(z − m)``, so ``logsumexp = m + n``); backward
recomputes the softmax block by block and writes the gradient directly in the logits' dtype.

The computation dtype is ``float32`` for half-precision logits and the logits' own dtype for
``float32``/``float64``; outputs have that dtype. Temperature divides the logits first
(``z = x / τ``), as verl's actor does before both log-probs and entropy.

Precision: ``n`` is ``log1p`` of the sum without the maximal term, so ``log p`` and ``1 − p`` of
a confident token stay accurate in float32. verl's float32 formulas (``z_y − logsumexp z`` and
``logsumexp z − Σ p·z``) round them away: for logits ``[20, 3]`` verl's entropy is 0 and the
label gradient is 0, here they are correct to ~1e-7 relative. Elsewhere the two agree to float
rounding.
"""

import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor

from purerl.checks import check_floating, check_rank

__all__ = [
    "logprobs_from_logits",
    "entropy_from_logits",
    "sum_pi_squared_from_logits",
    "DEFAULT_CHUNK_ROWS",
    "block_centred",
    "block_check_options",
    "block_compute_dtype",
    "block_normalised",
]

DEFAULT_CHUNK_ROWS = 1024
"""Positions upcast at once: 1024 rows of a 152k vocabulary are ~0.6 GiB of float32."""


def logprobs_from_logits(
    logits: Float[Tensor, "b t v"],
    labels: Int[Tensor, "b t"],
    *,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_ROWS,
    compiled: bool = False,
) -> Float[Tensor, "b t"]:
    """``log softmax(z)[y] = z_y − logsumexp(z)`` with ``z = logits / temperature``.

    Every position is computed (no mask: padding positions hold the log-prob of whatever label
    sits there). Gradient: ``∂/∂logits = g·(onehot(y) − softmax(z)) / τ``, in the logits' dtype.
    Memory: at most ``chunk_size`` rows are upcast at a time; the graph saves the logits, the
    labels and two floats per position (row max and log-normaliser). Differs from verl only in
    precision: verl computes half-precision logits' log-softmax (and ``logits / τ``) in their own
    dtype, here both are in float32, and see the module note on confident tokens.
    ``temperature <= 0`` raises ``ValueError`` (verl clamps it to 1e-8). ``compiled``: forward and
    backward each run as one kernel over all positions, compiled by ``torch.compile`` (the same
    formulas, fused; no float32 block is materialised, so ``chunk_size`` does not apply).
    """
    check_rank("logprobs_from_logits", 3, logits=logits)
    check_floating("logprobs_from_logits", logits=logits)
    if labels.shape != logits.shape[:-1]:
        raise ValueError(
            f"logprobs_from_logits: labels has shape {tuple(labels.shape)} but logits has shape "
            f"{tuple(logits.shape)}; labels must be logits.shape[:-1]"
        )
    block_check_options("logprobs_from_logits", temperature, chunk_size)
    logprobs, _, _ = _ChunkedLogProbs.apply(logits, labels.long(), float(temperature), int(chunk_size), compiled)
    return logprobs


def entropy_from_logits(
    logits: Float[Tensor, "*rows v"],
    *,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_ROWS,
) -> Float[Tensor, "*rows"]:
    """``H = logsumexp(z) − Σ_v softmax(z)_v·z_v`` over the last dimension, ``z = logits / τ``.

    ``0 ≤ H ≤ log v``. Every position is computed (no mask). Gradient:
    ``∂H/∂logits = −g·p·(z − E_p[z]) / τ`` with ``E_p[z] = logsumexp(z) − H``, recomputed per block
    in backward; the graph saves the logits and three floats per position (row max,
    log-normaliser, ``H``). Same precision notes and ``temperature`` check as
    :func:`logprobs_from_logits`; logits must be finite (``−inf`` entries give NaN, as in verl).
    Leading dimensions beyond two are flattened, which copies (in the logits' dtype) only if their
    strides do not allow a view.
    """
    check_floating("entropy_from_logits", logits=logits)
    if logits.dim() < 1:
        raise ValueError("entropy_from_logits: logits must have a vocabulary dimension, got a 0-d tensor")
    block_check_options("entropy_from_logits", temperature, chunk_size)
    entropy, _, _ = _ChunkedEntropy.apply(logits, float(temperature), int(chunk_size))
    return entropy


def sum_pi_squared_from_logits(
    logits: Float[Tensor, "*rows v"], temperature: float = 1.0
) -> Float[Tensor, "*rows"]:
    """``Σ_v softmax(z)_v² = exp(logsumexp(2z) − 2·logsumexp(z))``, ``z = logits / temperature``.

    verl's ``calculate_sum_pi_squared_from_logits`` (the optimal token baseline's ``Σπ²``), in
    float32 for half-precision logits (the logits' dtype for float32/float64), over the last
    dimension, with ``max z`` subtracted first (the same value, without the float32 rounding of
    two large logsumexps). In ``[1/v, 1]``. Not chunked: it upcasts the whole tensor; call it under
    ``torch.no_grad()`` on blocks of positions for large vocabularies.
    """
    check_floating("sum_pi_squared_from_logits", logits=logits)
    if logits.dim() < 1:
        raise ValueError("sum_pi_squared_from_logits: logits must have a vocabulary dimension")
    block_check_options("sum_pi_squared_from_logits", temperature, 1)
    z = logits.to(block_compute_dtype(logits.dtype)) / temperature
    z = z - z.amax(-1, keepdim=True)  # the same value; keeps both logsumexps near 0 (precision)
    return torch.exp(torch.logsumexp(2 * z, -1) - 2 * torch.logsumexp(z, -1))


def block_check_options(where: str, temperature: float, chunk_size: int) -> None:
    if not temperature > 0:
        raise ValueError(f"{where}: temperature must be positive, got {temperature}")
    if chunk_size < 1:
        raise ValueError(f"{where}: chunk_size must be at least 1, got {chunk_size}")


def block_compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _as_3d(x: Tensor) -> Tensor:
    """``x[..., v]`` as ``[b, t, v]`` (a view for 1-3 dims and for contiguous leading dims)."""
    if x.dim() == 1:
        return x[None, None]
    if x.dim() == 2:
        return x[None]
    return x.flatten(0, -3)


def _blocks(b: int, t: int, rows: int) -> Iterator[tuple[slice, slice]]:
    """Slices ``(rows of b, tokens of t)`` tiling a ``[b, t]`` grid, each at most ``rows`` positions.

    Blocks are basic-indexing views of any strided tensor, so ``logits[:, :-1]`` is never copied.
    """
    if b == 0 or t == 0:
        return
    if t <= rows:
        step = rows // t
        for i in range(0, b, step):
            yield slice(i, i + step), slice(None)
    else:
        for i in range(b):
            for j in range(0, t, rows):
                yield slice(i, i + 1), slice(j, j + rows)


def block_centred(block: Tensor, dtype: torch.dtype, temperature: float, peak: Tensor) -> Tensor:
    """A fresh ``dtype`` tensor ``z − peak`` for ``z = block / τ`` (callers may update it in place)."""
    z = block.to(dtype, copy=True)
    if temperature != 1.0:
        z.div_(temperature)
    return z.sub_(peak[..., None])


def block_normalised(block: Tensor, dtype: torch.dtype, temperature: float) -> tuple[Tensor, Tensor, Tensor]:
    """``(z' = z − max z, max z, log Σ exp z')`` for ``z = block / τ``; ``z'`` is fresh.

    The normaliser is ``log1p`` of the sum without the (first) maximal term, so ``log p`` stays
    accurate when one token takes nearly all the mass: ``log(1 + ε)`` in float32 rounds ``ε``
    below 6e-8 to 0, and a stored ``logsumexp`` of large logits rounds away more still, which
    would zero the gradient ``g·(1 − p_y)`` of a confident token.
    """
    z = block.to(dtype, copy=True)
    if temperature != 1.0:
        z.div_(temperature)
    peak, top = z.max(-1, keepdim=True)
    z.sub_(peak)
    rest = z.exp().scatter_(-1, top, 0.0).sum(-1)
    return z, peak.squeeze(-1), torch.log1p(rest)


class _ChunkedLogProbs(torch.autograd.Function):
    """``(log p_y, row max, log Σ exp(z − max))``; the two statistics are saved, not differentiable."""

    @staticmethod
    def forward(
        logits: Tensor, labels: Tensor, temperature: float, chunk_size: int, compiled: bool
    ) -> tuple[Tensor, Tensor, Tensor]:
        if compiled:
            return _logprob_stats(logits, labels, temperature)
        b, t, _ = logits.shape
        dtype = block_compute_dtype(logits.dtype)
        logprobs, peak, log_norm = (logits.new_empty((b, t), dtype=dtype) for _ in range(3))
        for rows, cols in _blocks(b, t, chunk_size):
            z, block_peak, block_norm = block_normalised(logits[rows, cols], dtype, temperature)
            peak[rows, cols] = block_peak
            log_norm[rows, cols] = block_norm
            logprobs[rows, cols] = z.gather(-1, labels[rows, cols, None]).squeeze(-1) - block_norm
        return logprobs, peak, log_norm

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor, Tensor]) -> None:
        logits, labels, temperature, chunk_size, compiled = inputs
        logprobs, peak, log_norm = output
        ctx.save_for_backward(logits, labels, peak, log_norm, *([logprobs] if compiled else []))
        ctx.mark_non_differentiable(peak, log_norm)
        ctx.temperature, ctx.chunk_size, ctx.compiled = temperature, chunk_size, compiled

    @staticmethod
    def backward(
        ctx: Any, grad_logprobs: Tensor, _grad_peak: Tensor, _grad_norm: Tensor
    ) -> tuple[Tensor | None, None, None, None, None]:
        logits, labels, peak, log_norm, *logprobs = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None
        if ctx.compiled:
            return _logprob_grad(logits, labels, logprobs[0], grad_logprobs, peak, log_norm, ctx.temperature), \
                None, None, None, None
        b, t, _ = logits.shape
        tau = ctx.temperature
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        for rows, cols in _blocks(b, t, ctx.chunk_size):
            g = grad_logprobs[rows, cols, None].to(log_norm.dtype) / tau
            y = labels[rows, cols, None]
            z = block_centred(logits[rows, cols], log_norm.dtype, tau, peak[rows, cols])
            log_p = z.sub_(log_norm[rows, cols, None])
            # g·(onehot − p): −g·p everywhere, and g·(1 − p_y) = −g·expm1(log p_y) at the label,
            # which keeps 1 − p_y accurate when p_y is close to 1
            label_grad = torch.expm1(log_p.gather(-1, y)).mul_(-g)
            grad[rows, cols] = log_p.exp_().mul_(-g).scatter_(-1, y, label_grad)
        return grad, None, None, None, None


def _logprob_stats(logits: Tensor, labels: Tensor, temperature: float) -> tuple[Tensor, Tensor, Tensor]:
    """:class:`_ChunkedLogProbs`' forward over all positions at once (one fused kernel under
    ``torch.compile``; a select by vocabulary index where the blocks scatter): ``(log p_y, max z,
    log1p Σ_{v ≠ argmax} exp(z_v − max z))``. ``log1p`` runs eagerly on the per-position sums."""
    z_y, peak, rest = _compiled(_logprob_sums)(logits, labels, temperature)
    log_norm = torch.log1p(rest)
    return z_y - log_norm, peak, log_norm


def _logprob_sums(logits: Tensor, labels: Tensor, temperature: float) -> tuple[Tensor, Tensor, Tensor]:
    z = logits.to(block_compute_dtype(logits.dtype)) / temperature
    peak, top = z.max(-1, keepdim=True)
    vocab = torch.arange(z.shape[-1], device=z.device)
    rest = torch.where(vocab == top, 0.0, (z - peak).exp()).sum(-1)
    return (z.gather(-1, labels[..., None]) - peak).squeeze(-1), peak.squeeze(-1), rest


def _logprob_grad(logits: Tensor, labels: Tensor, logprobs: Tensor, grad_logprobs: Tensor, peak: Tensor,
                  log_norm: Tensor, temperature: float) -> Tensor:
    """:class:`_ChunkedLogProbs`' backward over all positions at once: ``g·(onehot − p) / τ`` in the
    logits' dtype. The label's ``g·(1 − p_y) = −g·expm1(log p_y)`` is taken eagerly on the saved
    log-probs (compiled CPU code computes ``expm1`` as ``exp − 1``, which loses ``1 − p_y`` near 1),
    the rest in one fused kernel."""
    g = grad_logprobs.to(log_norm.dtype) / temperature
    return _compiled(_softmax_grad)(logits, labels, torch.expm1(logprobs).mul_(-g), g, peak, log_norm, temperature)


def _softmax_grad(logits: Tensor, labels: Tensor, label_grad: Tensor, g: Tensor, peak: Tensor, log_norm: Tensor,
                  temperature: float) -> Tensor:
    log_p = logits.to(log_norm.dtype) / temperature - peak[..., None] - log_norm[..., None]
    vocab = torch.arange(logits.shape[-1], device=logits.device)
    return torch.where(vocab == labels[..., None], label_grad[..., None], log_p.exp() * -g[..., None]).to(logits.dtype)


@functools.cache
def _compiled(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` compiled by ``torch.compile`` (built on first use, once per process)."""
    return torch.compile(fn)


class _ChunkedEntropy(torch.autograd.Function):
    """``(H, row max, log Σ exp(z − max))`` over ``[..., v]``; only ``H`` is differentiable."""

    @staticmethod
    def forward(logits: Tensor, temperature: float, chunk_size: int) -> tuple[Tensor, Tensor, Tensor]:
        x = _as_3d(logits)
        b, t, _ = x.shape
        dtype = block_compute_dtype(logits.dtype)
        entropy, peak, log_norm = (logits.new_empty((b, t), dtype=dtype) for _ in range(3))
        for rows, cols in _blocks(b, t, chunk_size):
            z, block_peak, block_norm = block_normalised(x[rows, cols], dtype, temperature)
            peak[rows, cols] = block_peak
            log_norm[rows, cols] = block_norm
            probs = (z - block_norm[..., None]).exp_()
            entropy[rows, cols] = block_norm - (probs * z).sum(-1)
        shape = logits.shape[:-1]
        return entropy.reshape(shape), peak.reshape(shape), log_norm.reshape(shape)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor, Tensor]) -> None:
        logits, temperature, chunk_size = inputs
        entropy, peak, log_norm = output
        ctx.save_for_backward(logits, peak, log_norm, entropy)
        ctx.mark_non_differentiable(peak, log_norm)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size

    @staticmethod
    def backward(
        ctx: Any, grad_entropy: Tensor, _grad_peak: Tensor, _grad_norm: Tensor
    ) -> tuple[Tensor | None, None, None]:
        logits, peak, log_norm, entropy = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None
        tau = ctx.temperature
        x = _as_3d(logits)
        b, t, _ = x.shape
        # with z' = z − max: E_p[z'] = log Σ exp(z') − H, both small when p is peaked
        peak3, norm3 = peak.reshape(b, t), log_norm.reshape(b, t)
        mean3, g3 = (log_norm - entropy).reshape(b, t), grad_entropy.reshape(b, t)
        grad = torch.empty(x.shape, dtype=logits.dtype, device=logits.device)
        for rows, cols in _blocks(b, t, ctx.chunk_size):
            z = block_centred(x[rows, cols], log_norm.dtype, tau, peak3[rows, cols])
            p = (z - norm3[rows, cols, None]).exp_()
            scale = g3[rows, cols, None].to(log_norm.dtype) / -tau
            # −g·p·(z − E_p[z]) / τ
            grad[rows, cols] = z.sub_(mean3[rows, cols, None]).mul_(p).mul_(scale)
        return grad.reshape(logits.shape), None, None
