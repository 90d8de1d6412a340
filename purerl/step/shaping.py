"""Reward shaping: token rewards (with the KL penalty in the reward), the off-policy correction's
importance weights and the advantages, from an :class:`~purerl.step.experience.Experience`."""

import math
from typing import Any

import torch
from jaxtyping import Bool, Float
from torch import Tensor

from purerl.algo.advantages import AdvantageInputs
from purerl.algo.correction import importance_weights
from purerl.algo.distill import reverse_kl_advantages, sampled_reverse_kl
from purerl.algo.kl import apply_kl_penalty
from purerl.algo.masked import masked_mean
from purerl.batch import Sequences
from purerl.step.experience import Experience, TeacherScores
from purerl.step.settings import Shaping
from purerl.tree import pytree, static_field, tree_map

__all__ = ["Metrics", "TrainBatch", "shape_rewards", "token_level_scores"]

Metrics = dict[str, float]


@pytree
class TrainBatch:
    """What the actor and critic updates consume. ``is_weights``: the off-policy correction's
    per-token weights of the policy loss (None: uncorrected; :attr:`Shaping.correction`);
    ``teacher``: a distillation teacher's scores, for its loss term; ``behaviour_logprobs``: the
    engine's log-probs of the sampled tokens when the weights this update starts from sampled them,
    for the weight-sync check (:attr:`~purerl.step.settings.ActorLoss.sync_tolerance`; None: unchecked).
    ``temperature``: what the losses compute log-probs at, the rollout's sampling temperature (1 for
    supervised batches)."""

    sequences: Sequences
    old_logprobs: Float[Tensor, "b t"]
    ref_logprobs: Float[Tensor, "b t"] | None
    advantages: Float[Tensor, "b t"]
    returns: Float[Tensor, "b t"]
    values: Float[Tensor, "b t"] | None
    is_weights: Float[Tensor, "b t"] | None = None
    teacher: TeacherScores | None = None
    behaviour_logprobs: Float[Tensor, "b t"] | None = None
    temperature: float = static_field(kw_only=True)

    def rows(self, index: Tensor | slice) -> "TrainBatch":
        return tree_map(lambda x: x[index] if isinstance(x, Tensor) else x, self)


def token_level_scores(scores: Float[Tensor, " b"], mask: Bool[Tensor, "b t"]) -> Float[Tensor, "b t"]:
    """Each sequence's score placed on its last valid token (0 elsewhere, and for empty rows)."""
    positions = torch.arange(mask.shape[1], device=mask.device)
    last = torch.where(mask, positions, -1).max(-1).values
    onehot = (positions[None] == last[:, None]) & mask
    return torch.where(onehot, scores[:, None].to(torch.float32), 0.0)


def shape_rewards(experience: Experience, kl_state: Any, kl_controller: Any, *,
                  shaping: Shaping) -> tuple[TrainBatch, Any, Metrics]:
    """Token rewards (minus the KL penalty when ``shaping.kl_penalty`` names one, whose controller
    state comes back updated), the importance weights of ``shaping.correction`` (``rollout_corr/*``
    metrics) and the advantages of ``shaping.estimator``, mixed with a teacher's reverse-KL
    advantages under ``shaping.distill`` (``distill/*`` metrics whenever a teacher scored)."""
    mask = experience.sequences.response_mask
    rewards = (token_level_scores(experience.scores, mask) if experience.token_rewards is None
               else torch.where(mask, experience.token_rewards, 0.0))
    metrics: Metrics = {}
    if shaping.kl_penalty is not None:
        if experience.ref_logprobs is None:
            raise ValueError("shape_rewards: a KL penalty in the reward needs reference log-probs "
                             "(TrainState.reference params)")
        penalty = apply_kl_penalty(rewards, experience.old_logprobs, experience.ref_logprobs, mask,
                                   kl_state.coef, shaping.kl_penalty)
        metrics["actor/reward_kl_penalty"] = float(penalty.current_kl)
        metrics["actor/reward_kl_penalty_coeff"] = float(kl_state.coef)
        kl_state = kl_controller.update(kl_state, penalty.current_kl, len(experience.scores))
        rewards = penalty.rewards
    is_weights, correction = importance_weights(shaping.correction, experience.old_logprobs,
                                                experience.behaviour_logprobs, mask, cap=shaping.correction_cap)
    estimator = shaping.estimator
    otb = estimator.needs_sum_pi_squared
    inputs = AdvantageInputs(rewards=rewards, mask=mask, values=experience.values, group=experience.group,
                             reward_baselines=experience.baselines, reward_components=experience.components,
                             old_logprobs=experience.old_logprobs if otb else None,
                             sum_pi_squared=experience.sum_pi_squared if otb else None,
                             is_weights=is_weights if otb else None)
    advantages, returns = estimator(inputs)
    if experience.teacher is not None:
        advantages = _distilled(advantages, experience, shaping, metrics)
    metrics.update({
        "critic/score/mean": float(experience.scores.mean()),
        "critic/rewards/mean": float(rewards.sum(-1).mean()),
        "critic/advantages/mean": float(masked_mean(advantages, mask)),
        "critic/advantages/max": float(torch.where(mask, advantages, -math.inf).max()) if mask.any() else 0.0,
        "critic/advantages/min": float(torch.where(mask, advantages, math.inf).min()) if mask.any() else 0.0,
        "critic/returns/mean": float(masked_mean(returns, mask)),
    })
    metrics.update({f"rollout_corr/{name}": float(value.value()) for name, value in correction.items()})
    metrics.update(_logprob_gap_metrics(experience))
    if experience.routing_disagreement is not None:
        differ, both = experience.routing_disagreement.sum(dim=(0, 1)).tolist()
        metrics["rollout/routing_mismatch"] = differ / both if both else 0.0
    batch = TrainBatch(experience.sequences, experience.old_logprobs, experience.ref_logprobs,
                       advantages, returns, experience.values, is_weights, experience.teacher,
                       experience.behaviour_logprobs if experience.on_policy else None,
                       temperature=experience.temperature)
    return batch, kl_state, metrics


def _logprob_gap_metrics(experience: Experience) -> Metrics:
    """How far the engine's log-probs of the sampled tokens are from the old ones (the trainer's,
    when recomputed): ``rollout/logprob_gap_*`` (the health monitor's ``logprob_drift``), and the
    count of non-finite ones, on which the driver stops (StepRecorder)."""
    mask = experience.sequences.response_mask
    gap = (experience.behaviour_logprobs - experience.old_logprobs).abs()
    finite = experience.behaviour_logprobs.isfinite() & experience.old_logprobs.isfinite()
    return {
        "rollout/logprob_gap_max": float(torch.where(mask, gap, 0.0).max()) if mask.numel() else 0.0,
        "rollout/logprob_gap_mean": float(masked_mean(gap, mask)),
        "rollout/nonfinite_logprobs": float((mask & ~finite).sum()),
    }


def _distilled(advantages: Tensor, experience: Experience, shaping: Shaping, metrics: Metrics) -> Tensor:
    """``reward_coef·A_task + coef·A_teacher`` under ``shaping.distill`` (unchanged without it), and
    the teacher's metrics: the sampled reverse KL and its mean log-prob of the student's tokens."""
    mask, teacher = experience.sequences.response_mask, experience.teacher.logprobs
    metrics["distill/reverse_kl"] = float(masked_mean(sampled_reverse_kl(experience.old_logprobs, teacher, mask),
                                                      mask))
    metrics["distill/teacher_logprob"] = float(masked_mean(teacher, mask))
    distill = shaping.distill
    if distill is None:
        return advantages
    mixed = distill.reward_coef * advantages
    if distill.coef:
        mixed = mixed + distill.coef * reverse_kl_advantages(experience.old_logprobs, teacher, mask,
                                                             gamma=distill.gamma)
    return torch.where(mask, mixed, 0.0)
