"""A response's reward from its parts: ``fn_weight·rule + model_weight·model +
judge_weight·judge + overlong``, where ``rule`` is the task's reward function, ``model`` a
learned reward model's score (when ``reward.model`` is set and ``model_weight`` ≠ 0), ``judge``
an LLM judge's verdict in [0, 1] (when ``reward.judge`` is set: :mod:`purerl.rewards.judge`) and
``overlong`` DAPO's length penalty (when ``reward.overlong_buffer`` > 0;
:func:`~purerl.algo.dapo.overlong_penalty`)."""

import torch
from jaxtyping import Float, Int
from torch import Tensor

from purerl.algo.dapo import overlong_penalty
from purerl.batch import Rewards
from purerl.rewards.mix_settings import RewardMix

__all__ = ["RewardMix", "mixed_rewards", "uses_reward_model"]


def uses_reward_model(reward: RewardMix) -> bool:
    """Whether the reward model's score enters the reward."""
    return reward.model is not None and reward.model_weight != 0


def mixed_rewards(rule: Float[Tensor, " b"], lengths: Int[Tensor, " b"], learned: Float[Tensor, " b"] | None, *,
                  reward: RewardMix, max_new_tokens: int,
                  judged: Float[Tensor, " b"] | None = None) -> tuple[Rewards, dict[str, float]]:
    """The rewards of ``b`` responses from their ``rule`` scores, response ``lengths``, reward-model
    scores (``learned``, when the model is used) and judge verdicts (``judged``), and the sums of
    the parts (``overlong_penalty``, ``model``, ``judge``) for metrics. GDPO's components
    (:class:`~purerl.batch.Rewards`) are the rule reward (with the overlong penalty) and the
    model's score, when there are two."""
    sums: dict[str, float] = {}
    total, columns = reward.fn_weight * rule, [rule]
    if reward.overlong_buffer:
        penalty = overlong_penalty(lengths, max_new_tokens, reward.overlong_buffer, reward.overlong_penalty)
        sums["overlong_penalty"] = float(penalty.sum())
        total, columns = total + penalty, [rule + penalty]
    if learned is not None:
        sums["model"] = float(learned.sum())
        columns.append(learned)
        total = total + reward.model_weight * learned
    if judged is not None:
        sums["judge"] = float(judged.sum())
        columns.append(judged)
        total = total + reward.judge_weight * judged
    return Rewards(total, components=torch.stack(columns, 1) if len(columns) > 1 else None), sums
