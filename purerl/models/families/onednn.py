"""Matrix products through oneDNN on a CPU, for inference: the embedded engine's projections.

On the machines measured (``bench/bench_decode.py``) ``torch.mm``'s float32 products (MKL, which
repacks the weight on every call) reached less than half of what oneDNN's reached on the same
cores: a 2048² product 224 against 509 GFLOP/s. :class:`OneDNNLinear` holds a weight reordered
once into oneDNN's blocked layout; the engine prepacks its weights once per version, and
decoding's few rows then ran 2-3.5x ``torch.mm``'s rate (bfloat16 1.9x). Float32 stays float32
(IEEE products; results differ from ``torch.mm``'s in rounding only, ~1e-6 relative).
:func:`onednn_runs` says where it runs at all (not in a build without oneDNN, nor in float64).

The training forwards keep ``torch.mm``: products that reorder their operands on every call, with
gradients, ran 1.25x ``torch.mm``'s on one of the main job's micro-batches but left the job's
update time where it was (BENCHMARKS.md).
"""

import functools

import attrs
import torch
from jaxtyping import Float
from torch import Tensor

__all__ = ["OneDNNLinear", "onednn_runs"]


@attrs.frozen(eq=False)
class OneDNNLinear:
    """A projection's ``[in, out]`` matrix reordered once, for inference (no autograd)."""

    weight: Tensor  # oneDNN's layout of [out, in]

    @classmethod
    def of(cls, matrix: Float[Tensor, "i o"]) -> "OneDNNLinear":
        return cls(torch.ops.mkldnn._reorder_linear_weight(matrix.t().contiguous()))

    def project(self, x: Float[Tensor, "m i"], bias: Tensor | None, residual: Tensor | None) -> Float[Tensor, "m o"]:
        """``residual + x @ matrix + bias``, one kernel with the residual or the bias."""
        if residual is None:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, bias, "none", [], "")
        out = torch.ops.mkldnn._linear_pointwise.binary(x, residual, self.weight, None, "add")
        return out if bias is None else out + bias


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
