"""The in-process executor: the state holds the params, gradients are the pure ``value_and_grad``."""

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from purerl.batch import Rewards, Rollout
from purerl.executors.base import EngineSlot
from purerl.models import CausalLM, Critic
from purerl.models import value_and_grad as pure_value_and_grad
from purerl.rewards import RewardFn, Scores, score_responses
from purerl.rewards.model import RewardModel
from purerl.rollout.canary import Canary
from purerl.rollout.engine import RolloutEngine
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
    """Everything in this process: the state holds the params, gradients are the pure
    ``value_and_grad``, and ``engine`` shares the trainer's params (loading a version is a
    copy-free tag).

    ``generator_engines``: engines of their own (other model copies), one per asynchronous
    generator; the published versions are then snapshots (one per version, shared by them), so the
    trainer can go on updating in place while they sample. Without them, ``engine`` does
    everything. ``reward_model``: a local HF reward-model
    folder (or a loaded :class:`~purerl.rewards.model.RewardModel`) for :meth:`score_model`,
    loaded on first use in this process on ``reward_model_device`` (default: the engine's device,
    else the CPU). ``teacher``: a distillation teacher's role (:mod:`purerl.step.roles`), passed to
    the step. ``canary``: the weight-sync check run after every load of a version into a generator
    engine (:mod:`purerl.rollout.canary`; None: unchecked); ``engine``'s syncs are checked by the step
    itself, free (:attr:`~purerl.step.settings.ActorLoss.sync_tolerance`), and by the canary once per
    version it evaluates."""

    def __init__(self, step_fn: StepFn, policy: CausalLM, engine: RolloutEngine, *,
                 generator_engines: Sequence[RolloutEngine] = (), critic: Critic | None = None,
                 value_and_grad: Callable = pure_value_and_grad, reward_model: str | Path | RewardModel | None = None,
                 reward_model_device: str | None = None, reward_batch_size: int = 16, teacher: Any = None,
                 canary: Canary | None = None) -> None:
        self.step_fn, self.policy, self.value_and_grad = step_fn, policy, value_and_grad
        self.reward_model, self.reward_batch_size = reward_model, reward_batch_size
        self.reward_model_device = reward_model_device
        self.effects = {"policy": policy, "value_and_grad": value_and_grad}
        if critic is not None:
            self.effects["critic"] = critic
        if teacher is not None:
            self.effects["teacher"] = teacher
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
        state, metrics = self.step_fn(state, rollout, rewards, **self.effects)
        self.publish(state)
        return state, metrics

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
            raise ValueError("LocalExecutor.score_model: no reward model (give LocalExecutor(reward_model=path))")
        if isinstance(self.reward_model, (str, Path)):
            device = self.reward_model_device or str(getattr(self.evaluator.engine, "device", "cpu"))
            self.reward_model = RewardModel(self.reward_model, device=device)
        return self.reward_model.score(prompts, responses, batch_size=self.reward_batch_size)

    def close(self) -> None:
        for slot in {id(s): s for s in [*self.generators, self.evaluator]}.values():
            slot.engine.close()

    def __enter__(self) -> "LocalExecutor":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
