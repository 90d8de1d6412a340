"""Composed steps: GRPO-style (no critic) and PPO (a critic, GAE), and the step function a job's
config selects.

A step function is ``step(state, rollout, rewards, *, policy, value_and_grad[, critic]) ->
(state', metrics)``: the executor supplies ``policy``, ``value_and_grad`` and, with a critic,
``critic``; everything else (the config, optimizers, KL controller) is bound with
``functools.partial`` when the run is assembled (:func:`step_function`).
"""

import functools
from collections.abc import Callable
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from purerl.algo.kl_control import make_kl_controller
from purerl.algo.masked import masked_mean
from purerl.batch import FINISH_LENGTH, Rewards, Rollout
from purerl.config.job import JobConfig
from purerl.models import CausalLM, Critic
from purerl.models import value_and_grad as pure_value_and_grad
from purerl.optim import Optimizer, adamw, chain, clip_by_global_norm, warmup_cosine_schedule
from purerl.state import TrainState
from purerl.step.experience import Experience, make_experience
from purerl.step.roles import CriticRole, ReferenceRole, critic_role
from purerl.step.shaping import Metrics, shape_rewards
from purerl.step.update import ValueAndGrad, actor_update

__all__ = ["StepFn", "actor_optimizer", "critic_optimizer", "grpo_step", "kl_controller_of", "ppo_step", "step_function"]

StepFn = Callable[..., tuple[TrainState, Metrics]]


def _rollout_metrics(rollout: Rollout, experience: Experience) -> Metrics:
    mask = rollout.sequences.response_mask
    lengths = mask.sum(-1).float()
    gap = (experience.behaviour_logprobs - experience.old_logprobs).abs()
    finite = experience.behaviour_logprobs.isfinite() & experience.old_logprobs.isfinite()
    return {
        "response_length/mean": float(lengths.mean()),
        "response_length/max": float(lengths.max()),
        "response_length/clip_ratio": float((rollout.finish_reasons == FINISH_LENGTH).float().mean()),
        "rollout/logprob_gap_max": float(torch.where(mask, gap, 0.0).max()),
        "rollout/logprob_gap_mean": float(masked_mean(gap, mask)),
        # the weights this step started from: the driver stops on any (StepRecorder)
        "rollout/nonfinite_logprobs": float((mask & ~finite).sum()),
    }


def grpo_step(state: TrainState, rollout: Rollout, rewards: Float[Tensor, " b"] | Rewards, *, policy: CausalLM,
              config: JobConfig, optimizer: Any, kl_controller: Any, value_and_grad: ValueAndGrad = pure_value_and_grad,
              reference: ReferenceRole | None = None) -> tuple[TrainState, Metrics]:
    """One critic-free step on a scored rollout: experience, advantages, actor update.
    ``reference``: where the reference log-probs come from when the reference lives on a pool of
    its own (the executor's role); without it, from ``state.reference`` here."""
    experience = make_experience(state, rollout, rewards, policy=policy, config=config, reference=reference)
    batch, kl_state, metrics = shape_rewards(experience, state.kl, kl_controller, config=config)
    params, opt_state, actor_metrics = actor_update(state.policy, state.policy_opt, batch, policy=policy,
                                                    optimizer=optimizer, config=config, rng=state.rng,
                                                    value_and_grad=value_and_grad)
    metrics.update(actor_metrics)
    metrics.update(_rollout_metrics(rollout, experience))
    return state.advance(policy=params, policy_opt=opt_state, kl=kl_state, rng=state.rng.next()), metrics


def ppo_step(state: TrainState, rollout: Rollout, rewards: Float[Tensor, " b"] | Rewards, *, policy: CausalLM,
             critic: Critic | CriticRole, config: JobConfig, optimizer: Any, critic_optimizer: Any, kl_controller: Any,
             value_and_grad: ValueAndGrad = pure_value_and_grad,
             reference: ReferenceRole | None = None) -> tuple[TrainState, Metrics]:
    """One PPO step: experience with values, advantages, critic update, then actor update. During
    the first ``trainer.critic_warmup`` steps (``state.step < critic_warmup``) only the critic
    trains (verl's ``trainer.critic_warmup``): the policy and its optimizer state come back unchanged.

    ``critic``: a :class:`~purerl.models.Critic` (its stages computed here with ``state.critic``,
    gradients by ``value_and_grad``) or a critic role (:mod:`purerl.step.roles`: an executor's, for a
    critic on a pool of its own); ``reference`` as in :func:`grpo_step`."""
    critic = critic_role(critic, value_and_grad)
    experience = make_experience(state, rollout, rewards, policy=policy, config=config, critic=critic,
                                 reference=reference)
    batch, kl_state, metrics = shape_rewards(experience, state.kl, kl_controller, config=config)
    critic_params, critic_opt, critic_metrics = critic.update(state.critic, state.critic_opt, batch,
                                                              optimizer=critic_optimizer, config=config, rng=state.rng)
    if state.step < config.trainer.critic_warmup:
        params, opt_state, actor_metrics = state.policy, state.policy_opt, {"actor/critic_warmup": 1.0}
    else:
        params, opt_state, actor_metrics = actor_update(state.policy, state.policy_opt, batch, policy=policy,
                                                        optimizer=optimizer, config=config, rng=state.rng.next(),
                                                        value_and_grad=value_and_grad)
    metrics.update(critic_metrics)
    metrics.update(actor_metrics)
    metrics.update(_rollout_metrics(rollout, experience))
    metrics["critic/values/mean"] = float(masked_mean(experience.values, experience.sequences.response_mask))
    return state.advance(policy=params, policy_opt=opt_state, critic=critic_params, critic_opt=critic_opt,
                         kl=kl_state, rng=state.rng.next().next()), metrics


def _optimizer(lr: float, warmup: int, config: JobConfig, grad_clip: float) -> Optimizer:
    steps = config.trainer.steps
    schedule = warmup_cosine_schedule(lr, min(warmup, steps - 1), steps, final_lr=lr * config.actor.min_lr_ratio)
    return chain(clip_by_global_norm(grad_clip), adamw(schedule, weight_decay=config.actor.weight_decay))


def actor_optimizer(config: JobConfig) -> Optimizer:
    """Global-norm clipping (``actor.grad_clip``) and AdamW with a warm-up cosine schedule."""
    actor = config.actor
    return _optimizer(actor.lr, actor.warmup_steps, config, actor.grad_clip)


def critic_optimizer(config: JobConfig) -> Optimizer:
    """The critic's: its own learning rate, warm-up and clipping, the actor's decay and floor."""
    critic = config.critic
    return _optimizer(critic.lr, critic.warmup_steps, config, critic.grad_clip)


def kl_controller_of(config: JobConfig) -> Any:
    """The controller of the KL penalty in the reward (coefficient 0 when there is none)."""
    algorithm = config.algorithm
    ctrl = algorithm.kl_ctrl
    return make_kl_controller(ctrl.type, coef=ctrl.kl_coef if algorithm.use_kl_in_reward else 0.0,
                              target_kl=ctrl.target_kl, horizon=ctrl.horizon)


def step_function(config: JobConfig) -> StepFn:
    """The step the config selects: PPO with a critic when the estimator reads values, else the
    critic-free step; the config, optimizers and KL controller bound. A picklable way to build it
    anywhere (a Ray rank): ``functools.partial(step_function, config)``."""
    common = dict(config=config, optimizer=actor_optimizer(config), kl_controller=kl_controller_of(config))
    if config.algorithm.estimator.needs_values:
        return functools.partial(ppo_step, critic_optimizer=critic_optimizer(config), **common)
    return functools.partial(grpo_step, **common)
