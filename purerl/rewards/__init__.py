"""Rewards: math answer checking (:mod:`~purerl.rewards.math`, pure), scoring that survives
hung or failing reward functions of either form — ``fn(response, ground_truth)`` or verl's
``compute_score(data_source, solution_str, ground_truth, extra_info)`` — (:mod:`~purerl.rewards.scoring`,
the effect), loading a user's ``module:function`` (:mod:`~purerl.rewards.custom`), and a learned
reward model (:mod:`~purerl.rewards.model`, imported on first use: the reward processes import this
package and stay free of torch)."""

from typing import Any

from purerl.rewards.custom import BUILT_IN_REWARDS, load_reward_fn, reward_function
from purerl.rewards.math import (
    RewardFn,
    answers_equal,
    extract_answer,
    lenient_math_reward,
    math_reward,
    math_reward_with_format,
)
from purerl.rewards.scoring import Scores, reward_form, score_in_threads, score_responses

__all__ = [
    "BUILT_IN_REWARDS",
    "RewardFn",
    "RewardModel",
    "Scores",
    "answers_equal",
    "extract_answer",
    "lenient_math_reward",
    "load_reward_fn",
    "math_reward",
    "math_reward_with_format",
    "reward_form",
    "reward_function",
    "save_tiny_reward_model",
    "score_in_threads",
    "score_responses",
]


def __getattr__(name: str) -> Any:
    if name in ("RewardModel", "save_tiny_reward_model"):
        from purerl.rewards import model

        return getattr(model, name)
    raise AttributeError(f"module 'purerl.rewards' has no attribute {name!r}")
