"""A job's config as the bound settings of its stages: each function returns one piece, read from
the sections that own its settings, on the resolved config (:func:`purerl.config.rules.resolve`,
so derived values such as the critic's token budget are decided in one place).

The ``actor`` section is a :class:`~purerl.algo.loss_settings.PolicyLossSettings` and ``algorithm`` an
:class:`~purerl.algo.estimators.AdvantageSettings`: the loss and the estimator are bound to them as they
are. A script that builds a step by hand binds them to records of its own::

    loss = ActorLoss(POLICY_LOSSES["cispo"].bound(PolicyLossSettings(clip_low=1.0)), entropy_coeff=1e-3)
    shaping = Shaping(ADVANTAGE_ESTIMATORS["rloo"].bound())
"""

import functools
from typing import Any

import attrs

from purerl.algo.kl_control import make_kl_controller
from purerl.config.job import JobConfig
from purerl.config.rules import resolve
from purerl.health import Context, Monitor
from purerl.loop.sampling import BatchPlan
from purerl.optim import Optimizer, Schedule, adamw, chain, clip_by_global_norm, warmup_cosine_schedule
from purerl.rollout.engines import ENGINES, LOW_PRECISION_SYNC_TOLERANCE
from purerl.step.recipes import StepFn, grpo_step, ppo_step
from purerl.step.settings import (
    ActorLoss,
    Batching,
    DistillAdvantage,
    DistillLoss,
    ExperienceSettings,
    Shaping,
    ValueLoss,
)

__all__ = ["actor_batching_of", "actor_loss_of", "actor_optimizer", "batch_plan_of", "health_monitor_of",
           "critic_batching_of", "critic_optimizer", "experience_settings_of", "kl_controller_of",
           "learning_rate_schedule", "shaping_of", "stage_settings_of", "step_function", "updates_per_step",
           "value_loss_of"]


def actor_batching_of(config: JobConfig) -> Batching:
    actor = config.actor
    return Batching(actor.micro_batch_rows, actor.max_tokens_per_micro_batch, actor.mini_batch_rows, actor.ppo_epochs)


def critic_batching_of(config: JobConfig) -> Batching:
    """The actor's epochs, mini- and micro-batches of rows, the critic's own token budget."""
    return attrs.evolve(actor_batching_of(config), max_tokens=resolve(config).critic.max_tokens_per_micro_batch)


def experience_settings_of(config: JobConfig) -> ExperienceSettings:
    resolved = resolve(config)
    return ExperienceSettings(batching=actor_batching_of(config),
                              critic_batching=critic_batching_of(config),
                              recompute_old_logprobs=resolved.actor.recompute_old_logprobs,
                              sum_pi_squared=config.algorithm.estimator.needs_sum_pi_squared,
                              teacher_top_k=config.distill.top_k if _distill_loss(config) else None)


def _distill_loss(config: JobConfig) -> DistillLoss | None:
    distill = config.distill
    return DistillLoss(distill.loss_coef, distill.beta) if distill.teacher and distill.loss_coef else None


def shaping_of(config: JobConfig) -> Shaping:
    algorithm, distill = resolve(config).algorithm, config.distill
    return Shaping(algorithm.estimator.bound(algorithm), algorithm.kl_penalty if algorithm.use_kl_in_reward else None,
                   algorithm.rollout_correction, algorithm.correction_cap,
                   DistillAdvantage(distill.coef, distill.gamma, distill.reward_coef) if distill.teacher else None)


def actor_loss_of(config: JobConfig) -> ActorLoss:
    actor = config.actor
    return ActorLoss(actor.loss.bound(actor), entropy_coeff=actor.entropy_coeff, compute_entropy=actor.compute_entropy,
                     kl_coef=actor.kl_loss_coef, kl_type=actor.kl_loss_type,
                     skip_zero_advantage_rows=actor.skip_zero_advantage_rows, distill=_distill_loss(config),
                     sync_tolerance=sync_tolerance_of(config))


def sync_tolerance_of(config: JobConfig) -> float | None:
    """``executor.sync_canary``'s tolerance (nats per token; None: off): in float32 the engine's own
    (:attr:`~purerl.rollout.engines.EngineKind.sync_tolerance`), in lower precision
    :data:`~purerl.rollout.engines.LOW_PRECISION_SYNC_TOLERANCE`; a corrupted tensor moves the
    log-probs by far more."""
    if not config.executor.sync_canary:
        return None
    if config.model.dtype != "float32":
        return LOW_PRECISION_SYNC_TOLERANCE
    return ENGINES[config.rollout.engine].sync_tolerance


def value_loss_of(config: JobConfig) -> ValueLoss:
    """The critic's clip; the actor's aggregation."""
    return ValueLoss(config.critic.value_clip, config.actor.loss_agg, config.actor.loss_norm)


def updates_per_step(config: JobConfig) -> int:
    """Optimizer updates in one trainer step: ``actor.ppo_epochs`` passes over the step's
    ``data.prompts_per_step × rollout.n`` rows in mini-batches of ``actor.mini_batch_rows``. A batch
    of another size (episodes that end early, say) makes as many updates as its rows take."""
    rows = config.data.prompts_per_step * config.rollout.n
    mini = config.actor.mini_batch_rows
    return config.actor.ppo_epochs * (1 if mini is None else -(-rows // min(mini, rows)))


def learning_rate_schedule(lr: float, warmup: int, config: JobConfig) -> Schedule:
    """Warm-up and cosine over the run's ``trainer.steps``, down to ``lr × actor.min_lr_ratio``, as a
    function of the optimizer's update count: ``warmup`` and the length are trainer steps scaled by
    :func:`updates_per_step`, so mini-batches and epochs do not end the schedule early (verl steps its
    scheduler once per trainer step; this matches it while each step makes the same number of updates)."""
    steps, per_step = config.trainer.steps, updates_per_step(config)
    return warmup_cosine_schedule(lr, min(warmup, steps - 1) * per_step, steps * per_step,
                                  final_lr=lr * config.actor.min_lr_ratio)


def _optimizer(lr: float, warmup: int, config: JobConfig, grad_clip: float) -> Optimizer:
    schedule = learning_rate_schedule(lr, warmup, config)
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


def stage_settings_of(config: JobConfig) -> dict[str, Any]:
    """The settings :func:`~purerl.step.recipes.grpo_step` takes (``experience``, ``shaping``,
    ``loss``, ``batching``) and, when the estimator reads values, those :func:`~purerl.step.recipes.ppo_step`
    adds (``critic_loss``, ``critic_batching``, ``critic_warmup``); optimizers and KL controller apart."""
    settings: dict[str, Any] = dict(experience=experience_settings_of(config), shaping=shaping_of(config),
                                    loss=actor_loss_of(config), batching=actor_batching_of(config))
    if config.algorithm.estimator.needs_values:
        settings.update(critic_loss=value_loss_of(config), critic_batching=critic_batching_of(config),
                        critic_warmup=config.trainer.critic_warmup)
    return settings


def step_function(config: JobConfig) -> StepFn:
    """The step the config selects: PPO with a critic when the estimator reads values, else the
    critic-free step; every stage's settings, the optimizers and the KL controller bound. A
    picklable way to build it anywhere (a Ray rank): ``functools.partial(step_function, config)``."""
    common = dict(stage_settings_of(config), optimizer=actor_optimizer(config), kl_controller=kl_controller_of(config))
    if config.algorithm.estimator.needs_values:
        return functools.partial(ppo_step, critic_optimizer=critic_optimizer(config), **common)
    return functools.partial(grpo_step, **common)


def batch_plan_of(config: JobConfig) -> BatchPlan:
    """How the loops sample and score a step's batch."""
    algorithm, trainer = config.algorithm, config.trainer
    return BatchPlan(config.rollout, config.data.prompts_per_step, config.reward,
                     greedy_baselines=algorithm.estimator.needs_baselines, dynamic_sampling=algorithm.dynamic_sampling,
                     max_sampling_rounds=algorithm.max_sampling_rounds, samples_per_step=trainer.samples_per_step,
                     sample_chars=trainer.sample_chars)


def health_monitor_of(config: JobConfig, samples: str) -> Monitor:
    """The run-health monitor bound to the ``health`` section (a :class:`~purerl.health.HealthLimits`) and to what
    its lines name: the response budget, the policy's gradient clip and the run's ``samples`` file."""
    return Monitor(config.health, Context(config.rollout.max_new_tokens, config.actor.grad_clip, samples))
