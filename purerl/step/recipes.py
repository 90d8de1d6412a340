"""Composed steps: GRPO-style (no critic) and PPO (a critic, GAE).

A step function is ``step(state, rollout, rewards, *, policy, value_and_grad[, critic]) ->
(state', metrics)``: the executor supplies ``policy``, ``value_and_grad`` and, with a critic,
``critic``; everything else (the stages' settings, optimizers, KL controller) is bound with
``functools.partial`` when the run is assembled (:func:`purerl.assembly.step_function`).
"""

from collections.abc import Callable
from typing import Any

from jaxtyping import Float
from torch import Tensor

from purerl.algo.masked import masked_mean
from purerl.batch import FINISH_LENGTH, Rewards, Rollout
from purerl.models import CausalLM, Critic
from purerl.models import value_and_grad as pure_value_and_grad
from purerl.state import TrainState
from purerl.step.experience import make_experience
from purerl.step.roles import CriticRole, ReferenceRole, TeacherRole, critic_role
from purerl.step.settings import ActorLoss, Batching, ExperienceSettings, Shaping, ValueLoss
from purerl.step.shaping import Metrics, shape_rewards
from purerl.step.update import ValueAndGrad, actor_update

__all__ = ["StepFn", "grpo_step", "ppo_step"]

StepFn = Callable[..., tuple[TrainState, Metrics]]


def _rollout_metrics(rollout: Rollout) -> Metrics:
    lengths = rollout.sequences.response_mask.sum(-1).float()
    return {
        "response_length/mean": float(lengths.mean()),
        "response_length/max": float(lengths.max()),
        "response_length/clip_ratio": float((rollout.finish_reasons == FINISH_LENGTH).float().mean()),
    }


def grpo_step(state: TrainState, rollout: Rollout, rewards: Float[Tensor, " b"] | Rewards, *, policy: CausalLM,
              experience: ExperienceSettings, shaping: Shaping, loss: ActorLoss, batching: Batching, optimizer: Any,
              kl_controller: Any, value_and_grad: ValueAndGrad = pure_value_and_grad,
              reference: ReferenceRole | None = None,
              teacher: TeacherRole | None = None) -> tuple[TrainState, Metrics]:
    """One critic-free step on a scored rollout: experience, advantages, actor update.
    ``reference``: where the reference log-probs come from when the reference lives on a pool of
    its own (the executor's role); without it, from ``state.reference`` here. ``teacher``: a
    distillation teacher's role (:mod:`purerl.step.roles`), whose scores ``shaping.distill`` and
    ``loss.distill`` use."""
    made = make_experience(state, rollout, rewards, policy=policy, settings=experience, reference=reference,
                           teacher=teacher)
    batch, kl_state, metrics = shape_rewards(made, state.kl, kl_controller, shaping=shaping)
    params, opt_state, actor_metrics = actor_update(state.policy, state.policy_opt,
                                                    batch, policy=policy, loss=loss,
                                                    batching=batching, optimizer=optimizer, rng=state.rng,
                                                    value_and_grad=value_and_grad)
    metrics.update(actor_metrics)
    metrics.update(_rollout_metrics(rollout))
    return state.advance(policy=params, policy_opt=opt_state, kl=kl_state, rng=state.rng.next()), metrics


def ppo_step(state: TrainState, rollout: Rollout, rewards: Float[Tensor, " b"] | Rewards, *, policy: CausalLM,
             critic: Critic | CriticRole, experience: ExperienceSettings, shaping: Shaping, loss: ActorLoss,
             batching: Batching, optimizer: Any, critic_loss: ValueLoss, critic_batching: Batching,
             critic_optimizer: Any, kl_controller: Any, critic_warmup: int = 0,
             value_and_grad: ValueAndGrad = pure_value_and_grad,
             reference: ReferenceRole | None = None,
             teacher: TeacherRole | None = None) -> tuple[TrainState, Metrics]:
    """One PPO step: experience with values, advantages, critic update, then actor update. During
    the first ``critic_warmup`` steps (``state.step < critic_warmup``) only the critic trains
    (verl's ``trainer.critic_warmup``): the policy and its optimizer state come back unchanged.

    ``critic``: a :class:`~purerl.models.Critic` (its stages computed here with ``state.critic``,
    gradients by ``value_and_grad``) or a critic role (:mod:`purerl.step.roles`: an executor's, for a
    critic on a pool of its own); ``reference`` and ``teacher`` as in :func:`grpo_step`."""
    critic = critic_role(critic, value_and_grad)
    made = make_experience(state, rollout, rewards, policy=policy, settings=experience, critic=critic,
                           reference=reference, teacher=teacher)
    batch, kl_state, metrics = shape_rewards(made, state.kl, kl_controller, shaping=shaping)
    critic_params, critic_opt, critic_metrics = critic.update(state.critic, state.critic_opt, batch,
                                                              optimizer=critic_optimizer, loss=critic_loss,
                                                              batching=critic_batching, rng=state.rng)
    if state.step < critic_warmup:
        params, opt_state, actor_metrics = state.policy, state.policy_opt, {"actor/critic_warmup": 1.0}
    else:
        params, opt_state, actor_metrics = actor_update(state.policy, state.policy_opt,
                                                        batch, policy=policy,
                                                        loss=loss, batching=batching, optimizer=optimizer,
                                                        rng=state.rng.next(), value_and_grad=value_and_grad)
    metrics.update(critic_metrics)
    metrics.update(actor_metrics)
    metrics.update(_rollout_metrics(rollout))
    metrics["critic/values/mean"] = float(masked_mean(made.values, made.sequences.response_mask))
    return state.advance(policy=params, policy_opt=opt_state, critic=critic_params, critic_opt=critic_opt,
                         kl=kl_state, rng=state.rng.next().next()), metrics
