"""A job's executor, built by its kind (:mod:`purerl.executor_kinds`): the local one (an engine per
generator when asynchronous) or Ray's, which builds the step function on each rank from the config."""

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

__all__ = ["canary_of", "local_executor", "make_executor", "ray_executor", "roles_of", "step_of"]


def make_executor(config: JobConfig, model: CausalLM, critic: Critic | None, options: dict[str, Any],
                  teacher: LocalTeacher | None = None) -> Executor:
    """The executor ``executor.kind`` names, built by its kind (:data:`~purerl.executor_kinds.EXECUTORS`).
    ``teacher``: a distillation teacher loaded here (:func:`~purerl.assembly.models.load_teacher`)."""
    return config.executor.of_kind.builder()(config, model, critic, options, teacher)


def local_executor(config: JobConfig, model: CausalLM, critic: Critic | None, options: dict[str, Any],
                   teacher: LocalTeacher | None) -> Executor:
    """The local executor: one process, with an engine of its own per asynchronous generator."""
    generators = config.asynchronous.generators if config.asynchronous.enable else 0
    engine = make_engine(config.rollout.engine, model, device=config.model.device, **options)
    own_engines = []
    for _ in range(generators):
        own = attrs.evolve(model, module=copy.deepcopy(model.module))  # no module shared with another thread
        own_engines.append(make_engine(config.rollout.engine, own, device=config.model.device, **options))
    return LocalExecutor(step_of(config), roles_of(config, model, critic, teacher), engine, own_engines)


def ray_executor(config: JobConfig, model: CausalLM, critic: Critic | None, options: dict[str, Any],
                 teacher: LocalTeacher | None) -> Executor:
    """The Ray executor, which builds the step function on each rank from the config."""
    from purerl.executors.fsdp import Offload
    from purerl.executors.ray import RayExecutor, RaySetup

    executor = config.executor
    setup = RaySetup(engine_kwargs=options, engine=config.rollout.engine,
                     generators=config.asynchronous.generators if config.asynchronous.enable else 0,
                     generate_timeout=config.asynchronous.generate_timeout,
                     offload=Offload(config.actor.offload_params, config.actor.offload_optimizer),
                     ray_init={"_temp_dir": str(Path(executor.ray_temp_dir).resolve())} if executor.ray_temp_dir
                     else None)
    return RayExecutor(step_of(config), roles_of(config, model, critic, teacher), setup, executor)


def step_of(config: JobConfig) -> Any:
    """The job's step function as its executor takes it (:meth:`~purerl.executors.base.Executor.rebind`):
    the function itself, or a :class:`~purerl.executors.ray.StepFactory` that each training rank builds from
    the config (an executor that builds its step on its ranks)."""
    if not config.executor.of_kind.builds_step_on_ranks:
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
