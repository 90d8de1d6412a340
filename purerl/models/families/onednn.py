"""Matrix products through oneDNN on a CPU: what the lean forward and decoder multiply with.

On the machines measured (``bench/bench_decode.py``, ``bench/bench_update.py``) ``torch.mm``'s
float32 products (MKL, which repacks the weight on every call) reached less than half of what
oneDNN's reached on the same cores: a 2048² product 224 against 509 GFLOP/s. Two uses:

- :class:`OneDNNLinear`: a weight reordered once into oneDNN's blocked layout, for inference
  (the embedded engine prepacks its weights once per version: decoding's few rows ran 2-3.5×
  ``torch.mm``'s rate, bfloat16 1.9×).
- :func:`onednn_product`: ``x @ w`` with gradients (the training forwards), each product
  reordering its operands per call, 1.4-1.8× ``torch.mm``'s forward and backward.

Float32 stays float32 (IEEE products; results differ from ``torch.mm``'s in rounding only, ~1e-6
relative). :func:`onednn_runs` says where it runs at all (a build without oneDNN, or float64:
``torch.mm``).
"""

import functools

import attrs
import torch
from jaxtyping import Float
from torch import Tensor

__all__ = ["OneDNNLinear", "onednn_product", "onednn_runs"]


def _packed(weight: Tensor) -> Tensor:
    """``weight`` ``[N, K]`` in oneDNN's layout: the ``B`` of products ``x @ weightᵀ``."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous())


def _product(x: Tensor, packed: Tensor, bias: Tensor | None = None, residual: Tensor | None = None) -> Tensor:
    """``residual + x @ Wᵀ + bias`` for a packed ``W`` (one kernel with the residual or the bias)."""
    if residual is None:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    out = torch.ops.mkldnn._linear_pointwise.binary(x, residual, packed, None, "add")
    return out if bias is None else out + bias


@attrs.frozen(eq=False)
class OneDNNLinear:
    """A projection's ``[in, out]`` matrix reordered once, for inference (no autograd)."""

    weight: Tensor  # oneDNN's layout of [out, in]

    @classmethod
    def of(cls, matrix: Float[Tensor, "i o"]) -> "OneDNNLinear":
        return cls(_packed(matrix.t()))

    def project(self, x: Float[Tensor, "m i"], bias: Tensor | None, residual: Tensor | None) -> Float[Tensor, "m o"]:
        return _product(x, self.weight, bias, residual)


class _Product(torch.autograd.Function):
    """``residual + x @ w + bias`` and its gradients, every product through oneDNN."""

    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, bias: Tensor | None, residual: Tensor | None) -> Tensor:
        ctx.save_for_backward(x, w)
        ctx.has_bias, ctx.has_residual = bias is not None, residual is not None
        return _product(x, _packed(w.t()), bias, residual)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, w = ctx.saved_tensors
        grad = grad.contiguous()
        needs = ctx.needs_input_grad
        grad_x = _product(grad, _packed(w)) if needs[0] else None  # grad @ wᵀ
        grad_w = _product(x.t().contiguous(), _packed(grad.t())) if needs[1] else None  # xᵀ @ grad
        grad_bias = grad.sum(0) if ctx.has_bias and needs[2] else None
        return grad_x, grad_w, grad_bias, grad if ctx.has_residual and needs[3] else None


def onednn_product(x: Float[Tensor, "m i"], w: Float[Tensor, "i o"], bias: Tensor | None = None,
                   residual: Tensor | None = None) -> Float[Tensor, "m o"]:
    """``residual + x @ w + bias`` through oneDNN, differentiable in every tensor argument."""
    return _Product.apply(x, w, bias, residual)


@functools.cache
def onednn_runs(dtype: torch.dtype) -> bool:
    """Whether this build and CPU run oneDNN's products in ``dtype`` (float32 or bfloat16),
    checked once against ``torch.mm``."""
    if dtype not in (torch.float32, torch.bfloat16) or not torch.backends.mkldnn.is_available():
        return False
    try:
        x, w = torch.randn(3, 16).to(dtype), torch.randn(16, 8).to(dtype)
        return torch.allclose(OneDNNLinear.of(w).project(x, None, None).float(), (x @ w).float(), rtol=1e-2, atol=1e-2)
    except (RuntimeError, AttributeError, NotImplementedError):
        return False
