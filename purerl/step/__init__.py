"""Stage functions and the composed steps.

Every stage is a function of explicit inputs that returns new values; it takes its own settings,
bound once (:mod:`.settings`), never the job's config::

    experience = make_experience(state, rollout, rewards, policy=..., settings=ExperienceSettings(...))
    batch, kl_state, m1 = shape_rewards(experience, state.kl, kl_controller, shaping=Shaping(estimator))
    critic, critic_opt, m2 = critic_update(..., loss=ValueLoss(...), batching=...)   # PPO only
    policy, policy_opt, m3 = actor_update(..., loss=ActorLoss(policy_loss), batching=Batching(...))

:func:`grpo_step` and :func:`ppo_step` compose them (:mod:`.recipes`); a user script composes its
own from the same stages (README: your own step function). :mod:`purerl.assembly` binds them from
a job's config.
"""

from purerl.step.experience import Experience, make_experience
from purerl.step.recipes import StepFn, grpo_step, ppo_step
from purerl.step.roles import LocalTeacher
from purerl.step.settings import (
    ActorLoss,
    Batching,
    DistillAdvantage,
    DistillLoss,
    ExperienceSettings,
    Shaping,
    ValueLoss,
)
from purerl.step.sft import sft_step
from purerl.step.shaping import Metrics, TrainBatch, shape_rewards, token_level_scores
from purerl.step.update import actor_update, critic_update

__all__ = ["ActorLoss", "Batching", "DistillAdvantage", "DistillLoss", "Experience", "ExperienceSettings",
           "LocalTeacher", "Metrics", "Shaping", "StepFn", "TrainBatch", "ValueLoss", "actor_update", "critic_update",
           "grpo_step", "make_experience", "ppo_step", "sft_step", "shape_rewards", "token_level_scores"]
