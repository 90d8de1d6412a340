"""Policy-gradient losses (verl 0.9.1 ``POLICY_LOSS_REGISTRY``), each registered as a record.

Registered (verl's names): ``vanilla`` (alias ``ppo``), ``gspo``, ``gpg``, ``reinforce``,
``cispo``, ``sapo``, ``geo_mean``, ``dro`` here; ``clip_cov``, ``kl_cov``, ``dppo_tv``,
``dppo_kl`` and ``bypass_mode``, which select or drop tokens, in :mod:`purerl.algo.selective_loss`
(importing :mod:`purerl.algo` registers both). Every loss is ``fn(logp, old_logp, advantages,
mask, *, is_weights=None, <its settings>)`` and returns a :class:`PolicyLossOutput` of
:class:`~purerl.algo.aggregation.SumCount`\\ s, so the losses and metrics of micro-batches add
up to those of the whole batch (except where a loss selects tokens from the whole batch it is
given: ``clip_cov``, ``kl_cov``, and ``bypass_mode`` with ``bypass_batch_normalize``). A loss's
settings are its keyword-only parameters, named like the ``actor`` keys that set them
(``clip_low``, ``clip_high``, ``clip_c``, ``loss_agg``, ``loss_norm``, and those of
``actor.loss_options``: ``tau_pos``, ``dro_beta``, …); its :class:`PolicyLoss` record passes it
only those. With ``lr = logp − old_logp`` and ``ε_lo, ε_hi`` the clip ranges (clip-higher when
they differ):

- ``L1 = −A·ρ``, ``L2 = −A·clamp(ρ, 1−ε_lo, 1+ε_hi)``, per-token loss ``max(L1, L2)``;
- metrics are token means, detached: ``clipfrac = mean_m[L2 > L1]``, ``ppo_kl = mean_m(−lr)``.
  Where verl returns no metric the metric is 0 (``clipfrac``, ``clipfrac_lower``) or
  ``mean_m(−lr)`` (``ppo_kl``).

``is_weights`` (the trainer's rollout-correction weights) multiply the per-token loss after
clipping, as in verl; ``bypass_mode`` ignores them (it computes its own, as verl does).

Denominators. ``sapo`` always aggregates with ``seq-mean-token-mean`` and ``geo_mean`` averages
over all rows (``row-mean``), whatever ``loss_agg``: a record's :meth:`PolicyLoss.aggregation_of`
names the mode whose :func:`~purerl.algo.aggregation.loss_denominator` matches its count, so
``total / loss_denominator(mask, loss.aggregation_of(loss_agg))`` is the loss.
:meth:`PolicyLoss.vanishes_at_zero_advantage` says whether rows whose advantages are all 0 may be
left out of the forward and backward without changing the loss total or its gradient.

Randomness: ``clip_cov`` picks tokens at random (verl: ``torch.randperm`` on the global RNG).
Here it draws from the ``generator`` argument (a ``torch.Generator``), or, when None, from a fresh
generator seeded with 0, so every loss is a pure function of its arguments.

Masking: positions where ``mask`` is False contribute nothing to the loss, the metrics or the
gradient, whatever they hold (NaN and inf included): inputs are replaced there before any
arithmetic.
"""

import torch
from jaxtyping import Bool, Float
from torch import Tensor

from purerl.algo.aggregation import SumCount, aggregate_loss
from purerl.algo.loss_records import (
    POLICY_LOSSES,
    BoundPolicyLoss,
    PolicyLoss,
    PolicyLossOutput,
    aggregation_settings,
    check_clips,
    check_loss_inputs,
    clip_settings,
    loss_output,
    policy_loss,
    reinforce_loss,
    valid_only,
    weighted,
)
from purerl.algo.masked import masked_sum

__all__ = [
    "POLICY_LOSSES",
    "BoundPolicyLoss",
    "PolicyLoss",
    "PolicyLossOutput",
    "cispo_policy_loss",
    "dro_policy_loss",
    "geo_mean_policy_loss",
    "gpg_policy_loss",
    "gspo_loss",
    "gspo_policy_loss",
    "policy_loss",
    "ppo_clip_loss",
    "reinforce_policy_loss",
    "sapo_policy_loss",
    "vanilla_policy_loss",
]


def ppo_clip_loss(
    logp: Float[Tensor, "b t"],
    old_logp: Float[Tensor, "b t"],
    advantages: Float[Tensor, "b t"],
    mask: Bool[Tensor, "b t"],
    *,
    clip_low: float,
    clip_high: float,
    clip_c: float | None,
    agg: str = "token-mean",
    norm: float | None = None,
    is_weights: Float[Tensor, "b t"] | None = None,
) -> PolicyLossOutput:
    """PPO's clipped surrogate with dual clip (verl ``vanilla``).

    ``lr = clamp(logp − old_logp, −20, 20)``, ``ρ = exp(lr)``, ``C1 = max(L1, L2)``,
    ``L3 = −A·clip_c``; the per-token loss is ``C1`` where ``A ≥ 0`` and ``min(L3, C1)`` where
    ``A < 0`` (the ratio of a negative advantage counts at most ``clip_c``), times ``is_weights``
    if given, aggregated with ``agg``. ``clipfrac_lower = mean_m([C1 > L3]·[A < 0])``
    (0 when ``clip_c`` is None). ``A = 0`` gives loss 0 and no clipping.
    ``clip_c <= 1`` raises ``ValueError`` (verl asserts), as do negative clip ranges (verl
    silently clamps with an empty range). Empty masks give a zero ``SumCount``.
    """
    check_loss_inputs("ppo_clip_loss", logp, old_logp, advantages, mask, is_weights)
    check_clips("ppo_clip_loss", clip_low, clip_high, clip_c)
    adv = valid_only(advantages, mask)
    log_ratio = torch.clamp(valid_only(logp - old_logp, mask), min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    pessimistic = torch.maximum(unclipped, clipped)
    if clip_c is None:
        loss, lower = pessimistic, torch.zeros_like(pessimistic)
    else:
        floor = -adv * clip_c
        loss = torch.where(adv < 0, torch.minimum(floor, pessimistic), pessimistic)
        lower = ((pessimistic > floor) & (adv < 0)).to(loss.dtype)
    if is_weights is not None:
        loss = loss * valid_only(is_weights, mask)
    return loss_output(aggregate_loss(loss, mask, agg, norm), loss, mask, log_ratio,
                       clipfrac=(clipped > unclipped).to(loss.dtype), clipfrac_lower=lower)


def gspo_loss(
    logp: Float[Tensor, "b t"],
    old_logp: Float[Tensor, "b t"],
    advantages: Float[Tensor, "b t"],
    mask: Bool[Tensor, "b t"],
    *,
    clip_low: float,
    clip_high: float,
    agg: str = "token-mean",
    norm: float | None = None,
    is_weights: Float[Tensor, "b t"] | None = None,
) -> PolicyLossOutput:
    """GSPO: PPO clipping of the sequence-level ratio (verl 0.9.1 ``gspo``).

    ``ℓ_i = Σ_t lr·m / max(n_i, 1)`` (the row's mean log-ratio) and the token log-ratio
    ``lr_tok = min(logp − sg(logp) + sg(ℓ_i), 10)``, so ``s = exp(lr_tok)`` has the value of the
    sequence ratio and the gradient ``s·∇logp_t``. Per-token loss
    ``max(−A·s, −A·clamp(s, 1−ε_lo, 1+ε_hi))`` (no dual clip, no ±20 clamp), times
    ``is_weights``, aggregated with ``agg`` (0.9.1; the paper and older verl use
    ``seq-mean-token-mean``). ``clipfrac_lower`` is 0; ``ppo_kl = mean_m(−lr)`` (unclamped).
    Negative clip ranges raise ``ValueError``.
    """
    check_loss_inputs("gspo_loss", logp, old_logp, advantages, mask, is_weights)
    check_clips("gspo_loss", clip_low, clip_high, None)
    adv = valid_only(advantages, mask)
    log_ratio = valid_only(logp - old_logp, mask)
    lengths = mask.sum(-1).clamp_min(1).to(log_ratio.dtype)
    seq_log_ratio = log_ratio.sum(-1) / lengths
    current = valid_only(logp, mask)
    token_log_ratio = torch.clamp(current - current.detach() + seq_log_ratio.detach()[:, None], max=10.0)
    ratio = torch.exp(token_log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    if is_weights is not None:
        loss = loss * valid_only(is_weights, mask)
    return loss_output(aggregate_loss(loss, mask, agg, norm), loss, mask, log_ratio,
                       clipfrac=(clipped > unclipped).to(loss.dtype), clipfrac_lower=torch.zeros_like(loss))


@policy_loss("vanilla", "ppo", reads=lambda s: {**clip_settings(s), "clip_c": s.clip_c, **aggregation_settings(s)})
def vanilla_policy_loss(logp: Float[Tensor, "b t"], old_logp: Float[Tensor, "b t"], advantages: Float[Tensor, "b t"],
                        mask: Bool[Tensor, "b t"], *, is_weights: Float[Tensor, "b t"] | None = None,
                        clip_low: float, clip_high: float, clip_c: float | None, loss_agg: str,
                        loss_norm: float | None) -> PolicyLossOutput:
    """:func:`ppo_clip_loss` with the actor's clip settings and aggregation."""
    return ppo_clip_loss(logp, old_logp, advantages, mask, clip_low=clip_low, clip_high=clip_high, clip_c=clip_c,
                         agg=loss_agg, norm=loss_norm, is_weights=is_weights)


@policy_loss("gspo", reads=lambda s: {**clip_settings(s), **aggregation_settings(s)})
def gspo_policy_loss(logp: Float[Tensor, "b t"], old_logp: Float[Tensor, "b t"], advantages: Float[Tensor, "b t"],
                     mask: Bool[Tensor, "b t"], *, is_weights: Float[Tensor, "b t"] | None = None,
                     clip_low: float, clip_high: float, loss_agg: str, loss_norm: float | None) -> PolicyLossOutput:
    """:func:`gspo_loss` with the actor's clip settings and aggregation (``clip_c`` is not used)."""
    return gspo_loss(logp, old_logp, advantages, mask, clip_low=clip_low, clip_high=clip_high, agg=loss_agg,
                     norm=loss_norm, is_weights=is_weights)


@policy_loss("gpg", reads=aggregation_settings)
def gpg_policy_loss(logp: Float[Tensor, "b t"], old_logp: Float[Tensor, "b t"], advantages: Float[Tensor, "b t"],
                    mask: Bool[Tensor, "b t"], *, is_weights: Float[Tensor, "b t"] | None = None,
                    loss_agg: str, loss_norm: float | None) -> PolicyLossOutput:
    """GPG: the plain policy gradient ``−logp·A`` (times ``is_weights``), aggregated with ``agg``.

    No ratio and no clipping; ``old_logp`` only enters the ``ppo_kl`` metric ``mean_m(−lr)`` (verl
    reports no metrics; the clip fractions are 0).
    """
    check_loss_inputs("gpg_policy_loss", logp, old_logp, advantages, mask, is_weights)
    loss = weighted(-valid_only(logp, mask) * valid_only(advantages, mask), is_weights, mask)
    log_ratio = valid_only(logp - old_logp, mask)
    return loss_output(aggregate_loss(loss, mask, loss_agg, loss_norm), loss, mask, log_ratio)


@policy_loss("reinforce", reads=aggregation_settings)
def reinforce_policy_loss(logp: Float[Tensor, "b t"], old_logp: Float[Tensor, "b t"], advantages: Float[Tensor, "b t"],
                          mask: Bool[Tensor, "b t"], *, is_weights: Float[Tensor, "b t"] | None = None,
                          loss_agg: str, loss_norm: float | None) -> PolicyLossOutput:
    """Plain REINFORCE ``−A·logp·sg(w)`` (verl's ``compute_policy_loss_reinforce``, the ``reinforce``
    loss type of ``bypass_mode``), aggregated with ``agg``.

    ``is_weights`` are detached (verl computes them without gradient). The same value as ``gpg``;
    ``ppo_kl = mean_m(−lr)``, the clip fractions are 0. verl registers this maths only inside
    ``bypass_mode``; it is registered here on its own.
    """
    check_loss_inputs("reinforce_policy_loss", logp, old_logp, advantages, mask, is_weights)
    return reinforce_loss(logp, old_logp, advantages, mask, loss_agg, loss_norm, is_weights)


@policy_loss("cispo", reads=lambda s: {**clip_settings(s), **aggregation_settings(s)})
def cispo_policy_loss(logp: Float[Tensor, "b t"], old_logp: Float[Tensor, "b t"], advantages: Float[Tensor, "b t"],
                      mask: Bool[Tensor, "b t"], *, is_weights: Float[Tensor, "b t"] | None = None,
                      clip_low: float, clip_high: float, loss_agg: str, loss_norm: float | None) -> PolicyLossOutput:
    """CISPO: ``−sg(clamp(ρ, 1−ε_lo, 1+ε_hi))·A·logp`` with ``ρ = exp(clamp(lr, ±20))``.

    The clipped ratio only weighs the gradient ``−sg(clip(ρ))·A·∇logp``; the value uses the raw
    log-prob. Times ``is_weights``, aggregated with ``agg``. ``clipfrac = mean_m[ρ ≠ clip(ρ)]``,
    ``clipfrac_lower = 0``, ``ppo_kl = mean_m(−lr)`` (clamped lr).
    """
    check_loss_inputs("cispo_policy_loss", logp, old_logp, advantages, mask, is_weights)
    check_clips("cispo_policy_loss", clip_low, clip_high, None)
    adv = valid_only(advantages, mask)
    log_ratio = torch.clamp(valid_only(logp - old_logp, mask), min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio).detach()
    clipped = torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    loss = weighted(-clipped * adv * valid_only(logp, mask), is_weights, mask)
    return loss_output(aggregate_loss(loss, mask, loss_agg, loss_norm), loss, mask, log_ratio,
                       clipfrac=(ratio != clipped).to(loss.dtype))


@policy_loss("sapo", aggregation="seq-mean-token-mean",
             reads=lambda s: {"tau_pos": s.loss_options.tau_pos, "tau_neg": s.loss_options.tau_neg})
def sapo_policy_loss(logp: Float[Tensor, "b t"], old_logp: Float[Tensor, "b t"], advantages: Float[Tensor, "b t"],
                     mask: Bool[Tensor, "b t"], *, is_weights: Float[Tensor, "b t"] | None = None,
                     tau_pos: float, tau_neg: float) -> PolicyLossOutput:
    """SAPO: the soft gate ``f = σ(τ(ρ − 1))·4/τ`` instead of a hard clip; loss ``−f·A``.

    ``ρ = exp(clamp(lr, ±20))``, ``τ = tau_pos`` where ``A > 0`` and ``tau_neg`` elsewhere (so
    ``A = 0`` uses ``tau_neg``). At ``ρ = 1`` the gradient is ``−A·∇logp`` for every τ. Times
    ``is_weights``, **always aggregated with** ``seq-mean-token-mean`` (verl ignores
    ``loss_agg_mode``; ``loss_agg`` and ``loss_norm`` are not taken, see
    :meth:`PolicyLoss.aggregation_of`).
    Both clip fractions are 0; ``ppo_kl = mean_m(−lr)`` (clamped lr).
    """
    check_loss_inputs("sapo_policy_loss", logp, old_logp, advantages, mask, is_weights)
    adv = valid_only(advantages, mask)
    log_ratio = torch.clamp(valid_only(logp - old_logp, mask), min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    tau_pos = torch.as_tensor(tau_pos, dtype=adv.dtype, device=adv.device)
    tau_neg = torch.as_tensor(tau_neg, dtype=adv.dtype, device=adv.device)
    tau = torch.where(adv > 0, tau_pos, tau_neg)
    gates = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    loss = weighted(-gates * adv, is_weights, mask)
    return loss_output(aggregate_loss(loss, mask, "seq-mean-token-mean"), loss, mask, log_ratio)


@policy_loss("geo_mean", aggregation="row-mean", reads=clip_settings)
def geo_mean_policy_loss(logp: Float[Tensor, "b t"], old_logp: Float[Tensor, "b t"], advantages: Float[Tensor, "b t"],
                         mask: Bool[Tensor, "b t"], *, is_weights: Float[Tensor, "b t"] | None = None,
                         clip_low: float, clip_high: float) -> PolicyLossOutput:
    """GMPO: the geometric mean of the token ratios of each row, clipped in log space per token.

    With the unclamped ``lr``, ``σ_A = sign(A)`` and ``lr_cl = clamp(lr, −ε_lo, ε_hi)``:
    ``lr* = σ_A·min(σ_A·lr, σ_A·lr_cl)`` (0 where ``A = 0``), ``R_i = exp(Σ_t lr*·m / (n_i+1e-8))``,
    ``Ā_i = Σ_t A·m / (n_i + 1e-8)``; the loss is the **mean over all rows, empty ones included**,
    of ``−Ā_i·R_i`` (``SumCount(Σ_i −Ā_i·R_i, B)``, the ``row-mean`` count; verl's
    ``torch.mean``), whatever ``agg``. ``is_weights`` enter per row as their geometric mean
    ``exp(Σ_t log(w + 1e-10)·m / (n_i + 1e-8))``. ``clipfrac = mean_m([lr ≠ lr_cl]·[A > 0])``,
    ``clipfrac_lower`` the same with ``A < 0``, ``ppo_kl = mean_m(−lr)``.
    """
    check_loss_inputs("geo_mean_policy_loss", logp, old_logp, advantages, mask, is_weights)
    check_clips("geo_mean_policy_loss", clip_low, clip_high, None)
    adv = valid_only(advantages, mask)
    log_ratio = valid_only(logp - old_logp, mask)
    sign = torch.sign(adv)
    clamped = torch.clamp(log_ratio, -clip_low, clip_high)
    pessimistic = sign * torch.minimum(sign * log_ratio, sign * clamped)
    lengths = mask.sum(-1).to(adv.dtype) + 1e-8
    ratio = torch.exp(masked_sum(pessimistic, mask, dim=-1) / lengths)
    row_adv = masked_sum(adv, mask, dim=-1) / lengths
    rows = -row_adv * ratio
    if is_weights is not None:
        log_weights = torch.log(valid_only(is_weights, mask) + 1e-10)
        rows = rows * torch.exp(masked_sum(log_weights, mask, dim=-1) / lengths)
    clipped = (log_ratio != clamped).to(adv.dtype)
    count = torch.full((), adv.shape[0], dtype=rows.dtype, device=rows.device)
    return loss_output(SumCount(rows.sum(), count), clipped, mask, log_ratio, clipfrac=clipped * (adv > 0),
                       clipfrac_lower=clipped * (adv < 0))


@policy_loss("dro", vanishes=False,
             reads=lambda s: {"dro_beta": s.loss_options.dro_beta, **aggregation_settings(s)})
def dro_policy_loss(logp: Float[Tensor, "b t"], old_logp: Float[Tensor, "b t"], advantages: Float[Tensor, "b t"],
                    mask: Bool[Tensor, "b t"], *, is_weights: Float[Tensor, "b t"] | None = None,
                    dro_beta: float | None, loss_agg: str, loss_norm: float | None) -> PolicyLossOutput:
    """DRO (verl 0.9.1): ``−(logp·A − ½β·lr²)`` with ``β = dro_beta`` and the unclamped ``lr``.

    Times ``is_weights``, aggregated with ``agg``; the gradient per token is ``(−A + β·lr)·∇logp``.
    ``dro_beta`` None raises ``ValueError`` (verl: it must be > 0). Clip fractions 0,
    ``ppo_kl = mean_m(−lr)``. The ``½β·lr²`` term does not vanish with ``A = 0``.
    """
    check_loss_inputs("dro_policy_loss", logp, old_logp, advantages, mask, is_weights)
    if dro_beta is None:
        raise ValueError("dro_policy_loss: dro_beta (actor.loss_options.dro_beta) must be set (> 0) for the dro loss")
    adv = valid_only(advantages, mask)
    log_ratio = valid_only(logp - old_logp, mask)
    loss = -(valid_only(logp, mask) * adv - 0.5 * dro_beta * log_ratio.square())
    loss = weighted(loss, is_weights, mask)
    return loss_output(aggregate_loss(loss, mask, loss_agg, loss_norm), loss, mask, log_ratio)
