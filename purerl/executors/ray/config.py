"""What the Ray executor builds its workers from, besides the job's ``executor`` section and the
run's :class:`~purerl.executors.base.Roles`: the rollout engine, the asynchronous generators,
offload, Ray's start; and a step function each rank builds for itself."""

from collections.abc import Callable
from typing import Any

import attrs

from purerl.executors.fsdp import Offload
from purerl.step.recipes import StepFn

__all__ = ["RaySetup", "StepFactory", "rank_step"]


@attrs.frozen
class StepFactory:
    """A step function each training rank builds for itself: ``build()`` returns it. For step
    functions that close over objects that do not pickle (e.g. under jaxtyping's import hook in
    the test suite); ``build`` itself must pickle."""

    build: Callable[[], StepFn]


def rank_step(step_fn: StepFn | StepFactory) -> tuple[Callable, bool]:
    """What a training rank is sent for ``step_fn``: the callable, and whether the rank calls it to build its
    step (:class:`StepFactory`) or runs it as is."""
    return (step_fn.build, True) if isinstance(step_fn, StepFactory) else (step_fn, False)


@attrs.frozen(kw_only=True)
class RaySetup:
    """What the Ray executor's workers are built from, besides the executor section of the config
    and the roles; everything here must pickle."""

    engine_kwargs: dict[str, Any]
    """The keyword arguments of the rollout workers' engine (:func:`~purerl.rollout.engine.make_engine`:
    ``eos_token_ids``, ``pad_token_id``, ``decode``, backend options)."""
    engine: str = "torch"
    """The rollout workers' engine (:data:`~purerl.rollout.engines.ENGINES`)."""
    generators: int = 0
    """Asynchronous generators, each driving its own share of the rollout workers (restarted when
    they fail); 0: synchronous, one engine over every rollout worker."""
    generate_timeout: float | None = None
    """Seconds an asynchronous generator's generate call may take before its workers are
    restarted (None: the executor section's ``step_timeout``)."""
    offload: Offload = Offload()
    """What the ranks keep in host memory between uses."""
    ray_init: dict[str, Any] | None = None
    """Extra keyword arguments of ``ray.init`` when the executor starts (or joins) Ray."""
