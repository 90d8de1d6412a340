"""Rewards: math answer checking (:mod:`~purerl.rewards.math`, pure) and scoring that survives
hung or failing reward functions (:mod:`~purerl.rewards.scoring`, the effect)."""

from purerl.rewards.math import (
    RewardFn,
    answers_equal,
    extract_answer,
    lenient_math_reward,
    math_reward,
    math_reward_with_format,
)
from purerl.rewards.scoring import Scores, score_in_threads, score_responses

__all__ = [
    "RewardFn",
    "Scores",
    "answers_equal",
    "extract_answer",
    "lenient_math_reward",
    "math_reward",
    "math_reward_with_format",
    "score_in_threads",
    "score_responses",
]
