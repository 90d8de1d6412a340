"""The Ray executor's reward actors: the reward model on whichever worker hosts it, the reward
worker (reward functions and the reward model), and a reward function shipped to them with the
driver's ``sys.path``. Plain classes made remote by the executor (``ray.remote(cls)``)."""

import os
import sys
from typing import Any

import numpy as np
import torch

from purerl.rewards import RewardFn, Scores, score_responses
from purerl.rewards.model import RewardModel

__all__ = ["RewardModelHost", "RewardWorker", "ShippedRewardFn"]


class RewardModelHost:
    """The reward model on a worker that hosts it (a reward worker, or a rank whose pool the
    placement gives it): loaded once, by :meth:`load_reward_model`."""

    reward_model_path: str | None = None
    reward_model: RewardModel | None = None
    reward_device: str = "cpu"
    reward_batch_size: int = 16

    def load_reward_model(self) -> None:
        """Load the reward model (once; a no-op after)."""
        if self.reward_model is None:
            if self.reward_model_path is None:
                raise ValueError("this worker was given no reward model (Roles(policy, reward_model=...))")
            self.reward_model = RewardModel(self.reward_model_path, device=self.reward_device)

    def score_model(self, prompts: list[str], responses: list[str]) -> np.ndarray:
        """:meth:`RewardModel.score` of this shard, as float32 numpy."""
        self.load_reward_model()
        return self.reward_model.score(prompts, responses, batch_size=self.reward_batch_size).numpy()


class RewardWorker(RewardModelHost):
    """A reward worker: scores one shard of the responses with a reward function and, given a
    reward-model folder, with that model (loaded once, by :meth:`load_reward_model`)."""

    def __init__(self, reward_model: str | None = None, device: str = "cpu", threads: int = 1,
                 batch_size: int = 16) -> None:
        torch.set_num_threads(threads)
        self.reward_model_path, self.reward_device, self.reward_batch_size = reward_model, device, batch_size

    def pid(self) -> int:
        return os.getpid()

    def score(self, fn: RewardFn, responses: list[str], truths: list[str], timeout: float, penalty: float,
              first_index: int, data_sources: list[str] | None = None, extra_infos: list[dict] | None = None,
              batch_timeout: float | None = None) -> Scores:
        return score_responses(fn, responses, truths, timeout=timeout, penalty=penalty, first_index=first_index,
                               data_sources=data_sources, extra_infos=extra_infos, batch_timeout=batch_timeout)

class ShippedRewardFn:
    """A reward function on its way to the reward workers with the driver's ``sys.path``:
    unpickling adds the paths first, then loads the function, so a function that
    :func:`~purerl.rewards.load_reward_fn` loaded from a file (a module importable only from its
    folder) imports on the worker. Unpickles as the function itself."""

    def __init__(self, fn: RewardFn) -> None:
        self.fn, self.paths = fn, [p for p in sys.path if p]

    def __reduce__(self) -> tuple[Any, ...]:
        from ray import cloudpickle

        return _unship, (self.paths, cloudpickle.dumps(self.fn))


def _unship(paths: list[str], blob: bytes) -> Any:
    from ray import cloudpickle

    sys.path.extend(p for p in paths if p not in sys.path)
    return cloudpickle.loads(blob)
