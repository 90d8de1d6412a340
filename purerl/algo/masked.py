"""Masked reductions over response tokens.

Masks are ``bool`` tensors (True = the token counts). Values at masked positions never leak,
not even NaN or inf: they are replaced by 0 before any arithmetic. Semantics follow verl's
``torch_functional`` (``masked_mean`` adds 1e-8 to its denominator, so an empty mask gives 0),
except where noted as a sane fix of a degenerate case.
"""

import torch
from jaxtyping import Bool, Float
from torch import Tensor

__all__ = ["masked_sum", "masked_mean", "masked_var", "masked_whiten"]


def masked_sum(x: Float[Tensor, "*shape"], mask: Bool[Tensor, "*shape"],
               dim: int | None = None) -> Float[Tensor, "..."]:
    """``Σ x·m`` over ``dim`` (all dims if None); masked entries contribute exactly 0."""
    zeroed = torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))
    return zeroed.sum() if dim is None else zeroed.sum(dim)


def masked_mean(x: Float[Tensor, "*shape"], mask: Bool[Tensor, "*shape"],
                dim: int | None = None) -> Float[Tensor, "..."]:
    """``Σ x·m / (Σ m + 1e-8)``; an empty mask gives 0 (verl's epsilon, kept for exactness)."""
    count = mask.sum() if dim is None else mask.sum(dim)
    return masked_sum(x, mask, dim) / (count.to(x.dtype) + 1e-8)


def masked_var(x: Float[Tensor, "*shape"], mask: Bool[Tensor, "*shape"], unbiased: bool = True) -> Float[Tensor, ""]:
    """Variance of the valid entries, ``mean_m((x-μ)²)·M/(M-1)`` when ``unbiased``.

    Degenerate case (verl raises ``ValueError``): with ``M = Σm < 2`` the unbiased variance is
    undefined and this returns 0 (the biased variance of ≤ 1 value).
    """
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    if not unbiased:
        return var
    count = mask.sum().to(x.dtype)
    # tensor arithmetic instead of an int() read: no host sync on accelerators
    return torch.where(count >= 2, var * (count / (count - 1).clamp_min(1)), var)  # verl's rounding order


def masked_whiten(
    x: Float[Tensor, "*shape"], mask: Bool[Tensor, "*shape"], shift_mean: bool = True
) -> Float[Tensor, "*shape"]:
    """``(x - μ)·rsqrt(var_unbiased + 1e-8)`` over the valid entries, 0 at masked entries.

    ``shift_mean=False`` adds μ back. Differences from verl, both on degenerate inputs: masked
    entries are set to 0 (verl leaves ``(x-μ)/σ`` there), and fewer than 2 valid entries give
    variance 0 instead of raising, so a single valid entry whitens to ≈ 0 (``x·1e-4``, from the
    ``1e-8`` in ``masked_mean`` and in the rsqrt).
    """
    mean = masked_mean(x, mask)
    whitened = (x - mean) * torch.rsqrt(masked_var(x, mask) + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask, whitened, torch.zeros((), dtype=whitened.dtype, device=x.device))
