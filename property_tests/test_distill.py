"""Properties of on-policy distillation: the reverse-KL advantage and GKD's generalized JSD."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from property_tests.strategies import TokenBatch, finite_floats, token_batches
from purerl.algo.distill import generalized_jsd, reverse_kl_advantages, sampled_reverse_kl

GAMMAS = st.sampled_from([0.0, 0.5, 0.9, 1.0])


@st.composite
def logp_pairs(draw) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    batch: TokenBatch = draw(token_batches(bound=20.0))
    teacher = draw(arrays(np.float64, tuple(batch.values.shape), elements=finite_floats(20.0)))
    return batch.values, torch.from_numpy(teacher), batch.mask


@st.composite
def distributions(draw, vocab: int = 5) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(student_logits [b, t, v], teacher_logits [b, t, v], mask [b, t])`` in float64."""
    batch: TokenBatch = draw(token_batches(max_rows=3, max_len=4))
    shape = (*batch.values.shape, vocab)
    student = draw(arrays(np.float64, shape, elements=finite_floats(8.0)))
    teacher = draw(arrays(np.float64, shape, elements=finite_floats(8.0)))
    return torch.from_numpy(student), torch.from_numpy(teacher), batch.mask


def _full(teacher_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The teacher's whole vocabulary as its "top-k": ids and log-probs."""
    ids = torch.arange(teacher_logits.shape[-1]).expand(teacher_logits.shape).contiguous()
    return ids, torch.log_softmax(teacher_logits, -1)


# --- the reverse-KL advantage --------------------------------------------------------------------


@given(pair=logp_pairs(), gamma=GAMMAS)
def test_a_student_equal_to_its_teacher_gets_zero_advantage_everywhere(pair, gamma):
    student, _, mask = pair
    assert torch.equal(reverse_kl_advantages(student, student.clone(), mask, gamma=gamma), torch.zeros_like(student))


@given(pair=logp_pairs())
def test_without_discount_the_advantage_is_the_teachers_log_prob_minus_the_students(pair):
    student, teacher, mask = pair
    out = reverse_kl_advantages(student, teacher, mask, gamma=0.0)
    assert torch.equal(out, torch.where(mask, teacher - student, 0.0))
    assert torch.equal(out, -sampled_reverse_kl(student, teacher, mask))


@given(pair=logp_pairs(), gamma=GAMMAS)
def test_the_advantage_is_the_discounted_sum_of_the_later_valid_positions(pair, gamma):
    student, teacher, mask = pair
    out = reverse_kl_advantages(student, teacher, mask, gamma=gamma)
    d = (teacher - student).numpy()
    m = mask.numpy()
    for i in range(d.shape[0]):
        valid = np.flatnonzero(m[i])
        for j, t in enumerate(valid):
            expected = sum(gamma ** k * d[i, s] for k, s in enumerate(valid[j:]))
            assert out[i, t].item() == pytest.approx(expected, rel=1e-9, abs=1e-9)
    assert torch.equal(out[~mask], torch.zeros(int((~mask).sum()), dtype=out.dtype))


def test_a_discount_outside_zero_to_one_is_refused():
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="gamma"):
        reverse_kl_advantages(x, x, torch.ones(1, 2, dtype=torch.bool), gamma=1.5)


# --- GKD's generalized JSD ------------------------------------------------------------------------


@given(dists=distributions(), beta=st.floats(0.0, 1.0))
def test_the_jsd_is_non_negative_bounded_by_the_weights_entropy_and_zero_when_masked(dists, beta):
    student, teacher, mask = dists
    ids, teacher_logp = _full(teacher)
    jsd = generalized_jsd(student, ids, teacher_logp, mask, beta=beta)
    assert (jsd >= -1e-12).all()
    if 0 < beta < 1:  # a two-component mixture's JS divergence is at most the entropy of its weights
        assert (jsd <= -beta * math.log(beta) - (1 - beta) * math.log1p(-beta) + 1e-9).all()
    assert torch.equal(jsd[~mask], torch.zeros(int((~mask).sum()), dtype=jsd.dtype))


@given(dists=distributions(), beta=st.floats(0.0, 1.0))
def test_the_jsd_and_its_gradient_vanish_when_the_student_is_the_teacher(dists, beta):
    student, _, mask = dists
    ids, teacher_logp = _full(student)
    logits = student.clone().requires_grad_(True)
    jsd = generalized_jsd(logits, ids, teacher_logp, mask, beta=beta)
    (grad,) = torch.autograd.grad(jsd.sum(), logits)
    torch.testing.assert_close(jsd, torch.zeros_like(jsd), rtol=0, atol=1e-12)
    torch.testing.assert_close(grad, torch.zeros_like(grad), rtol=0, atol=1e-10)


@given(dists=distributions())
def test_beta_zero_is_the_forward_kl_and_beta_one_the_reverse_kl(dists):
    student, teacher, mask = dists
    ids, teacher_logp = _full(teacher)
    s, t = torch.log_softmax(student, -1), teacher_logp
    forward = torch.where(mask, (t.exp() * (t - s)).sum(-1), 0.0)
    reverse = torch.where(mask, (s.exp() * (s - t)).sum(-1), 0.0)
    torch.testing.assert_close(generalized_jsd(student, ids, teacher_logp, mask, beta=0.0), forward)
    torch.testing.assert_close(generalized_jsd(student, ids, teacher_logp, mask, beta=1.0), reverse)


@given(dists=distributions(), beta=st.floats(0.01, 0.99))
def test_swapping_student_and_teacher_swaps_beta(dists, beta):
    student, teacher, mask = dists
    ids, teacher_logp = _full(teacher)
    _, student_logp = _full(student)
    torch.testing.assert_close(generalized_jsd(student, ids, teacher_logp, mask, beta=beta),
                               generalized_jsd(teacher, ids, student_logp, mask, beta=1 - beta))


@given(dists=distributions(), beta=st.floats(0.0, 1.0), temperature=st.sampled_from([0.5, 1.0, 2.0]))
def test_the_teachers_support_in_any_order_gives_the_same_divergence(dists, beta, temperature):
    student, teacher, mask = dists
    ids, teacher_logp = _full(teacher)
    order = torch.randperm(ids.shape[-1], generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(generalized_jsd(student, ids, teacher_logp, mask, beta=beta, temperature=temperature),
                               generalized_jsd(student, ids[..., order], teacher_logp[..., order], mask, beta=beta,
                                               temperature=temperature))


def test_on_a_top_k_support_both_distributions_are_renormalised_there():
    student = torch.tensor([[[2.0, 1.0, 0.0, -1.0]]], dtype=torch.float64)
    teacher_logp = torch.log(torch.tensor([[[0.6, 0.3]]], dtype=torch.float64))  # its top 2: ids 0, 1
    ids, mask = torch.tensor([[[0, 1]]]), torch.ones(1, 1, dtype=torch.bool)
    p_t = torch.tensor([2 / 3, 1 / 3], dtype=torch.float64)
    p_s = torch.softmax(torch.tensor([2.0, 1.0], dtype=torch.float64), -1)
    expected = (p_t * (p_t / p_s).log()).sum()
    torch.testing.assert_close(generalized_jsd(student, ids, teacher_logp, mask, beta=0.0)[0, 0], expected)
