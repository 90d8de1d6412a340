"""The executor interface: what every executor gives the driver loops.

An executor owns the effects of a run: where the weights live, how gradients are taken, which
engines generate and how they get new weights. The loops see only this interface, and the *same*
step function runs under every executor. A step function is called as::

    step_fn(state, rollout, rewards, *, policy, value_and_grad[, critic]) -> (state', metrics)

where the executor supplies ``policy`` (the model the stages compute with), ``value_and_grad``
(the gradient effect) and, when it has one, ``critic``; everything else is bound when the run is
assembled (:func:`purerl.assembly.stages.step_function`).

Weights have one path, owned by the executor: it *publishes* the policy of each state it starts
or steps as a numbered version (:meth:`Executor.publish`), a loop asks for the newest version at
or past the one it needs (:meth:`Executor.newest`) and for an engine holding it
(:meth:`Executor.engine`); it never passes params to an engine itself.
"""

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol, runtime_checkable

import torch

from purerl.batch import Rewards, Rollout
from purerl.rewards import RewardFn, Scores
from purerl.rollout.engine import RolloutEngine
from purerl.rollout.queue import Weights
from purerl.state import TrainState

__all__ = ["EngineSlot", "Executor", "ExecutorError"]


class ExecutorError(RuntimeError):
    """A worker died, timed out or failed: the run cannot go on (the message names role and rank)."""


@runtime_checkable
class Executor(Protocol):
    def start(self, state: TrainState) -> TrainState:
        """Take ownership of ``state`` and publish its policy; returns the state the driver holds
        from now on. Each start begins a run: a second one, on the same workers, forgets the
        versions published before it."""

    def step(self, state: TrainState, rollout: Rollout, rewards: torch.Tensor | Rewards
             ) -> tuple[TrainState, dict[str, float]]:
        """One step of the step function (donates ``state``); the new state's policy is published."""

    def publish(self, state: TrainState) -> None:
        """Make the policy of ``state`` the newest version, ``state.step``, for the engines to load
        while the trainer goes on updating."""

    def newest(self, at_least: int = 0, stop: threading.Event | None = None) -> Weights | None:
        """The newest published version once it is ``≥ at_least`` (blocks until then; None if
        ``stop`` is set first)."""

    def engine(self, weights: Weights, purpose: str = "generate",
               generator: int = 0) -> contextlib.AbstractContextManager[RolloutEngine]:
        """Exclusive use of the engine for ``purpose`` (``generate``: training rollouts, on
        asynchronous generator ``generator``'s own engine; ``evaluate``: held-out answers),
        holding ``weights`` (loaded if it holds another version)."""

    def reload(self, weights: Weights, generator: int = 0) -> None:
        """Inside :meth:`engine` (its holder only): load newer ``weights`` into generator
        ``generator``'s engine (an interrupted rollout continues on them)."""

    def restart_generator(self, generator: int) -> None:
        """Make generator ``generator``'s engine usable again after a failure (the Ray executor
        starts its rollout workers anew); raises :class:`ExecutorError` when it cannot."""

    def full_state(self, state: TrainState) -> TrainState:
        """The complete state, params and optimizer state included (for checkpoints and export)."""

    def score(self, fn: RewardFn, responses: Sequence[str], ground_truths: Sequence[str], *,
              timeout: float, penalty: float, data_sources: Sequence[str] | None = None,
              extra_infos: Sequence[dict] | None = None, batch_timeout: float | None = None) -> Scores:
        """:func:`~purerl.rewards.score_responses`, wherever the executor runs reward functions."""

    def score_model(self, prompts: Sequence[str], responses: Sequence[str]) -> torch.Tensor:
        """The executor's reward model (:meth:`~purerl.rewards.model.RewardModel.score`) on each
        prompt + response: float32 ``[n]`` in order; a :class:`ValueError` when it has none."""

    def close(self) -> None:
        """Release workers and processes (idempotent)."""


class EngineSlot:
    """An engine and the lock that gives one user at a time (a generator thread, an evaluation)
    its use; ``load(engine, weights)`` makes the engine hold a version it does not hold yet."""

    def __init__(self, engine: RolloutEngine, load: Callable[[RolloutEngine, Weights], None]) -> None:
        self.engine, self._load, self._lock = engine, load, threading.Lock()

    def restart(self, start: Callable[[RolloutEngine], None]) -> None:
        """``start(engine)`` makes the engine usable again, between two uses; it then holds no version."""
        with self._lock:
            start(self.engine)
            self.engine.version = None

    def load_held(self, weights: Weights) -> None:
        """Load ``weights`` into the engine; only for the thread inside :meth:`use`."""
        self._load(self.engine, weights)

    @contextlib.contextmanager
    def use(self, weights: Weights) -> Iterator[RolloutEngine]:
        with self._lock:
            if self.engine.version != weights.version:
                self._load(self.engine, weights)
            yield self.engine
