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

What an executor computes with besides its engines comes as one record, :class:`Roles`, built by
the assembly (:func:`purerl.assembly.executor.make_executor`): the models of the run's roles and
the weight-sync check. A bare policy stands for the roles of a run with nothing else
(:meth:`Roles.of`), so a script's executor stays ``LocalExecutor(step_fn, policy, engine)``.
"""

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence, Set
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import attrs
import torch

from purerl.batch import Rewards, Rollout
from purerl.models import CausalLM, Critic
from purerl.rewards import RewardFn, Scores
from purerl.rewards.model import RewardModel
from purerl.rollout.canary import Canary
from purerl.rollout.engine import RolloutEngine
from purerl.rollout.queue import Weights
from purerl.state import TrainState
from purerl.step.roles import LocalTeacher

__all__ = ["EngineSlot", "Executor", "ExecutorError", "Roles"]


class ExecutorError(RuntimeError):
    """A worker died, timed out or failed: the run cannot go on (the message names role and rank)."""


@attrs.frozen(eq=False)
class Roles:
    """The models a run computes with and the checks on them: one record, built once by the
    assembly, that every executor takes. Models are skeletons: their params live in the state
    (a teacher's, frozen, in its role). Which executor places each where is its own business
    (the Ray executor shards them on the pools its placement names)."""

    policy: CausalLM
    """The policy's model; the step computes with it as ``policy=``."""
    critic: Critic | None = attrs.field(default=None, kw_only=True)
    """PPO's critic model, passed to the step as ``critic=`` (None: no critic)."""
    teacher: LocalTeacher | None = attrs.field(default=None, kw_only=True)
    """A distillation teacher (:func:`~purerl.assembly.models.load_teacher`), passed to the step as
    ``teacher=`` (None: no distillation)."""
    reward_model: str | Path | RewardModel | None = attrs.field(default=None, kw_only=True)
    """A local HF reward-model folder for :meth:`Executor.score_model`, loaded where the executor
    scores (the local executor: on first use, on its engine's device; it also takes a loaded
    :class:`~purerl.rewards.model.RewardModel`). None: ``score_model`` raises."""
    canary: Canary | None = attrs.field(default=None, kw_only=True)
    """The weight-sync check run after each load of a version into an asynchronous generator's
    engine (:mod:`purerl.rollout.canary`; None: unchecked). Every other sync is checked by the step
    itself, free (:attr:`~purerl.step.settings.ActorLoss.sync_tolerance`)."""

    @classmethod
    def of(cls, roles: "Roles | CausalLM") -> "Roles":
        """``roles`` itself, or a bare policy's: a run with no other role."""
        return roles if isinstance(roles, Roles) else cls(roles)


@runtime_checkable
class Executor(Protocol):
    broken: Set[int]
    """Asynchronous generators whose engines failed and wait for :meth:`restart_generator`
    (an evaluation takes another's engine); always empty where engines cannot fail apart."""

    def start(self, state: TrainState) -> TrainState:
        """Take ownership of ``state`` and publish its policy; returns the state the driver holds
        from now on. Each start begins a run: a second one, on the same workers, forgets the
        versions published before it."""

    def step(self, state: TrainState, rollout: Rollout, rewards: torch.Tensor | Rewards
             ) -> tuple[TrainState, dict[str, float]]:
        """One step of the step function (donates ``state``); the new state's policy is published."""

    def rebind(self, step_fn: Any) -> None:
        """Run ``step_fn`` from the next :meth:`step` on (the local executor's is a step function; the Ray
        executor's a :class:`~purerl.executors.ray.StepFactory`, which each training rank builds for itself).
        The workers, the state they hold and the versions published stay: a run whose settings change
        between its start and its first step (the start's choice) keeps the workers it started."""

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

    def worker_pids(self) -> dict[str, int]:
        """The process id of each worker process by its label (``{"train rank 0": pid, …}``), once
        started; empty for an executor that runs in this process."""

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
