"""Prepacked products through oneDNN (:mod:`purerl.models.families.onednn`): the same maths as
``torch.mm``, to float32 rounding (the engine's decoding with them: ``tests/test_llama_decode.py``)."""

import pytest
import torch

from purerl.models.families import decoder
from purerl.models.families.onednn import OneDNNLinear, onednn_runs

pytestmark = pytest.mark.skipif(not onednn_runs(torch.float32), reason="this torch build has no oneDNN")

TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=5e-2)}
EXTRAS = [dict(), dict(bias=True), dict(residual=True), dict(bias=True, residual=True)]


def _operands(dtype):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=g).to(dtype) for shape in ((5, 64), (64, 96), (96,), (5, 96))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("extras", EXTRAS, ids=lambda e: "+".join(e) or "plain")
def test_a_prepacked_product_is_torch_mm_s(dtype, extras):
    if not onednn_runs(dtype):
        pytest.skip(f"no oneDNN products in {dtype}")
    x, w, bias, residual = _operands(dtype)
    kwargs = {k: v for k, v in (("bias", bias), ("residual", residual)) if k in extras}
    want = decoder.project(x.double(), w.double(), **{k: v.double() for k, v in kwargs.items()})
    got = decoder.project(x, OneDNNLinear.of(w), **kwargs)
    assert got.dtype == dtype
    torch.testing.assert_close(got.double(), want, **TOLERANCE[dtype])
