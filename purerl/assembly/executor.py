"""A job's executor: the local one (an engine per generator when asynchronous) or Ray's, which
builds the step function on each rank from the config."""

import copy
import functools
from pathlib import Path
from typing import Any

import attrs

from purerl.assembly.stages import step_function
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

    if config.executor.sync_canary:  # said, not silently skipped
        print("executor.sync_canary: the Ray executor's weight syncs are not canary-checked yet (the local "
              "executor's are); executor.sync_checksum=true checks their bytes", flush=True)

    ray_init = {"_temp_dir": str(Path(executor.ray_temp_dir).resolve())} if executor.ray_temp_dir else None
    from purerl.executors.fsdp import Offload

    ray_executor = RayExecutor(None, model, engine_kwargs=options, config=executor, engine=rollout.engine,
                               reward_model=config.reward.model, ray_init=ray_init, critic=critic,
                               make_step_fn=functools.partial(step_function, config),
                               offload=Offload(config.actor.offload_params, config.actor.offload_optimizer),
                               generators=config.asynchronous.generators if config.asynchronous.enable else 0,
                               generate_timeout=config.asynchronous.generate_timeout, teacher=teacher)
    return ray_executor


def canary_of(config: JobConfig, model: CausalLM) -> Canary | None:
    """The weight-sync check (``executor.sync_canary``), its tolerance the compute dtype's: float32 engines
    agree with the trainer to ~1e-3 nats per token (SmolLM2: up to 1.1e-3 over a run, which stopped a run
    under a tolerance of 1e-3), bfloat16 ones (or vLLM's kernels) to a tenth of a nat or so; a corrupted
    tensor moves it by far more."""
    if not config.executor.sync_canary:
        return None
    exact = config.model.dtype == "float32" and config.rollout.engine == "torch"
    return Canary(model, tolerance=5e-2 if exact else 0.5)
