"""Stage functions and the composed steps.

Every stage is a function of explicit inputs that returns new values; each reads the sections of
the job's config it needs (:class:`~purerl.config.job.JobConfig`)::

    experience = make_experience(state, rollout, rewards, policy=..., config=...)    # old/ref log-probs, values
    batch, kl_state, m1 = shape_rewards(experience, state.kl, kl_controller, config=...)  # KL penalty, advantages
    critic, critic_opt, m2 = critic_update(...)                                     # PPO only
    policy, policy_opt, m3 = actor_update(...)

:func:`grpo_step` and :func:`ppo_step` compose them (:mod:`.recipes`); a user script composes its
own from the same stages (README: your own step function).
"""

from purerl.step.experience import Experience, make_experience
from purerl.step.recipes import StepFn, grpo_step, ppo_step, step_function
from purerl.step.shaping import Metrics, TrainBatch, shape_rewards, token_level_scores
from purerl.step.update import actor_update, critic_update

__all__ = ["Experience", "Metrics", "StepFn", "TrainBatch", "actor_update", "critic_update", "grpo_step",
           "make_experience", "ppo_step", "shape_rewards", "step_function", "token_level_scores"]
