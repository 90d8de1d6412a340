"""Products through oneDNN (:mod:`purerl.models.families.onednn`): the same maths as ``torch.mm``,
to float32 rounding, with and without gradients; float64 never takes them."""

import attrs
import pytest
import torch

from purerl.models import causal_lm_from_config, response_logprobs
from purerl.models.families import llama
from purerl.models.families.onednn import OneDNNLinear, onednn_product, onednn_runs
from purerl.tiny import random_sequences, tiny_llama_config

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
    want = llama.project(x.double(), w.double(), **{k: v.double() for k, v in kwargs.items()})
    got = llama.project(x, OneDNNLinear.of(w), **kwargs)
    assert got.dtype == dtype
    torch.testing.assert_close(got.double(), want, **TOLERANCE[dtype])


@pytest.mark.parametrize("extras", EXTRAS, ids=lambda e: "+".join(e) or "plain")
def test_the_differentiable_product_and_its_gradients_are_torch_mm_s(extras):
    """Values and the gradients of every operand against float64 ``torch.mm``, and of a
    transposed-view weight (as the fused weights are)."""
    operands = [t.requires_grad_() for t in _operands(torch.float32)]
    x, w, bias, residual = operands
    kwargs = {k: v for k, v in (("bias", bias), ("residual", residual)) if k in extras}
    g = torch.randn(5, 96, generator=torch.Generator().manual_seed(1))
    got = onednn_product(x, w.t().contiguous().t(), **kwargs)
    wanted = [t.detach().double().requires_grad_() for t in operands]
    xd, wd, bd, rd = wanted
    want = llama.project(xd, wd, **{k: v for k, v in (("bias", bd), ("residual", rd)) if k in extras})
    torch.testing.assert_close(got.double(), want.detach(), rtol=1e-5, atol=1e-5)
    grads = torch.autograd.grad(got, [x, w, *kwargs.values()], g)
    expected = torch.autograd.grad(want, [xd, wd, *[{"bias": bd, "residual": rd}[k] for k in kwargs]], g.double())
    for a, b in zip(grads, expected):
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-4)


def test_the_lean_forward_through_onednn_is_the_torch_mm_one_and_float64_stays_off():
    model, params = causal_lm_from_config(tiny_llama_config(), seed=0)
    seqs = random_sequences(6, 7, 9, 128, seed=3)
    layout = llama.layout_of(model.config)
    assert llama.fused_weights(params, layout).onednn
    assert not llama.fused_weights({k: v.double() for k, v in params.items()}, layout).onednn
    assert not llama.fused_weights(params, layout, onednn=False).onednn
    out, calls = {}, []
    product = llama.onednn_product
    for onednn in (False, True):
        original = llama.fused_weights
        llama.fused_weights = lambda p, lay, scale=None, onednn=onednn: original(p, lay, scale, onednn=onednn)
        llama.onednn_product = lambda *args, **kwargs: calls.append(onednn) or product(*args, **kwargs)
        try:
            p = {k: v.detach().requires_grad_() for k, v in params.items()}
            lp = response_logprobs(attrs.evolve(model, packed=False), p, seqs)
            grads = torch.autograd.grad(lp[seqs.response_mask].sum(), list(p.values()))
        finally:
            llama.fused_weights, llama.onednn_product = original, product
        out[onednn] = lp.detach(), dict(zip(p, grads))
    (lp0, g0), (lp1, g1) = out[False], out[True]
    assert calls and set(calls) == {True}  # every product of the oneDNN forward, none of the other
    torch.testing.assert_close(lp1, lp0, rtol=0, atol=1e-5)
    for name, grad in g0.items():
        torch.testing.assert_close(g1[name], grad, rtol=1e-4, atol=1e-5, msg=name)
