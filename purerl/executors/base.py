"""The executor interface: what every executor gives the driver loops.

An executor owns the effects of a run: where the weights live, how gradients are taken, how the
rollout engine gets new weights. The driver loop sees only this interface, and the *same* step
function runs under every executor. A step function is called as::

    step_fn(state, rollout, scores, *, policy, value_and_grad) -> (state', metrics)

where the executor supplies ``policy`` (the model the stages compute with), ``value_and_grad``
(the gradient effect) and, when it has one, ``critic=``; bind everything else (optimizers, KL
controller, config) with ``functools.partial``. :func:`purerl.step.grpo_step` and
:func:`purerl.step.ppo_step` have this shape.
"""

from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from purerl.batch import Rewards, Rollout
from purerl.rewards import RewardFn, Scores
from purerl.rollout.engine import RolloutEngine
from purerl.state import TrainState

__all__ = ["Executor", "ExecutorError", "StepFn"]

StepFn = Callable[..., tuple[TrainState, dict[str, float]]]


class ExecutorError(RuntimeError):
    """A worker died, timed out or failed: the run cannot go on (the message names role and rank)."""


@runtime_checkable
class Executor(Protocol):
    engine: RolloutEngine
    """Generates for the driver; ``engine.sync(state.policy, version)`` publishes new weights."""

    def start(self, state: TrainState) -> TrainState:
        """Take ownership of ``state``; returns the state the driver holds from now on."""

    def step(self, state: TrainState, rollout: Rollout, scores: torch.Tensor | Rewards) -> tuple[TrainState, dict[str, float]]:
        """One step of the step function (donates ``state``)."""

    def publish(self, state: TrainState) -> Any:
        """The policy at ``state.step`` as weights a generator's engine can ``sync`` to while the
        trainer goes on updating (asynchronous training)."""

    def full_state(self, state: TrainState) -> TrainState:
        """The complete state, params and optimizer state included (for checkpoints and export)."""

    def score(self, fn: RewardFn, responses: Sequence[str], ground_truths: Sequence[str], *,
              timeout: float, penalty: float, data_sources: Sequence[str] | None = None,
              extra_infos: Sequence[dict] | None = None) -> Scores:
        """:func:`~purerl.rewards.score_responses`, wherever the executor runs reward functions."""

    def score_model(self, prompts: Sequence[str], responses: Sequence[str]) -> torch.Tensor:
        """The executor's reward model (:meth:`~purerl.rewards.model.RewardModel.score`) on each
        prompt + response: float32 ``[n]`` in order; a :class:`ValueError` when it has none."""

    def close(self) -> None:
        """Release workers and processes (idempotent)."""


