"""A job's executor: the local one (an engine per generator when asynchronous) or Ray's, which
builds the step function on each rank from the config."""

import copy
import functools
from pathlib import Path
from typing import Any

import attrs

from purerl.assembly.stages import step_function, sync_tolerance_of
from purerl.config.job import JobConfig
from purerl.executors.base import Executor, Roles
from purerl.executors.local import LocalExecutor
from purerl.models import CausalLM, Critic
from purerl.rollout.canary import Canary
from purerl.rollout.engine import make_engine
from purerl.step.roles import LocalTeacher

__all__ = ["canary_of", "make_executor", "roles_of", "step_of"]


def make_executor(config: JobConfig, model: CausalLM, critic: Critic | None, options: dict[str, Any],
                  teacher: LocalTeacher | None = None) -> Executor:
    """The local executor (with an engine per generator when asynchronous), or the Ray one,
    which builds the step function on each rank from the config. ``teacher``: a distillation
    teacher loaded here (:func:`~purerl.assembly.models.load_teacher`)."""
    rollout, executor = config.rollout, config.executor
    roles = roles_of(config, model, critic, teacher)
    generators = config.asynchronous.generators if config.asynchronous.enable else 0
    if executor.kind == "local":
        engine = make_engine(rollout.engine, model, device=config.model.device, **options)
        own_engines = []
        for _ in range(generators):
            own = attrs.evolve(model, module=copy.deepcopy(model.module))  # no module shared with another thread
            own_engines.append(make_engine(rollout.engine, own, device=config.model.device, **options))
        return LocalExecutor(step_of(config), roles, engine, own_engines)
    from purerl.executors.fsdp import Offload
    from purerl.executors.ray import RayExecutor, RaySetup

    setup = RaySetup(engine_kwargs=options, engine=rollout.engine, generators=generators,
                     generate_timeout=config.asynchronous.generate_timeout,
                     offload=Offload(config.actor.offload_params, config.actor.offload_optimizer),
                     ray_init={"_temp_dir": str(Path(executor.ray_temp_dir).resolve())} if executor.ray_temp_dir
                     else None)
    return RayExecutor(step_of(config), roles, setup, executor)


def step_of(config: JobConfig) -> Any:
    """The job's step function as its executor takes it (:meth:`~purerl.executors.base.Executor.rebind`):
    the function itself for the local executor, a :class:`~purerl.executors.ray.StepFactory` that each Ray
    training rank builds from the config."""
    if config.executor.kind == "local":
        return step_function(config)
    from purerl.executors.ray import StepFactory

    return StepFactory(functools.partial(step_function, config))


def roles_of(config: JobConfig, model: CausalLM, critic: Critic | None, teacher: LocalTeacher | None) -> Roles:
    """The run's roles: the policy, the critic and the teacher loaded for it, the reward model's
    folder (``reward.model``) and the weight-sync canary (:func:`canary_of`)."""
    return Roles(model, critic=critic, teacher=teacher, reward_model=config.reward.model,
                 canary=canary_of(config, model))


def canary_of(config: JobConfig, model: CausalLM) -> Canary | None:
    """The explicit check after each load of a version into an asynchronous generator's engine
    (``executor.sync_canary``): every other sync is checked by the step itself, free
    (:func:`~purerl.assembly.stages.sync_tolerance_of`), but a generator's batch may come from a version
    the trainer has already moved past, and a checked sync should stop the run before it samples."""
    tolerance = sync_tolerance_of(config)
    return None if tolerance is None else Canary(model, tolerance=tolerance)
