"""A job's executor: the local one (an engine per generator when asynchronous) or Ray's, which
builds the step function on each rank from the config."""

import copy
import functools
from pathlib import Path
from typing import Any

import attrs

from purerl.assembly.stages import step_function, sync_tolerance_of
from purerl.config.job import JobConfig
from purerl.executors.base import Executor
from purerl.executors.local import LocalExecutor
from purerl.models import CausalLM, Critic
from purerl.rollout.canary import Canary
from purerl.rollout.engine import make_engine
from purerl.step.roles import LocalTeacher

__all__ = ["make_executor"]


def make_executor(config: JobConfig, model: CausalLM, critic: Critic | None, options: dict[str, Any],
                  teacher: LocalTeacher | None = None) -> Executor:
    """The local executor (with an engine per generator when asynchronous), or the Ray one,
    which builds the step function on each rank from the config. ``teacher``: a distillation
    teacher loaded here (:func:`~purerl.assembly.models.load_teacher`)."""
    rollout, executor = config.rollout, config.executor
    if executor.kind == "local":
        engine = make_engine(rollout.engine, model, device=config.model.device, **options)
        generators = []
        for _ in range(config.asynchronous.generators if config.asynchronous.enable else 0):
            own = attrs.evolve(model, module=copy.deepcopy(model.module))  # no module shared with another thread
            generators.append(make_engine(rollout.engine, own, device=config.model.device, **options))
        return LocalExecutor(step_function(config), model, engine, generator_engines=generators, critic=critic,
                             reward_model=config.reward.model, teacher=teacher, canary=canary_of(config, model))
    from purerl.executors.ray import RayExecutor

    ray_init = {"_temp_dir": str(Path(executor.ray_temp_dir).resolve())} if executor.ray_temp_dir else None
    from purerl.executors.fsdp import Offload

    ray_executor = RayExecutor(None, model, engine_kwargs=options, config=executor, engine=rollout.engine,
                               reward_model=config.reward.model, ray_init=ray_init, critic=critic,
                               make_step_fn=functools.partial(step_function, config),
                               offload=Offload(config.actor.offload_params, config.actor.offload_optimizer),
                               generators=config.asynchronous.generators if config.asynchronous.enable else 0,
                               generate_timeout=config.asynchronous.generate_timeout, teacher=teacher,
                               canary=canary_of(config, model))
    return ray_executor


def canary_of(config: JobConfig, model: CausalLM) -> Canary | None:
    """The explicit check after each load of a version into an asynchronous generator's engine
    (``executor.sync_canary``): every other sync is checked by the step itself, free
    (:func:`~purerl.assembly.stages.sync_tolerance_of`), but a generator's batch may come from a version
    the trainer has already moved past, and a checked sync should stop the run before it samples."""
    tolerance = sync_tolerance_of(config)
    return None if tolerance is None else Canary(model, tolerance=tolerance)
