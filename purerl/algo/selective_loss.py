"""Policy losses that select or drop tokens (verl 0.9.1): ``clip_cov`` and ``kl_cov`` (by the
covariance of advantage and log-prob over the batch given), ``dppo_tv`` and ``dppo_kl`` (by how
far a token's probability moved) and ``bypass_mode`` (by its rollout importance ratio, with the
weights of :mod:`purerl.algo.correction`). Conventions: :mod:`purerl.algo.policy_loss`; records:
:mod:`purerl.algo.loss_records`.
"""


import torch
from jaxtyping import Bool, Float
from torch import Tensor

from purerl.algo.aggregation import SumCount, aggregate_loss
from purerl.algo.correction import importance_weights
from purerl.algo.loss_records import (
    PolicyLossOutput,
    aggregation_settings,
    check_clips,
    check_loss_inputs,
    clip_settings,
    loss_output,
    policy_loss,
    reinforce_loss,
    token_metric,
    valid_only,
    weighted,
    zero_metric,
)
from purerl.algo.loss_settings import PolicyLossSettings
from purerl.algo.masked import masked_mean
from purerl.algo.policy_loss import ppo_clip_loss

__all__ = ["bypass_mode_policy_loss", "clip_cov_policy_loss", "dppo_kl_policy_loss", "dppo_tv_policy_loss",
           "kl_cov_policy_loss"]


def _dppo(where: str, logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, is_weights: Tensor | None,
          divergence: str, *, clip_low: float, clip_high: float, clip_c: float | None, loss_agg: str,
          loss_norm: float | None) -> PolicyLossOutput:
    check_loss_inputs(where, logp, old_logp, advantages, mask, is_weights)
    check_clips(where, clip_low, clip_high, None)
    adv = valid_only(advantages, mask)
    current, old = valid_only(logp, mask), valid_only(old_logp, mask)
    log_ratio = torch.clamp(valid_only(logp - old_logp, mask), min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio).detach()
    cap = 20.0 if clip_c is None else clip_c
    truncated = torch.clamp(ratio, max=cap)
    with torch.no_grad():
        prob, old_prob = torch.exp(current), torch.exp(old)
        if divergence == "tv":
            up_ok = (prob - old_prob) <= clip_high
            down_ok = (prob - old_prob) >= -clip_low
        else:
            binary_kl = old_prob * (old - current) + (1 - old_prob) * torch.log(
                (1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8))
            up_ok = (binary_kl <= clip_high) | (prob <= old_prob)
            down_ok = (binary_kl <= clip_low) | (prob >= old_prob)
        valid = torch.where(adv > 0, up_ok, down_ok).to(adv.dtype)
    loss = weighted(-adv * truncated * current * valid, is_weights, mask)
    return loss_output(aggregate_loss(loss, mask, loss_agg, loss_norm), loss, mask, log_ratio, clipfrac=1.0 - valid,
                       clipfrac_lower=(ratio > cap).to(adv.dtype) * valid)


@policy_loss("clip_cov", vanishes=False, reads=lambda s: {
    **clip_settings(s), "clip_cov_ratio": s.loss_options.clip_cov_ratio, "clip_cov_lb": s.loss_options.clip_cov_lb,
    "clip_cov_ub": s.loss_options.clip_cov_ub, **aggregation_settings(s)})
def clip_cov_policy_loss(logp: Float[Tensor, "b t"], old_logp: Float[Tensor, "b t"], advantages: Float[Tensor, "b t"],
                         mask: Bool[Tensor, "b t"], *, is_weights: Float[Tensor, "b t"] | None = None,
                         generator: torch.Generator | None = None,
                         clip_low: float, clip_high: float,
                         clip_cov_ratio: float, clip_cov_lb: float, clip_cov_ub: float, loss_agg: str,
                         loss_norm: float | None) -> PolicyLossOutput:
    """Clip-Cov: PPO without dual clip, with a few high-covariance tokens detached at random.

    ``ρ = exp(lr)`` (unclamped), ``L1``/``L2`` as in PPO. ``cov = (A − mean_m A)·(logp −
    mean_m sg(logp))`` (``masked_mean`` with its 1e-8). Candidates: valid tokens not already
    clipped (``L2 > L1``) with ``clip_cov_lb < cov < clip_cov_ub``. ``k = min(max(int(
    clip_cov_ratio·Σm), 1), #candidates)`` of them, drawn with ``randperm`` over the candidates
    in row-major order, get ``corr = 0``: zero loss and gradient, still counted in the
    aggregation. Loss ``max(L1, L2)·corr`` times ``is_weights``, aggregated with ``agg``.
    ``clipfrac = mean_m[corr = 0]``, ``clipfrac_lower = 0``, ``ppo_kl = mean_m(−lr)``.

    Deviation: verl draws from the global RNG; here the draw comes from ``generator``, or from a
    fresh generator seeded with 0 when it is None, so the loss is deterministic. The selection
    depends on the whole batch given (its means and its token count), so micro-batches do not add
    up to the whole and rows with zero advantages change it (:func:`vanishes_at_zero_advantage`).
    """
    check_loss_inputs("clip_cov_policy_loss", logp, old_logp, advantages, mask, is_weights)
    check_clips("clip_cov_policy_loss", clip_low, clip_high, None)
    adv = valid_only(advantages, mask)
    log_ratio = valid_only(logp - old_logp, mask)
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    with torch.no_grad():
        current = valid_only(logp, mask).detach()
        cov = (adv - masked_mean(adv, mask)) * (current - masked_mean(current, mask))
        candidates = mask & ~(clipped > unclipped) & (cov > clip_cov_lb) & (cov < clip_cov_ub)
        index = candidates.flatten().nonzero().squeeze(-1)
        corr = torch.ones(adv.numel(), dtype=adv.dtype, device=adv.device)
        if index.numel() > 0:
            k = min(max(int(clip_cov_ratio * int(mask.sum())), 1), index.numel())
            rng = torch.Generator().manual_seed(0) if generator is None else generator
            perm = torch.randperm(index.numel(), generator=rng, device=rng.device)[:k]
            corr[index[perm.to(index.device)]] = 0.0
        corr = corr.view_as(adv)
    loss = weighted(torch.maximum(unclipped, clipped) * corr, is_weights, mask)
    return loss_output(aggregate_loss(loss, mask, loss_agg, loss_norm), loss, mask, log_ratio,
                       clipfrac=(corr == 0).to(loss.dtype))


@policy_loss("kl_cov", vanishes=False, reads=lambda s: {
    "kl_cov_ratio": s.loss_options.kl_cov_ratio, "ppo_kl_coef": s.loss_options.ppo_kl_coef, **aggregation_settings(s)})
def kl_cov_policy_loss(logp: Float[Tensor, "b t"], old_logp: Float[Tensor, "b t"], advantages: Float[Tensor, "b t"],
                       mask: Bool[Tensor, "b t"], *, is_weights: Float[Tensor, "b t"] | None = None,
                       kl_cov_ratio: float, ppo_kl_coef: float, loss_agg: str,
                       loss_norm: float | None) -> PolicyLossOutput:
    """KL-Cov: the unclipped ``−A·ρ`` (``ρ = exp(lr)``, unclamped) plus ``ppo_kl_coef·|lr|`` on
    the tokens of largest covariance.

    Over the valid tokens (row-major), ``cov = (A − Ā)(sg(logp) − l̄p)`` with plain means; the
    top ``k = max(1, int(N·kl_cov_ratio))`` (``torch.topk`` on the CPU, as verl) get the
    penalty. Times ``is_weights``, aggregated with ``agg``. Both clip fractions are 0 (verl
    reports none); ``ppo_kl = mean_m|lr|`` (verl's). The selection depends on the whole batch
    given, and a row with zero advantages may still be penalised
    (:func:`vanishes_at_zero_advantage` is False).
    """
    check_loss_inputs("kl_cov_policy_loss", logp, old_logp, advantages, mask, is_weights)
    adv = valid_only(advantages, mask)
    log_ratio = valid_only(logp - old_logp, mask)
    loss = -adv * torch.exp(log_ratio)
    valid = int(mask.sum())
    if valid > 0:
        with torch.no_grad():
            flat_adv = adv[mask].detach().cpu()
            flat_logp = logp.detach()[mask].cpu()
            cov = (flat_adv - flat_adv.mean()) * (flat_logp - flat_logp.mean())
            top = torch.topk(cov, max(1, int(valid * kl_cov_ratio))).indices
            chosen = torch.zeros(valid, dtype=torch.bool)
            chosen[top] = True
            selected = torch.zeros_like(mask)
            selected[mask] = chosen.to(mask.device)
        loss = torch.where(selected, loss + ppo_kl_coef * log_ratio.abs(), loss)
    loss = weighted(loss, is_weights, mask)
    return PolicyLossOutput(
        loss=aggregate_loss(loss, mask, loss_agg, loss_norm),
        clipfrac=zero_metric(loss, mask),
        clipfrac_lower=zero_metric(loss, mask),
        ppo_kl=token_metric(log_ratio.abs(), mask),
    )


@policy_loss("dppo_tv", reads=lambda s: {**clip_settings(s), "clip_c": s.clip_c, **aggregation_settings(s)})
def dppo_tv_policy_loss(logp: Float[Tensor, "b t"], old_logp: Float[Tensor, "b t"], advantages: Float[Tensor, "b t"],
                        mask: Bool[Tensor, "b t"], *, is_weights: Float[Tensor, "b t"] | None = None,
                        clip_low: float, clip_high: float, clip_c: float | None, loss_agg: str,
                        loss_norm: float | None) -> PolicyLossOutput:
    """DPPO-Binary-TV (verl 0.9.1): ``−A·sg(min(ρ, c))·logp·valid``, a truncated-IS policy gradient
    that drops tokens whose probability moved too far.

    ``ρ = exp(clamp(lr, ±20))``, ``c = clip_c`` (verl's ``clip_ratio_c``; 20, verl's fallback,
    when None), ``p = e^logp``, ``p₀ = e^old_logp``; ``valid`` (detached) is ``p − p₀ ≤ ε_hi``
    where ``A > 0`` and ``p − p₀ ≥ −ε_lo`` elsewhere (``clip_low``/``clip_high`` are the TV
    thresholds). Times ``is_weights``, aggregated with ``agg``. ``clipfrac = mean_m(1 − valid)``,
    ``clipfrac_lower = mean_m([ρ > c]·valid)``, ``ppo_kl = mean_m(−lr)``.
    """
    return _dppo("dppo_tv_policy_loss", logp, old_logp, advantages, mask, is_weights, "tv", clip_low=clip_low,
                 clip_high=clip_high, clip_c=clip_c, loss_agg=loss_agg, loss_norm=loss_norm)


@policy_loss("dppo_kl", reads=lambda s: {**clip_settings(s), "clip_c": s.clip_c, **aggregation_settings(s)})
def dppo_kl_policy_loss(logp: Float[Tensor, "b t"], old_logp: Float[Tensor, "b t"], advantages: Float[Tensor, "b t"],
                        mask: Bool[Tensor, "b t"], *, is_weights: Float[Tensor, "b t"] | None = None,
                        clip_low: float, clip_high: float, clip_c: float | None, loss_agg: str,
                        loss_norm: float | None) -> PolicyLossOutput:
    """DPPO-Binary-KL (verl 0.9.1): :func:`dppo_tv_policy_loss` with the binary-KL validity test.

    ``bkl = p₀(old_logp − logp) + (1−p₀)·log((1−p₀+1e-8)/(1−p+1e-8))``; ``valid`` is
    ``bkl ≤ ε_hi or p ≤ p₀`` where ``A > 0`` and ``bkl ≤ ε_lo or p ≥ p₀`` elsewhere.
    """
    return _dppo("dppo_kl_policy_loss", logp, old_logp, advantages, mask, is_weights, "kl", clip_low=clip_low,
                 clip_high=clip_high, clip_c=clip_c, loss_agg=loss_agg, loss_norm=loss_norm)


def _bypass_weights(logp: Tensor, old_logp: Tensor, mask: Tensor, *, bypass_level: str, bypass_threshold: float,
                    bypass_threshold_low: float | None, bypass_batch_normalize: bool) -> tuple[Tensor, Tensor]:
    """Detached IS weights ``π/μ`` (0 where masked or rejected) and the mask of kept tokens: the
    rollout corrections ``token-tis``/``seq-tis`` (truncated at the threshold) or
    ``token-mask``/``seq-mask`` (rejected outside ``[low, threshold]``), optionally divided by their mean."""
    sequence = bypass_level == "sequence"
    if bypass_threshold_low is None:
        mode, lower = ("seq-tis" if sequence else "token-tis"), None
    else:
        mode, lower = ("seq-mask" if sequence else "token-mask"), bypass_threshold_low
    weights, _ = importance_weights(mode, logp.detach(), old_logp, mask, cap=bypass_threshold, lower=lower)
    keep = mask if bypass_threshold_low is None else mask & (weights > 0)  # a kept weight is ≥ e^-20 > 0
    if bypass_batch_normalize:
        with torch.no_grad():
            if not sequence:
                mean = masked_mean(weights, mask)
            else:
                rows = (mask.sum(-1) > 0).to(weights.dtype)
                mean = (masked_mean(weights, mask, dim=-1) * rows).sum() / rows.sum().clamp_min(1e-8)
            weights = torch.where(mean > 1e-8, weights / mean, weights)
    return weights, keep


def _bypass_vanishes(settings: PolicyLossSettings) -> bool:
    """``bypass_mode`` leaves zero-advantage rows out unless its REINFORCE weights are normalised over the batch."""
    options = settings.loss_options
    return not (options.bypass_batch_normalize and options.bypass_loss_type == "reinforce")


@policy_loss("bypass_mode", vanishes=_bypass_vanishes, reads=lambda s: {
    **clip_settings(s), "clip_c": s.clip_c, **aggregation_settings(s),
    "bypass_loss_type": s.loss_options.bypass_loss_type,
    "bypass_level": s.loss_options.bypass_level, "bypass_threshold": s.loss_options.bypass_threshold,
    "bypass_threshold_low": s.loss_options.bypass_threshold_low,
    "bypass_batch_normalize": s.loss_options.bypass_batch_normalize})
def bypass_mode_policy_loss(logp: Float[Tensor, "b t"], old_logp: Float[Tensor, "b t"],
                            advantages: Float[Tensor, "b t"], mask: Bool[Tensor, "b t"], *,
                            is_weights: Float[Tensor, "b t"] | None = None, clip_low: float, clip_high: float,
                            clip_c: float | None, loss_agg: str, loss_norm: float | None, bypass_loss_type: str,
                            bypass_level: str, bypass_threshold: float, bypass_threshold_low: float | None,
                            bypass_batch_normalize: bool) -> PolicyLossOutput:
    """verl's rollout-correction bypass mode: ``old_logp`` is the rollout (behaviour) log-prob.

    IS weights ``w`` (detached) from ``lr = logp − old_logp``: per token ``exp(clamp(lr, ±20))``
    (``bypass_level="token"``) or per row ``exp(clamp(Σ_t lr·m, ±20))`` (``"sequence"``), 0
    where masked. With ``bypass_threshold_low`` None they are truncated at ``bypass_threshold``
    (TIS); otherwise tokens (whole rows at sequence level) whose weight lies outside
    ``[bypass_threshold_low, bypass_threshold]`` are rejected: weight 0 and out of the loss mask
    (IcePop). ``bypass_batch_normalize`` then divides the weights by their mean (over valid
    tokens, or over non-empty rows at sequence level; skipped when the mean is ≤ 1e-8).

    ``bypass_loss_type="ppo_clip"``: the ``vanilla`` loss (clip, dual clip, ``agg``) on the kept
    tokens, **without** the weights (the PPO ratio is already ``π/μ``);
    ``"reinforce"``: ``−A·logp·w`` on the kept tokens. Rejected tokens add 0 to the total but stay
    in the count, which is that of ``mask`` (as verl's global token/row counts), so
    ``loss_denominator(mask, agg)`` divides it. Metrics are those of the inner loss over the kept
    tokens. The trainer's ``is_weights`` are ignored (verl computes its own).

    Deviations from verl: one pair of bounds does both jobs — verl zeroes IcePop weights
    (``rollout_is_threshold="lo_hi"``) and rejects tokens from the mask only through its separate
    rejection sampling (``rollout_rs``), which this rejection equals for the same bounds; verl's
    veto threshold and geometric rejection are not offered. With ``bypass_batch_normalize`` the
    weights depend on the whole batch given (a micro-batch; verl normalises over its local
    micro-batch too, or all-reduces across ranks), so parts do not add up to the whole.
    """
    check_loss_inputs("bypass_mode_policy_loss", logp, old_logp, advantages, mask, is_weights)
    weights, keep = _bypass_weights(logp, old_logp, mask, bypass_level=bypass_level,
                                    bypass_threshold=bypass_threshold, bypass_threshold_low=bypass_threshold_low,
                                    bypass_batch_normalize=bypass_batch_normalize)
    if bypass_loss_type == "ppo_clip":
        out = ppo_clip_loss(logp, old_logp, advantages, keep, clip_low=clip_low, clip_high=clip_high, clip_c=clip_c,
                            agg=loss_agg, norm=loss_norm)
    else:
        out = reinforce_loss(logp, old_logp, advantages, keep, loss_agg, loss_norm, weights)
    count = aggregate_loss(torch.zeros_like(weights), mask, loss_agg, loss_norm).count
    return PolicyLossOutput(loss=SumCount(out.loss.total, count), clipfrac=out.clipfrac,
                            clipfrac_lower=out.clipfrac_lower, ppo_kl=out.ppo_kl)
