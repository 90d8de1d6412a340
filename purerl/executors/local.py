"""The in-process executor: the state holds the params, gradients are the pure ``value_and_grad``."""

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from purerl.batch import Rewards, Rollout
from purerl.executors.base import StepFn
from purerl.models import CausalLM, Critic
from purerl.models import value_and_grad as pure_value_and_grad
from purerl.rewards import RewardFn, Scores, score_responses
from purerl.rewards.model import RewardModel
from purerl.rollout.engine import RolloutEngine
from purerl.state import TrainState
from purerl.tree import tree_clone

__all__ = ["LocalExecutor"]


class LocalExecutor:
    """Everything in this process: the state holds the params, gradients are the pure
    ``value_and_grad``, and the engine shares the trainer's params (sync is a no-op copy-free tag).

    ``reward_model``: a local HF reward-model folder (or a loaded
    :class:`~purerl.rewards.model.RewardModel`) for :meth:`score_model`, loaded on first use in this
    process on ``reward_model_device`` (default: the engine's device, else the CPU)."""

    def __init__(self, step_fn: StepFn, policy: CausalLM, engine: RolloutEngine, *, critic: Critic | None = None,
                 value_and_grad: Callable = pure_value_and_grad, reward_model: str | Path | RewardModel | None = None,
                 reward_model_device: str | None = None, reward_batch_size: int = 16) -> None:
        self.step_fn, self.policy, self.engine, self.value_and_grad = step_fn, policy, engine, value_and_grad
        self.reward_model, self.reward_batch_size = reward_model, reward_batch_size
        self.reward_model_device = reward_model_device
        self.effects = {"policy": policy, "value_and_grad": value_and_grad}
        if critic is not None:
            self.effects["critic"] = critic

    def start(self, state: TrainState) -> TrainState:
        return state

    def step(self, state: TrainState, rollout: Rollout, scores: torch.Tensor | Rewards) -> tuple[TrainState, dict[str, float]]:
        return self.step_fn(state, rollout, scores, **self.effects)

    def publish(self, state: TrainState) -> dict[str, torch.Tensor]:
        """A copy of the policy params: the trainer's own are replaced, not updated in place, but a
        copy keeps the published version independent of what any step function does."""
        return tree_clone(state.policy)

    def full_state(self, state: TrainState) -> TrainState:
        return state

    def score(self, fn: RewardFn, responses: Sequence[str], ground_truths: Sequence[str], *,
              timeout: float, penalty: float, data_sources: Sequence[str] | None = None,
              extra_infos: Sequence[dict] | None = None) -> Scores:
        return score_responses(fn, responses, ground_truths, timeout=timeout, penalty=penalty,
                               data_sources=data_sources, extra_infos=extra_infos)

    def score_model(self, prompts: Sequence[str], responses: Sequence[str]) -> torch.Tensor:
        if self.reward_model is None:
            raise ValueError("LocalExecutor.score_model: no reward model (give LocalExecutor(reward_model=path))")
        if isinstance(self.reward_model, (str, Path)):
            device = self.reward_model_device or str(getattr(self.engine, "device", "cpu"))
            self.reward_model = RewardModel(self.reward_model, device=device)
        return self.reward_model.score(prompts, responses, batch_size=self.reward_batch_size)

    def close(self) -> None:
        self.engine.close()

    def __enter__(self) -> "LocalExecutor":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
