"""Chunked log-probs and entropies equal the naive full-vocabulary computation, without its memory."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from property_tests.allocations import Largest
from property_tests.strategies import finite_floats
from purerl.algo.logprobs import entropy_from_logits, logprobs_from_logits

DTYPES = [torch.float64, torch.float32, torch.bfloat16]
temperatures = st.sampled_from([1.0, 0.6, 1.7]) | st.floats(0.25, 4.0)


def naive_logprobs(logits, labels, temperature=1.0, dtype=torch.float64):
    """The reference: log_softmax over a full upcast copy (float64 by default), then gather."""
    z = logits.to(dtype) / temperature
    return torch.log_softmax(z, dim=-1).gather(-1, labels[..., None]).squeeze(-1)


def naive_entropy(logits, temperature=1.0, dtype=torch.float64):
    z = logits.to(dtype) / temperature
    return torch.logsumexp(z, dim=-1) - (torch.softmax(z, dim=-1) * z).sum(-1)


def _tolerances(dtype):
    """Tolerances against the float64 reference, on values and on gradients (in ``dtype``).

    The float32 bounds are a few units of float32 rounding at the logit magnitudes drawn (≤ 80
    after temperature): the chunked functions work relative to the row max, which makes them
    closer to float64 than a float32 ``log_softmax`` graph is (its entropy gradient is ~10x off).
    """
    if dtype == torch.float64:
        return dict(rtol=1e-10, atol=1e-10), dict(rtol=1e-10, atol=1e-10)
    if dtype == torch.float32:
        return dict(rtol=1e-5, atol=1e-5), dict(rtol=1e-5, atol=1e-5)
    return dict(rtol=1e-5, atol=1e-5), dict(rtol=1.6e-2, atol=1e-5)


@st.composite
def vocab_batches(draw, dtype=torch.float64):
    """``(logits [b, t, v] in dtype, labels [b, t], upstream gradient [b, t] float64, chunk_size)``."""
    b, t, v = draw(st.integers(1, 3)), draw(st.integers(1, 5)), draw(st.integers(2, 12))
    logits = draw(arrays(np.float64, (b, t, v), elements=finite_floats(20.0)))
    labels = draw(arrays(np.int64, (b, t), elements=st.integers(0, v - 1)))
    grad = draw(arrays(np.float64, (b, t), elements=finite_floats(3.0)))
    chunk = draw(st.integers(1, b * t + 2))
    return torch.from_numpy(logits).to(dtype), torch.from_numpy(labels), torch.from_numpy(grad), chunk


def _value_and_grad(fn, logits, upstream, *args, **kwargs):
    leaf = logits.detach().clone().requires_grad_()
    out = fn(leaf, *args, **kwargs)
    (grad,) = torch.autograd.grad(out, leaf, upstream.to(out.dtype))
    return out, grad


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@given(data=st.data(), temperature=temperatures)
def test_chunked_logprobs_equal_naive_log_softmax_in_values_and_gradients(dtype, data, temperature):
    logits, labels, upstream, chunk = data.draw(vocab_batches(dtype))
    value_tol, grad_tol = _tolerances(dtype)
    out, grad = _value_and_grad(logprobs_from_logits, logits, upstream, labels, temperature=temperature,
                                chunk_size=chunk)
    ref, ref_grad = _value_and_grad(naive_logprobs, logits, upstream, labels, temperature)
    ref = ref.to(out.dtype)
    assert out.dtype == torch.promote_types(dtype, torch.float32) and grad.dtype == dtype
    torch.testing.assert_close(out, ref, **value_tol)
    torch.testing.assert_close(grad, ref_grad, **grad_tol)


@pytest.mark.parametrize("chunk", [1, 2, 3, 4, 5, 6, 7, 11, 12, 13, 1000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_chunk_sizes_that_do_and_do_not_divide_the_rows_give_the_same_result(chunk, dtype):
    # b·t = 12 rows of a non-contiguous slice (as the model's logits[:, :-1] are)
    g = torch.Generator().manual_seed(chunk)
    full = (torch.randn(3, 5, 50, generator=g) * 4).to(dtype)
    logits, labels = full[:, :-1], torch.randint(0, 50, (3, 4), generator=g)
    upstream = torch.randn(3, 4, generator=g, dtype=torch.float64)
    value_tol, grad_tol = _tolerances(dtype)
    for temperature in (1.0, 0.7):
        out, grad = _value_and_grad(logprobs_from_logits, logits, upstream, labels, temperature=temperature,
                                    chunk_size=chunk)
        ref, ref_grad = _value_and_grad(naive_logprobs, logits, upstream, labels, temperature)
        torch.testing.assert_close(out, ref.float(), **value_tol)
        torch.testing.assert_close(grad, ref_grad, **grad_tol)
        ent, ent_grad = _value_and_grad(entropy_from_logits, logits, upstream, temperature=temperature,
                                        chunk_size=chunk)
        ent_ref, ent_ref_grad = _value_and_grad(naive_entropy, logits, upstream, temperature)
        torch.testing.assert_close(ent, ent_ref.float(), **value_tol)
        torch.testing.assert_close(ent_grad, ent_ref_grad, **grad_tol)


@given(data=st.data(), temperature=temperatures)
def test_logprobs_are_at_most_zero_and_exponentiate_to_a_distribution(data, temperature):
    logits, _, _, chunk = data.draw(vocab_batches())
    b, t, v = logits.shape
    every_label = torch.arange(v).expand(b * t, v).T.reshape(v, b, t)
    probs = torch.stack(
        [logprobs_from_logits(logits, y, temperature=temperature, chunk_size=chunk) for y in every_label]
    )
    assert bool((probs <= 1e-12).all())
    torch.testing.assert_close(probs.exp().sum(0), torch.ones(b, t, dtype=torch.float64), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@given(data=st.data(), temperature=temperatures)
def test_chunked_entropy_equals_naive_entropy_in_values_and_gradients(dtype, data, temperature):
    logits, _, upstream, chunk = data.draw(vocab_batches(dtype))
    value_tol, grad_tol = _tolerances(dtype)
    out, grad = _value_and_grad(entropy_from_logits, logits, upstream, temperature=temperature, chunk_size=chunk)
    ref, ref_grad = _value_and_grad(naive_entropy, logits, upstream, temperature)
    ref = ref.to(out.dtype)
    assert out.dtype == torch.promote_types(dtype, torch.float32) and grad.dtype == dtype
    torch.testing.assert_close(out, ref, **value_tol)
    torch.testing.assert_close(grad, ref_grad, **grad_tol)


@given(data=st.data(), temperature=temperatures)
def test_entropy_lies_between_zero_and_log_vocabulary_size(data, temperature):
    logits, _, _, chunk = data.draw(vocab_batches())
    entropy = entropy_from_logits(logits, temperature=temperature, chunk_size=chunk)
    v = logits.shape[-1]
    assert bool((entropy >= -1e-12).all())
    assert bool((entropy <= math.log(v) + 1e-12).all())


def test_entropy_reaches_its_bounds_on_uniform_and_one_hot_logits():
    uniform = torch.zeros(2, 3, 7, dtype=torch.float64)
    one_hot = torch.full((2, 3, 7), -1e4, dtype=torch.float64).index_fill(-1, torch.tensor([2]), 0.0)
    torch.testing.assert_close(entropy_from_logits(uniform), torch.full((2, 3), math.log(7), dtype=torch.float64))
    torch.testing.assert_close(entropy_from_logits(one_hot), torch.zeros(2, 3, dtype=torch.float64))


@pytest.mark.parametrize("shape", [(9,), (4, 9), (2, 3, 9), (2, 2, 3, 9)])
def test_entropy_accepts_any_number_of_leading_dimensions(shape):
    g = torch.Generator().manual_seed(len(shape))
    logits = torch.randn(shape, generator=g, dtype=torch.float64) * 3
    upstream = torch.randn(shape[:-1], generator=g, dtype=torch.float64)
    out, grad = _value_and_grad(entropy_from_logits, logits, upstream, chunk_size=2)
    ref, ref_grad = _value_and_grad(naive_entropy, logits, upstream)
    assert out.shape == shape[:-1]
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(grad, ref_grad)


def test_temperature_divides_the_logits_first():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 5, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 5, (2, 3), generator=g)
    torch.testing.assert_close(logprobs_from_logits(logits, labels, temperature=0.5),
                               logprobs_from_logits(logits * 2, labels))
    torch.testing.assert_close(entropy_from_logits(logits, temperature=0.5), entropy_from_logits(logits * 2))


@pytest.mark.parametrize("runner_up", [2.0, 3.0, 9.0])
def test_gradient_of_a_confident_token_keeps_its_small_complement(runner_up):
    # p_y = 1 − σ(runner_up − 20): float32 rounds 1 − p_y (4e-8 … 2e-5) coarsely or to 0 in
    # log(1 + ε) and in a stored logsumexp; the exact gradient is g·(1 − p_y) at the label
    logits = torch.tensor([[[20.0, runner_up]]], requires_grad=True)
    complement = torch.sigmoid(torch.tensor(runner_up - 20.0, dtype=torch.float64)).item()
    logp = logprobs_from_logits(logits, torch.tensor([[0]]))
    (grad,) = torch.autograd.grad(logp.sum(), logits)
    torch.testing.assert_close(grad, torch.tensor([[[complement, -complement]]]), rtol=1e-5, atol=0.0)
    torch.testing.assert_close(logp, torch.tensor([[-complement]]), rtol=1e-5, atol=0.0)
    entropy = entropy_from_logits(logits)
    c = torch.tensor(complement, dtype=torch.float64)
    exact = -(c * c.log() + (1 - c) * torch.log1p(-c))  # a float32 lse − Σpz gives 0 here
    torch.testing.assert_close(entropy, exact.float()[None, None], rtol=1e-5, atol=0.0)
    (grad,) = torch.autograd.grad(entropy.sum(), logits)
    exact_grad = -c * (1 - c) * ((1 - c) / c).log()  # ∂H/∂z_y = H'(c)·∂c/∂z_y, c = σ(z_2 − z_y)
    expected = torch.stack([exact_grad, -exact_grad]).float().view(1, 1, 2)
    torch.testing.assert_close(grad, expected, rtol=1e-5, atol=0.0)


def _largest_float32(fn, logits, *args, **kwargs):
    """Largest float32 tensor created in the forward and, separately, in the backward of ``fn``."""
    leaf = logits.detach().clone().requires_grad_()
    with Largest(torch.float32) as forward:
        out = fn(leaf, *args, **kwargs)
    upstream = torch.ones_like(out)
    with Largest(torch.float32) as backward:
        torch.autograd.grad(out, leaf, upstream)
    return forward.largest, backward.largest


@pytest.mark.parametrize("temperature", [1.0, 0.8])
def test_no_full_float32_copy_of_bfloat16_logits_is_made_in_forward_or_backward(temperature):
    b, t, v, chunk = 4, 6, 64, 5
    logits = torch.randn(b, t + 1, v).to(torch.bfloat16)[:, :-1]
    labels = torch.randint(0, v, (b, t))
    full = b * t * v
    # the measurement sees the naive copies (so it can fail) ...
    assert _largest_float32(naive_logprobs, logits, labels, temperature, torch.float32) == (full, full)
    assert _largest_float32(naive_entropy, logits, temperature, torch.float32) == (full, full)
    # ... and the chunked functions upcast at most one chunk of rows at a time
    for result in (
        _largest_float32(logprobs_from_logits, logits, labels, temperature=temperature, chunk_size=chunk),
        _largest_float32(entropy_from_logits, logits, temperature=temperature, chunk_size=chunk),
    ):
        assert max(result) <= chunk * v, result


def test_the_graph_saves_only_the_inputs_and_per_row_statistics():
    # log-probs: logits, labels, row max and log Σ exp(z − max); entropy: logits, those two and H
    b, t, v = 2, 3, 11
    logits = torch.randn(b, t, v).to(torch.bfloat16).requires_grad_()
    labels = torch.randint(0, v, (b, t))
    logp = logprobs_from_logits(logits, labels, chunk_size=2)
    saved = logp.grad_fn.saved_tensors
    assert saved[0].data_ptr() == logits.data_ptr() and saved[0].dtype == torch.bfloat16
    assert torch.equal(saved[1], labels)
    assert [(tuple(s.shape), s.dtype) for s in saved[2:]] == [((b, t), torch.float32)] * 2
    entropy = entropy_from_logits(logits, chunk_size=2)
    saved = entropy.grad_fn.saved_tensors
    assert saved[0].data_ptr() == logits.data_ptr() and saved[0].dtype == torch.bfloat16
    assert [(tuple(s.shape), s.dtype) for s in saved[1:]] == [((b, t), torch.float32)] * 3


def test_torch_func_grad_agrees_with_autograd():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 3, 6, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 6, (2, 3), generator=g)

    def objective(z):
        return logprobs_from_logits(z, labels, chunk_size=4).sum() + entropy_from_logits(z, chunk_size=4).sum()

    leaf = logits.clone().requires_grad_()
    (expected,) = torch.autograd.grad(objective(leaf), leaf)
    torch.testing.assert_close(torch.func.grad(objective)(logits), expected)


def test_outputs_without_gradient_and_under_no_grad():
    logits, labels = torch.randn(2, 3, 5), torch.randint(0, 5, (2, 3))
    with torch.no_grad():
        out = logprobs_from_logits(logits.requires_grad_(), labels)
    assert not out.requires_grad
    torch.testing.assert_close(out, naive_logprobs(logits.detach(), labels, dtype=torch.float32))


def test_invalid_arguments_raise_named_errors():
    logits, labels = torch.randn(2, 3, 5), torch.randint(0, 5, (2, 3))
    unchecked = getattr(logprobs_from_logits, "__wrapped__", logprobs_from_logits)  # skip pytest's jaxtyping
    with pytest.raises(ValueError, match="labels has shape"):
        unchecked(logits, torch.randint(0, 5, (2, 4)))
    with pytest.raises(ValueError, match="temperature must be positive"):
        logprobs_from_logits(logits, labels, temperature=0.0)
    with pytest.raises(ValueError, match="chunk_size"):
        entropy_from_logits(logits, chunk_size=0)
    with pytest.raises(ValueError, match="temperature must be positive"):
        entropy_from_logits(logits, temperature=-1.0)
