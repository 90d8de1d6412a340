"""The fused LM head equals the unfused head (materialised logits, then logprobs.py), without its memory."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from property_tests.allocations import Largest
from purerl.algo.fused_head import head_outputs
from purerl.algo.logprobs import entropy_from_logits, logprobs_from_logits, sum_pi_squared_from_logits

temperatures = st.sampled_from([1.0, 0.6, 1.7]) | st.floats(0.25, 4.0)
softcaps = st.none() | st.sampled_from([1.0, 30.0]) | st.floats(1.0, 30.0)


def sized(low: float, high: float) -> st.SearchStrategy[float]:
    """0 or ``low ≤ |x| ≤ high``: values whose products stay in float32's (and bfloat16's) normal
    range (a float64 1e-38 underflows there, as any float32 computation's does)."""
    return st.just(0.0) | st.floats(low, high) | st.floats(-high, -low)


upstream = sized(1e-3, 3.0)


@st.composite
def heads(draw):
    """A head's inputs (float64 numpy, cast by the tests) and options: ``n ≤ 10`` rows, ``h ≤ 5``,
    ``v ≤ 12`` columns of which the first ``vocab`` count, ``k ≤ 3`` ids (repeats allowed), logits
    up to ±30 (:func:`sized` values), upstream gradients for the log-probs and the entropy, and a
    block size below and above ``n``."""
    n, h, v = draw(st.integers(1, 10)), draw(st.integers(1, 5)), draw(st.integers(2, 12))
    vocab = draw(st.none() | st.integers(1, v))
    k = draw(st.integers(1, 3))
    return dict(
        hidden=draw(arrays(np.float64, (n, h), elements=sized(2.0**-10, 2.0))),
        weight=draw(arrays(np.float64, (v, h), elements=sized(2.0**-10, 2.0))),
        bias=draw(st.none() | arrays(np.float64, (v,), elements=sized(2.0**-10, 10.0))),
        ids=draw(arrays(np.int64, (n, k), elements=st.integers(0, (vocab or v) - 1))),
        grad_logprobs=draw(arrays(np.float64, (n, k), elements=upstream)),
        grad_entropy=draw(arrays(np.float64, (n,), elements=upstream)),
        temperature=draw(temperatures),
        softcap=draw(softcaps),
        vocab=vocab,
        chunk_size=draw(st.integers(1, n + 2)),
    )


def _tensors(case, dtype):
    """``(hidden, weight, bias)`` as fresh leaves in ``dtype``, and ``ids``."""
    def leaf(x):
        return None if x is None else torch.from_numpy(x).to(dtype).requires_grad_()

    return leaf(case["hidden"]), leaf(case["weight"]), leaf(case["bias"]), torch.from_numpy(case["ids"])


def unfused_logits(hidden, weight, bias, *, softcap=None, vocab=None):
    """The head as the model computes it: ``hidden @ weight.T + bias`` materialised, the first
    ``vocab`` columns, soft-capped (in float32 at least, as the fused head does)."""
    x = F.linear(hidden, weight, bias)[:, :vocab]
    if softcap is not None:
        x = x.to(torch.promote_types(x.dtype, torch.float32))
        x = torch.tanh(x / softcap) * softcap
    return x


def unfused(hidden, weight, bias, ids, *, temperature=1.0, softcap=None, vocab=None):
    """``(logits, log p at ids [n, k], entropy, Σπ²)`` through logprobs.py on the materialised logits."""
    x = unfused_logits(hidden, weight, bias, softcap=softcap, vocab=vocab)
    logp = torch.stack([logprobs_from_logits(x[None], ids[None, :, j], temperature=temperature)[0]
                        for j in range(ids.shape[1])], -1)
    return x, logp, entropy_from_logits(x, temperature=temperature), sum_pi_squared_from_logits(x, temperature)


def _objective(logp, entropy, case, use):
    """``Σ g·log p`` and/or ``Σ g_H·H`` (``use``: which of the two the loss reads)."""
    total = 0.0
    if use in ("logprobs", "both"):
        total = total + (logp * torch.from_numpy(case["grad_logprobs"]).to(logp.dtype)).sum()
    if use in ("entropy", "both"):
        total = total + (entropy * torch.from_numpy(case["grad_entropy"]).to(entropy.dtype)).sum()
    return total


def _leaves(hidden, weight, bias):
    return [x for x in (hidden, weight, bias) if x is not None]


def _magnitudes(case, hidden, weight, bias, use, *, cap_rounding=False):
    """Per-element ``Σ|terms|`` of ``grad_hidden = ∂x @ W``, ``grad_weight = ∂xᵀ @ hidden`` and
    ``grad_bias = Σ_rows ∂x`` (float64), with ``|∂x| ≤ (Σ_j |g_j|·(onehot_j + p) + |g_H|·p·(|log p| + H))
    · (1 − tanh²(x/c)) / τ``: the scale that float rounding in ``∂x`` and in the sums is relative to.
    ``cap_rounding``: the same with ``2⁻²²`` for ``1 − tanh²`` (0 without a soft-cap), the absolute
    error of ``1 − t²`` from a float32 ``t = tanh(x/c)`` where ``t`` rounds to within a few units
    of ±1 (both heads take it so, as torch's tanh backward does)."""
    h64, w64 = hidden.detach().double(), weight.detach().double()
    b64 = None if bias is None else bias.detach().double()
    x = F.linear(h64, w64, b64)[:, :case["vocab"]]
    c, tau = case["softcap"], case["temperature"]
    if cap_rounding:
        deriv = torch.full_like(x, 0.0 if c is None else 2.0**-22)
    else:
        deriv = torch.ones_like(x) if c is None else 1 - torch.tanh(x / c) ** 2
    log_p = torch.log_softmax((x if c is None else torch.tanh(x / c) * c) / tau, -1)
    p = log_p.exp()
    mag = torch.zeros_like(x)
    if use in ("logprobs", "both"):
        g = torch.from_numpy(case["grad_logprobs"]).abs()
        ids = torch.from_numpy(case["ids"])
        mag += torch.zeros_like(x).scatter_add_(-1, ids, g) + g.sum(-1, keepdim=True) * p
    if use in ("entropy", "both"):
        g_h = torch.from_numpy(case["grad_entropy"]).abs()[:, None]
        mag += g_h * p * (log_p.abs() - (p * log_p).sum(-1, keepdim=True))
    mag = mag * deriv / tau
    pad = w64.shape[0] - mag.shape[1]
    bounds = [mag @ w64[:case["vocab"]].abs(), F.pad(mag.T @ h64.abs(), (0, 0, 0, pad))]
    return bounds + ([F.pad(mag.sum(0), (0, pad))] if bias is not None else [])


@given(case=heads(), entropy=st.booleans(), use=st.sampled_from(["logprobs", "entropy", "both"]))
@settings(max_examples=120)
def test_fused_head_equals_the_unfused_head_in_values_and_gradients_float32(case, entropy, use):
    use = use if entropy else "logprobs"
    opts = dict(temperature=case["temperature"], softcap=case["softcap"], vocab=case["vocab"])
    hidden, weight, bias, ids = _tensors(case, torch.float32)
    out = head_outputs(hidden, weight, bias, ids, entropy=entropy, sum_pi_squared=True,
                       chunk_size=case["chunk_size"], **opts)
    grads = torch.autograd.grad(_objective(out.logprobs, out.entropy, case, use), _leaves(hidden, weight, bias))

    x, logp, ent, spp = unfused(hidden, weight, bias, ids, **opts)
    ref_grads = torch.autograd.grad(_objective(logp, ent, case, use), _leaves(hidden, weight, bias))

    assert out.logprobs.dtype == torch.float32 and out.logprobs.shape == ids.shape
    assert (out.entropy is not None) == entropy and out.top_logprobs is None and out.top_ids is None
    # 1e-6 relative, and a few float32 units of the largest |z|: a block's matmul may round its
    # logits differently from the whole matrix's (BLAS picks kernels by the number of rows)
    scale = max(1.0, x.detach().abs().max().item() / case["temperature"])
    torch.testing.assert_close(out.logprobs, logp, rtol=1e-6, atol=1e-6 * scale)
    if entropy:
        torch.testing.assert_close(out.entropy, ent, rtol=1e-6, atol=1e-6 * scale)
    torch.testing.assert_close(out.sum_pi_squared, spp, rtol=1e-6, atol=1e-7)
    bounds = _magnitudes(case, hidden, weight, bias, use)
    cap_errors = _magnitudes(case, hidden, weight, bias, use, cap_rounding=True)
    for grad, ref, bound, cap_error in zip(grads, ref_grads, bounds, cap_errors):
        assert grad.dtype == torch.float32 and grad.shape == ref.shape
        torch.testing.assert_close(grad, ref, rtol=1e-6, atol=1e-6 * bound.max().item() + cap_error.max().item())


@given(case=heads())
@settings(max_examples=80)
def test_bfloat16_inputs_stay_within_the_unfused_heads_tolerances(case):
    # reference: float64 from the bf16 logits (the matmul rounds to bf16 in both heads); values
    # within logprobs.py's bf16 tolerance (1e-5), gradients within its 1.6e-2, relative to Σ|terms|;
    # the unfused head passes the same bounds
    opts = dict(temperature=case["temperature"], softcap=case["softcap"], vocab=case["vocab"])
    tau, vocab = case["temperature"], case["vocab"]
    hidden, weight, bias, ids = _tensors(case, torch.bfloat16)
    x16 = F.linear(hidden, weight, bias)[:, :vocab].detach()
    x = x16.double().requires_grad_()
    s = x if case["softcap"] is None else torch.tanh(x / case["softcap"]) * case["softcap"]
    log_p = torch.log_softmax(s / tau, -1)
    ref_logp, ref_ent = log_p.gather(-1, ids), -(log_p.exp() * log_p).sum(-1)
    (grad_x,) = torch.autograd.grad(_objective(ref_logp, ref_ent, case, "both"), x)
    h64, w64 = hidden.detach().double(), weight.detach().double()
    pad = weight.shape[0] - grad_x.shape[1]
    ref_grads = [grad_x @ w64[:vocab], F.pad(grad_x.T @ h64, (0, 0, 0, pad))]
    ref_grads += [F.pad(grad_x.sum(0), (0, pad))] if bias is not None else []
    bounds = _magnitudes(case, hidden, weight, bias, "both")
    cap_errors = _magnitudes(case, hidden, weight, bias, "both", cap_rounding=True)

    out = head_outputs(hidden, weight, bias, ids, entropy=True, chunk_size=case["chunk_size"], **opts)
    _, logp, ent, _ = unfused(hidden, weight, bias, ids, **opts)
    for value, entropy in ((out.logprobs, out.entropy), (logp, ent)):
        assert value.dtype == entropy.dtype == torch.float32
        torch.testing.assert_close(value, ref_logp.float(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(entropy, ref_ent.float(), rtol=1e-5, atol=1e-5)
        grads = torch.autograd.grad(_objective(value, entropy, case, "both"), _leaves(hidden, weight, bias))
        for grad, ref, bound, cap_error in zip(grads, ref_grads, bounds, cap_errors):
            assert grad.dtype == torch.bfloat16
            error = (grad.double() - ref).abs()
            assert bool((error <= 1.6e-2 * (ref.abs() + bound) + cap_error).all()), (error, ref, bound)


@given(case=heads(), top_k=st.integers(0, 14))
@settings(max_examples=60)
def test_top_k_are_the_largest_log_probs_and_their_ids_without_gradient(case, top_k):
    hidden, weight, bias, ids = _tensors(case, torch.float32)
    vocab = case["vocab"] or weight.shape[0]
    out = head_outputs(hidden, weight, bias, ids, top_k=top_k, sum_pi_squared=True, vocab=case["vocab"],
                       temperature=case["temperature"], softcap=case["softcap"], chunk_size=case["chunk_size"])
    x = unfused_logits(hidden, weight, bias, softcap=case["softcap"], vocab=case["vocab"])
    full = torch.log_softmax(x.detach().double() / case["temperature"], -1)
    k = vocab if top_k == 0 else min(top_k, vocab)
    assert out.top_logprobs.shape == out.top_ids.shape == (ids.shape[0], k) and out.top_ids.dtype == torch.int64
    # ties may order ids either way: the values are the sorted top k, and each id holds its value
    torch.testing.assert_close(out.top_logprobs.double(), full.topk(k, -1).values, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(full.gather(-1, out.top_ids), out.top_logprobs.double(), rtol=1e-5, atol=1e-5)
    assert all(len(set(row)) == k for row in out.top_ids.tolist())
    assert not out.top_logprobs.requires_grad and not out.sum_pi_squared.requires_grad
    assert out.logprobs.requires_grad


@pytest.mark.parametrize("runner_up", [2.0, 3.0, 9.0])
def test_a_confident_token_keeps_its_small_complement_in_log_p_entropy_and_gradients(runner_up):
    # logits [20, runner_up] from hidden [1] and weight [[20], [runner_up]]: ∂/∂weight = ∂/∂logits,
    # as logprobs.py's test of the same name; 1 − p_y is 4e-8 … 2e-5, which a float32 logsumexp loses
    hidden = torch.ones(1, 1, requires_grad=True)
    weight = torch.tensor([[20.0], [runner_up]], requires_grad=True)
    c = torch.sigmoid(torch.tensor(runner_up - 20.0, dtype=torch.float64))
    for ids, upstream in ((torch.tensor([[0]]), 1.0), (torch.tensor([[0, 0]]), 2.0)):  # a repeated id adds
        out = head_outputs(hidden, weight, None, ids, entropy=True)
        torch.testing.assert_close(out.logprobs, torch.full(ids.shape, -c.item()), rtol=1e-5, atol=0.0)
        (grad,) = torch.autograd.grad(out.logprobs.sum(), weight, retain_graph=True)
        expected = torch.tensor([[upstream * c], [-upstream * c]], dtype=torch.float64).float()
        torch.testing.assert_close(grad, expected, rtol=1e-5, atol=0.0)
    exact = -(c * c.log() + (1 - c) * torch.log1p(-c))
    torch.testing.assert_close(out.entropy, exact.float()[None], rtol=1e-5, atol=0.0)
    (grad,) = torch.autograd.grad(out.entropy.sum(), weight)
    exact_grad = -c * (1 - c) * ((1 - c) / c).log()
    torch.testing.assert_close(grad, torch.stack([exact_grad, -exact_grad]).float()[:, None], rtol=1e-5, atol=0.0)


def _largest_tensor(fn):
    """Largest tensor created while ``fn()`` (forward and backward) runs."""
    with Largest() as seen:
        fn()
    return seen.largest


@pytest.mark.parametrize("softcap", [None, 20.0])
def test_no_tensor_of_a_quarter_of_the_logits_is_made_in_forward_or_backward(softcap):
    n, v, h, chunk = 256, 4096, 32, 16
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, h, generator=g).requires_grad_()
    weight = (torch.randn(v, h, generator=g) * 0.3).requires_grad_()
    bias = torch.randn(v, generator=g).requires_grad_()
    ids = torch.randint(0, v, (n, 2), generator=g)

    def fused():
        out = head_outputs(hidden, weight, bias, ids, softcap=softcap, temperature=0.7, entropy=True,
                           sum_pi_squared=True, top_k=8, chunk_size=chunk)
        torch.autograd.grad(out.logprobs.sum() + out.entropy.sum(), [hidden, weight, bias])

    def materialised():
        _, logp, ent, _ = unfused(hidden, weight, bias, ids, temperature=0.7, softcap=softcap)
        torch.autograd.grad(logp.sum() + ent.sum(), [hidden, weight, bias])

    # the measurement sees the unfused head's logits (so it can fail) ...
    assert _largest_tensor(materialised) >= n * v
    # ... and the fused head's largest tensors are its gradient for weight ([v, h]) and blocks
    assert _largest_tensor(fused) <= max(v * h, chunk * v) < n * v / 4


def test_the_graph_saves_only_the_inputs_and_per_row_statistics():
    n, v, h = 5, 11, 3
    hidden = torch.randn(n, h).to(torch.bfloat16).requires_grad_()
    weight = torch.randn(v, h).to(torch.bfloat16).requires_grad_()
    bias, ids = torch.randn(v).to(torch.bfloat16), torch.randint(0, v, (n, 2))
    out = head_outputs(hidden, weight, bias, ids, entropy=True, chunk_size=2)
    saved = out.logprobs.grad_fn.saved_tensors
    assert [s.data_ptr() for s in saved[:3]] == [hidden.data_ptr(), weight.data_ptr(), bias.data_ptr()]
    assert torch.equal(saved[3], ids)
    assert [(tuple(s.shape), s.dtype) for s in saved[4:]] == [((n,), torch.float32)] * 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("chunk", [1, 3, 7, 100])
def test_a_tied_head_sums_the_embeddings_gradients(dtype, chunk):
    # the embedding is read twice: as the input's token vectors and as the head's weight
    g = torch.Generator().manual_seed(chunk)
    v, h, n = 13, 4, 7
    embedding = torch.randn(v, h, generator=g).to(dtype)
    tokens, ids = torch.randint(0, v, (n,), generator=g), torch.randint(0, v, (n, 1), generator=g)
    upstream = torch.randn(n, generator=g)

    def gradient(head):
        leaf = embedding.clone().requires_grad_()
        hidden = torch.tanh(F.embedding(tokens, leaf)) * 1.5
        logp, ent = head(hidden, leaf)
        loss = (logp[:, 0] * upstream.to(logp.dtype)).sum() + ent.sum() + (leaf.float() ** 2).sum() * 0.1
        (grad,) = torch.autograd.grad(loss, leaf)
        return grad

    fused = gradient(lambda x, w: (lambda o: (o.logprobs, o.entropy))(
        head_outputs(x, w, None, ids, entropy=True, temperature=0.8, chunk_size=chunk)))
    unfused_grad = gradient(lambda x, w: unfused(x, w, None, ids, temperature=0.8)[1:3])
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=2e-2)
    torch.testing.assert_close(fused, unfused_grad, **tol)


def test_torch_func_grad_agrees_with_autograd():
    g = torch.Generator().manual_seed(1)
    hidden, weight = torch.randn(4, 3, generator=g, dtype=torch.float64), torch.randn(9, 3, generator=g,
                                                                                    dtype=torch.float64)
    ids = torch.randint(0, 9, (4, 2), generator=g)

    def objective(x, w):
        out = head_outputs(x, w, None, ids, entropy=True, softcap=5.0, chunk_size=3)
        return out.logprobs.sum() + out.entropy.sum()

    leaves = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    expected = torch.autograd.grad(objective(*leaves), leaves)
    for got, want in zip(torch.func.grad(objective, argnums=(0, 1))(hidden, weight), expected):
        torch.testing.assert_close(got, want)


def test_float64_stays_float64_and_matches_log_softmax():
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(6, 3, generator=g, dtype=torch.float64)
    weight, bias = torch.randn(8, 3, generator=g, dtype=torch.float64), torch.randn(8, generator=g, dtype=torch.float64)
    ids = torch.randint(0, 8, (6, 1), generator=g)
    out = head_outputs(hidden, weight, bias, ids, entropy=True, sum_pi_squared=True, temperature=0.5, chunk_size=4)
    log_p = torch.log_softmax(F.linear(hidden, weight, bias) / 0.5, -1)
    assert out.logprobs.dtype == torch.float64
    torch.testing.assert_close(out.logprobs, log_p.gather(-1, ids))
    torch.testing.assert_close(out.entropy, -(log_p.exp() * log_p).sum(-1))
    torch.testing.assert_close(out.sum_pi_squared, (2 * log_p).exp().sum(-1))
    assert bool((out.entropy <= math.log(8)).all())


def test_no_rows_give_empty_outputs_and_no_grad_gives_no_graph():
    weight, bias = torch.randn(5, 3, requires_grad=True), torch.randn(5)
    out = head_outputs(torch.zeros(0, 3, requires_grad=True), weight, bias, torch.zeros(0, 2, dtype=torch.int64),
                       entropy=True, sum_pi_squared=True, top_k=3)
    assert out.logprobs.shape == (0, 2) and out.entropy.shape == out.sum_pi_squared.shape == (0,)
    assert out.top_logprobs.shape == out.top_ids.shape == (0, 3)
    hidden, ids = torch.randn(4, 3), torch.randint(0, 5, (4, 1))
    with torch.no_grad():
        out = head_outputs(hidden, weight, bias, ids)
    assert not out.logprobs.requires_grad
    torch.testing.assert_close(out.logprobs, torch.log_softmax(F.linear(hidden, weight, bias), -1).gather(-1, ids))


def test_invalid_arguments_raise_named_errors():
    hidden, weight, ids = torch.randn(4, 3), torch.randn(5, 3), torch.randint(0, 5, (4, 1))
    unchecked = getattr(head_outputs, "__wrapped__", head_outputs)  # skip pytest's jaxtyping
    with pytest.raises(ValueError, match="last dimensions must agree"):
        unchecked(hidden, torch.randn(5, 2), None, ids)
    with pytest.raises(ValueError, match="ids has shape"):
        unchecked(hidden, weight, None, ids[:3])
    with pytest.raises(ValueError, match="bias has shape"):
        unchecked(hidden, weight, torch.randn(4), ids)
    with pytest.raises(TypeError, match="share a dtype"):
        unchecked(hidden, weight.double(), None, ids)
    with pytest.raises(TypeError, match="ids must be an integer"):
        unchecked(hidden, weight, None, ids.float())
    for options, message in (({"temperature": 0.0}, "temperature must be positive"),
                             ({"softcap": 0.0}, "softcap must be positive"),
                             ({"top_k": -1}, "top_k must be at least 0"),
                             ({"vocab": 6}, "vocab must be in"),
                             ({"vocab": 0}, "vocab must be in"),
                             ({"chunk_size": 0}, "chunk_size")):
        with pytest.raises(ValueError, match=message):
            head_outputs(hidden, weight, None, ids, **options)
