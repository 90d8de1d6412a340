"""Kinds of executor, by name: what ``executor.kind`` may name, each a registered :class:`ExecutorKind`
saying what the config's rules and the assembly need to know about it, and how one is built.

- ``local``: one process (:class:`~purerl.executors.local.LocalExecutor`); the driver computes on
  ``model.device``, an engine per asynchronous generator;
- ``ray``: FSDP2 training ranks and workers as Ray actors on resource pools
  (:class:`~purerl.executors.ray.RayExecutor`).

As with rollout engines (:mod:`purerl.rollout.engines`), no code outside this module compares executor
names: callers read a kind's facts. Importing it imports neither torch nor ray (a kind's builder is
imported when an executor of that kind is first built).
"""

from collections.abc import Callable
from typing import Any

import attrs

from purerl.registry import Registry, imported

__all__ = ["EXECUTORS", "ExecutorKind", "register"]


@attrs.frozen
class ExecutorKind:
    """One kind of executor.

    - ``name``: what ``executor.kind`` names it by; ``description``: a sentence for the docs and ``--help``.
    - ``build``: ``(config, model, critic, options, teacher) -> Executor``, or its ``"module:name"``,
      imported when the first executor of this kind is built (:func:`purerl.assembly.executor.make_executor`).
    - ``computes_on_driver``: the driver process computes the model, on ``model.device`` (else workers do,
      on the devices their bundles give them, and the driver keeps the weights on the CPU to ship them).
    - ``builds_step_on_ranks``: each training rank builds the step function from the config (it takes a
      :class:`~purerl.executors.ray.StepFactory`, not the function).
    - ``placements``: roles live on resource pools, as ``executor.placement`` says.
    - ``offloads``: it can keep parameters and optimizer state in host memory between uses
      (``actor.offload_params``/``offload_optimizer``: FSDP2's offload).
    - ``shards_updates``: its updates may be sharded over ``executor.train_ranks`` ranks, whose sums add
      in another order than one process's.
    """

    name: str
    build: str | Callable[..., Any]
    description: str = ""
    computes_on_driver: bool = True
    builds_step_on_ranks: bool = False
    placements: bool = False
    offloads: bool = False
    shards_updates: bool = False

    def builder(self) -> Callable[..., Any]:
        """``build``, imported."""
        return imported(self.build)


EXECUTORS: Registry[ExecutorKind] = Registry("executor")


def register(kind: ExecutorKind) -> ExecutorKind:
    """``kind``, registered under its name."""
    return EXECUTORS.register(kind.name)(kind)


register(ExecutorKind("local", "purerl.assembly.executor:local_executor", "one process, CPU or one GPU"))
register(ExecutorKind(
    "ray", "purerl.assembly.executor:ray_executor", "FSDP2 training ranks and workers as Ray actors on resource "
    "pools", computes_on_driver=False, builds_step_on_ranks=True, placements=True, offloads=True,
    shards_updates=True))
