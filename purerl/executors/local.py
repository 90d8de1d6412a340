"""The in-process executor: the state holds the params, gradients are the pure ``value_and_grad``."""

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from purerl.batch import Rewards, Rollout
from purerl.executors.base import EngineSlot, Roles
from purerl.models import CausalLM
from purerl.models import value_and_grad as pure_value_and_grad
from purerl.rewards import RewardFn, Scores, score_responses
from purerl.rewards.model import RewardModel
from purerl.rollout.canary import Canary
from purerl.rollout.engine import RolloutEngine, release
from purerl.rollout.queue import Published, Weights
from purerl.state import TrainState
from purerl.step.recipes import StepFn
from purerl.tree import tree_clone

__all__ = ["LocalExecutor"]


def _loader(canary: Canary | None) -> Callable[[RolloutEngine, Weights], None]:
    """Load a version into an engine, then (with a ``canary``) check that the engine computes with it."""

    def load(engine: RolloutEngine, weights: Weights) -> None:
        engine.sync(weights.payload, weights.version)
        if canary is not None:
            canary.check(engine, weights.payload, weights.version, type(engine).__name__)

    return load


class LocalExecutor:
    """Everything in this process: the state holds the params, gradients are ``value_and_grad``
    (the pure one), and ``engine`` shares the trainer's params (loading a version is a copy-free
    tag). ``roles`` (:class:`~purerl.executors.base.Roles`, or a bare policy) are computed here:
    the critic and the teacher are passed to the step, the reward model is loaded on first use.

    ``generator_engines``: engines of their own (other model copies), one per asynchronous
    generator; the published versions are then snapshots (one per version, shared by them), so the
    trainer can go on updating in place while they sample, and the roles' canary checks every load
    into them. Without them, ``engine`` does everything. ``engine``'s syncs are checked by the step
    itself, free (:attr:`~purerl.step.settings.ActorLoss.sync_tolerance`), and by the canary once per
    version it evaluates."""

    broken: frozenset[int] = frozenset()  # in-process engines keep nothing broken between calls

    def __init__(self, step_fn: StepFn, roles: Roles | CausalLM, engine: RolloutEngine,
                 generator_engines: Sequence[RolloutEngine] = (), value_and_grad: Callable = pure_value_and_grad
                 ) -> None:
        self.step_fn, self.roles = step_fn, Roles.of(roles)
        self.reward_model = self.roles.reward_model  # a folder until first use, then the loaded model
        self.effects = {"policy": self.roles.policy, "value_and_grad": value_and_grad}
        if self.roles.critic is not None:
            self.effects["critic"] = self.roles.critic
        if self.roles.teacher is not None:
            self.effects["teacher"] = self.roles.teacher
        canary = self.roles.canary
        # the evaluator's syncs are checked by the step (ActorLoss.sync_tolerance), its evaluations by _evaluator
        self.evaluator = EngineSlot(engine, _loader(None))
        self.generators = [EngineSlot(e, _loader(canary)) for e in generator_engines] or [self.evaluator]
        self._canary, self._evaluated_version = canary, None
        self._published = Published()

    def start(self, state: TrainState) -> TrainState:
        """Publish ``state``'s policy as the first version of a run: a second start begins another
        (the versions published before are forgotten; every engine loads the new run's weights)."""
        self._published, self._evaluated_version = Published(), None
        for slot in {id(s): s for s in (self.evaluator, *self.generators)}.values():
            slot.restart(lambda engine: None)  # nothing to restart: it only holds no version now
        self.publish(state)
        return state

    def step(self, state: TrainState, rollout: Rollout, rewards: torch.Tensor | Rewards
             ) -> tuple[TrainState, dict[str, float]]:
        if self.generators[0] is self.evaluator:  # its engine's copy of these params is stale once they update
            self.evaluator.restart(release)
        state, metrics = self.step_fn(state, rollout, rewards, **self.effects)
        self.publish(state)
        return state, metrics

    def rebind(self, step_fn: StepFn) -> None:
        self.step_fn = step_fn

    def publish(self, state: TrainState) -> None:
        """The policy as version ``state.step``: the params themselves, or (with a generator engine
        of its own) a copy, independent of what any later step does to the trainer's."""
        separate = self.generators[0] is not self.evaluator
        self._published.publish(Weights(state.step, tree_clone(state.policy) if separate else state.policy))

    def newest(self, at_least: int = 0, stop: threading.Event | None = None) -> Weights | None:
        return self._published.newest(at_least, stop)

    def engine(self, weights: Weights, purpose: str = "generate",
               generator: int = 0) -> contextlib.AbstractContextManager[RolloutEngine]:
        if purpose != "generate":
            return self._evaluator(weights)
        if not 0 <= generator < len(self.generators):
            raise ValueError(f"LocalExecutor: generator {generator}, but it has {len(self.generators)} generator "
                             "engine(s) (generator_engines)")
        return self.generators[generator].use(weights)

    @contextlib.contextmanager
    def _evaluator(self, weights: Weights) -> Iterator[RolloutEngine]:
        """The evaluation engine holding ``weights``, canary-checked once per version (an evaluation
        reads a version no step may sample: the last one, or one an asynchronous generator skipped)."""
        with self.evaluator.use(weights) as engine:
            if self._canary is not None and self._evaluated_version != weights.version:
                self._canary.check(engine, weights.payload, weights.version, type(engine).__name__)
                self._evaluated_version = weights.version
            yield engine

    def reload(self, weights: Weights, generator: int = 0) -> None:
        self.generators[generator].load_held(weights)

    def restart_generator(self, generator: int) -> None:
        """In-process engines keep nothing broken between calls: the generator reuses its engine."""

    def full_state(self, state: TrainState) -> TrainState:
        return state

    def score(self, fn: RewardFn, responses: Sequence[str], ground_truths: Sequence[str], *,
              timeout: float, penalty: float, data_sources: Sequence[str] | None = None,
              extra_infos: Sequence[dict] | None = None, batch_timeout: float | None = None) -> Scores:
        return score_responses(fn, responses, ground_truths, timeout=timeout, penalty=penalty,
                               data_sources=data_sources, extra_infos=extra_infos, batch_timeout=batch_timeout)

    def score_model(self, prompts: Sequence[str], responses: Sequence[str]) -> torch.Tensor:
        if self.reward_model is None:
            raise ValueError("LocalExecutor.score_model: no reward model (give Roles(policy, reward_model=path))")
        if isinstance(self.reward_model, (str, Path)):
            self.reward_model = RewardModel(self.reward_model, device=str(getattr(self.evaluator.engine, "device",
                                                                                  "cpu")))
        return self.reward_model.score(prompts, responses)

    def worker_pids(self) -> dict[str, int]:
        return {}

    def close(self) -> None:
        for slot in {id(s): s for s in [*self.generators, self.evaluator]}.values():
            slot.engine.close()

    def __enter__(self) -> "LocalExecutor":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
