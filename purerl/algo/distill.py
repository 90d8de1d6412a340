"""On-policy distillation: a frozen teacher scores the student's own samples.

Two signals, both on the student's sampled responses ``y`` (``π_S``: the student before the
update, ``π_T``: the teacher, both at the sampling temperature):

- **Reverse KL as a dense advantage** (Agarwal et al. 2024, GKD on-policy with ``β = 1``; the
  Thinking Machines recipe of 2025). The per-token reward ``d_t = log π_T(y_t) − log π_S(y_t)`` is
  minus the sampled-token estimate of ``KL(π_S ‖ π_T)`` at position ``t``; its discounted return

      ``A_t = Σ_{s ≥ t} γ^{s−t} d_s``   (over valid positions; ``γ = 0``: ``A_t = d_t``)

  is the advantage a policy-gradient loss climbs, so the update descends the reverse KL. A
  student equal to its teacher gets ``A = 0`` on every token.
- **GKD's generalized Jensen–Shannon divergence** between the full next-token distributions, as
  a loss term with gradient (Agarwal et al. 2024, eq. 3, with TRL's convention for ``β``):

      ``JSD_β = β·KL(T ‖ M) + (1 − β)·KL(S ‖ M)``,  ``M = β·T + (1 − β)·S``;
      ``β = 0``: ``KL(T ‖ S)`` (forward KL), ``β = 1``: ``KL(S ‖ T)`` (reverse KL).

  Both distributions are taken on the teacher's ``k`` likeliest tokens at each position and
  renormalised there (``k`` = the vocabulary: exact), which keeps the teacher's part of a batch
  at ``b × t × k`` numbers instead of ``b × t × V``.
"""

import math

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from purerl.checks import check_bool, check_floating, check_rank, check_same_shape

__all__ = ["generalized_jsd", "generalized_jsd_at_ids", "reverse_kl_advantages", "sampled_reverse_kl"]


def sampled_reverse_kl(student_logprobs: Float[Tensor, "b t"], teacher_logprobs: Float[Tensor, "b t"],
                       mask: Bool[Tensor, "b t"]) -> Float[Tensor, "b t"]:
    """``log π_S(y_t) − log π_T(y_t)`` at valid positions, 0 elsewhere: the per-token sampled
    estimate of ``KL(π_S ‖ π_T)`` (its mean over the student's samples is the reverse KL)."""
    where = "sampled_reverse_kl"
    check_rank(where, 2, student_logprobs=student_logprobs)
    check_same_shape(where, student_logprobs=student_logprobs, teacher_logprobs=teacher_logprobs, mask=mask)
    check_floating(where, student_logprobs=student_logprobs, teacher_logprobs=teacher_logprobs)
    check_bool(where, mask=mask)
    return torch.where(mask, _wide(student_logprobs) - _wide(teacher_logprobs), 0.0)


def reverse_kl_advantages(student_logprobs: Float[Tensor, "b t"], teacher_logprobs: Float[Tensor, "b t"],
                          mask: Bool[Tensor, "b t"], *, gamma: float = 0.0) -> Float[Tensor, "b t"]:
    """``A_t = Σ_{s ≥ t, m_s} γ^{s−t}·(log π_T(y_s) − log π_S(y_s))`` at valid positions, 0 on
    masked ones (float32 at least). Masked positions inside a response (a tool's observation) neither
    add nor discount: the return runs over the valid positions only, as the policy's own tokens."""
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"reverse_kl_advantages: gamma must be in [0, 1], got {gamma}")
    rewards = -sampled_reverse_kl(student_logprobs, teacher_logprobs, mask)
    if gamma == 0.0:
        return rewards
    out, running = torch.zeros_like(rewards), torch.zeros_like(rewards[:, 0])
    for t in range(rewards.shape[1] - 1, -1, -1):
        running = torch.where(mask[:, t], rewards[:, t] + gamma * running, running)
        out[:, t] = torch.where(mask[:, t], running, 0.0)
    return out


def generalized_jsd(student_logits: Float[Tensor, "b t v"], teacher_ids: Int[Tensor, "b t k"],
                    teacher_logprobs: Float[Tensor, "b t k"], mask: Bool[Tensor, "b t"], *, beta: float = 0.5,
                    temperature: float = 1.0) -> Float[Tensor, "b t"]:
    """GKD's ``JSD_β(T ‖ S)`` per position (module docstring), with gradient through
    ``student_logits``; 0 (value and gradient) at masked positions. ``teacher_ids`` /
    ``teacher_logprobs``: the teacher's ``k`` likeliest tokens and their log-probs at
    ``temperature``; the student's log-softmax of ``logits / temperature`` is read at those ids, and
    both are renormalised over them. Non-negative, 0 where the two agree on the support."""
    where = "generalized_jsd"
    check_rank(where, 3, student_logits=student_logits, teacher_logprobs=teacher_logprobs)
    check_same_shape(where, teacher_ids=teacher_ids, teacher_logprobs=teacher_logprobs)
    if student_logits.shape[:2] != mask.shape or teacher_ids.shape[:2] != mask.shape:
        raise ValueError(f"{where}: logits {tuple(student_logits.shape)}, teacher {tuple(teacher_ids.shape)} and "
                         f"mask {tuple(mask.shape)} disagree on [b, t]")
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"{where}: beta must be in [0, 1], got {beta}")
    check_bool(where, mask=mask)
    student = torch.log_softmax(_wide(student_logits) / temperature, -1).gather(-1, teacher_ids.long())
    return generalized_jsd_at_ids(student, teacher_logprobs, mask, beta=beta)


def generalized_jsd_at_ids(student_logprobs: Float[Tensor, "b t k"], teacher_logprobs: Float[Tensor, "b t k"],
                           mask: Bool[Tensor, "b t"], *, beta: float = 0.5) -> Float[Tensor, "b t"]:
    """:func:`generalized_jsd` from the student's log-probs at the teacher's ids (what a fused head gives, never
    the student's whole logits): both renormalised over those ids."""
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"generalized_jsd: beta must be in [0, 1], got {beta}")
    student = _wide(student_logprobs)
    student = student - torch.logsumexp(student, -1, keepdim=True)
    teacher = _wide(teacher_logprobs)
    teacher = teacher - torch.logsumexp(teacher, -1, keepdim=True)
    if beta == 0.0:
        divergence = _kl(teacher, student)
    elif beta == 1.0:
        divergence = _kl(student, teacher)
    else:
        mixture = torch.logsumexp(torch.stack([teacher + math.log(beta), student + math.log1p(-beta)]), 0)
        divergence = beta * _kl(teacher, mixture) + (1 - beta) * _kl(student, mixture)
    return torch.where(mask, divergence, 0.0)


def _wide(x: Tensor) -> Tensor:
    """``x`` in float32 at least (float64 stays)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _kl(p_log: Tensor, q_log: Tensor) -> Tensor:
    """``KL(p ‖ q) = Σ_v p_v (log p_v − log q_v)`` over the last axis, from log-probabilities."""
    return (p_log.exp() * (p_log - q_log)).sum(-1)
