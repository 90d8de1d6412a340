"""The settings of the stages, each bound once when a step is assembled (like an optax transform's):
small frozen records that pickle, so a step function built from them runs on any executor.

- :class:`Batching`: how an update or a no-grad forward splits a batch;
- :class:`ExperienceSettings`: what :func:`~purerl.step.experience.make_experience` computes;
- :class:`Shaping`: the advantage estimator (closed over its settings), the KL penalty in the
  reward and the off-policy correction (:func:`~purerl.step.shaping.shape_rewards`);
- :class:`ActorLoss`: the policy loss (closed over its settings), the entropy bonus and the KL
  loss (:func:`~purerl.step.update.actor_update`);
- :class:`ValueLoss`: the critic's clipped value loss (:func:`~purerl.step.update.critic_update`);
- :class:`DistillAdvantage`, :class:`DistillLoss`: a teacher's signal as an advantage and as a loss
  term (:mod:`purerl.algo.distill`).

A job's config becomes these in one place (:mod:`purerl.assembly`); a script builds them directly.
"""

import attrs

from purerl.algo.estimators import BoundEstimator
from purerl.algo.policy_loss import BoundPolicyLoss

__all__ = ["ActorLoss", "Batching", "DistillAdvantage", "DistillLoss", "ExperienceSettings", "Shaping", "ValueLoss"]


@attrs.frozen
class Batching:
    """``epochs`` shuffled passes in mini-batches of ``mini_batch_rows`` rows (None: the whole batch,
    one optimizer step per epoch), each split into micro-batches of ``micro_batch_rows`` rows or,
    with ``max_tokens``, of at most that many positions once their padding is trimmed
    (:mod:`purerl.step.micro_batches`). No-grad forwards use the micro-batches only."""

    micro_batch_rows: int = 8
    max_tokens: int | None = None
    mini_batch_rows: int | None = None
    epochs: int = 1


@attrs.frozen
class ExperienceSettings:
    """The experience's forwards: log-probs at the rollout's sampling temperature
    (:attr:`~purerl.batch.Rollout.temperature`) in ``batching``'s micro-batches, the critic's values
    in ``critic_batching``'s (None: ``batching``).
    ``recompute_old_logprobs``: the old log-probs from a forward of the policy (else the engine's);
    ``sum_pi_squared``: also ``Σ_v π_old(v)²`` per position (the optimal-token-baseline estimators);
    ``teacher_top_k``: with a teacher, also its ``k`` likeliest tokens per position (0: the whole
    vocabulary), for a :class:`DistillLoss`; None: its log-probs of the sampled tokens only."""

    batching: Batching = Batching()
    critic_batching: Batching | None = None
    recompute_old_logprobs: bool = True
    sum_pi_squared: bool = False
    teacher_top_k: int | None = None


@attrs.frozen
class DistillAdvantage:
    """The teacher's per-token reverse-KL advantage (:func:`~purerl.algo.distill.reverse_kl_advantages`,
    discounted by ``gamma``) times ``coef``, added to the task's advantages times ``reward_coef``
    (0: distillation alone)."""

    coef: float = 1.0
    gamma: float = 0.0
    reward_coef: float = 0.0


@attrs.frozen
class DistillLoss:
    """GKD's ``JSD_β`` to the teacher on its top-k tokens (:func:`~purerl.algo.distill.generalized_jsd`)
    times ``coef``, aggregated as the policy loss is."""

    coef: float = 1.0
    beta: float = 0.5


@attrs.frozen
class Shaping:
    """``estimator``: the advantages (``ADVANTAGE_ESTIMATORS[name].bound(...)``); ``kl_penalty``:
    the KL estimator of the penalty in the reward (None: no penalty); ``correction``: the
    importance weights from the engine's log-probs to the trainer's, capped at ``correction_cap``
    (:func:`~purerl.algo.correction.importance_weights`); ``distill``: the teacher's advantage (None:
    none)."""

    estimator: BoundEstimator
    kl_penalty: str | None = None
    correction: str = "none"
    correction_cap: float = 2.0
    distill: DistillAdvantage | None = None


@attrs.frozen
class ActorLoss:
    """What the actor's update minimises: ``policy_loss`` (``POLICY_LOSSES[name].bound(...)``),
    minus ``entropy_coeff`` × the entropy, plus ``kl_coef`` × the ``kl_type`` KL to the reference,
    all aggregated as the policy loss is; log-probs at the batch's sampling temperature
    (:attr:`~purerl.step.shaping.TrainBatch.temperature`).
    ``compute_entropy``: report ``actor/entropy`` without a bonus. ``skip_zero_advantage_rows``:
    rows whose advantages are all 0 skip the forward and backward where that changes nothing.
    ``distill``: a loss term to the teacher's distributions (None: none). ``sync_tolerance``: the
    weight-sync check, free of extra passes: the first mini-batch's forward (before any optimizer
    step) gives the trainer's log-probs of the sampled tokens under the weights that sampled them, and
    their mean distance to the engine's, ``actor/sync_gap`` (nats per token), must stay within it, else
    the update flags ``actor/sync_failed`` and the driver stops (None: unchecked)."""

    policy_loss: BoundPolicyLoss
    entropy_coeff: float = 0.0
    compute_entropy: bool = True
    kl_coef: float = 0.0
    kl_type: str = "low_var_kl"
    skip_zero_advantage_rows: bool = True
    distill: DistillLoss | None = None
    sync_tolerance: float | None = None


@attrs.frozen
class ValueLoss:
    """The critic's clipped value loss (``clip``: verl's ``cliprange_value``, None: unclipped),
    aggregated with ``agg`` (and ``norm``, the constant of ``seq-mean-token-sum-norm``)."""

    clip: float | None = 0.5
    agg: str = "token-mean"
    norm: float | None = None
