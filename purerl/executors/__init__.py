"""Executors: where a run's effects happen. The same step function runs under each.

- :mod:`purerl.executors.base`: the executor interface, and the roles record every executor takes.
- :mod:`purerl.executors.local`: the in-process executor (default).
- :mod:`purerl.executors.ray`: Ray worker groups (FSDP2 training ranks, rollout and
  reward workers); imports Ray only when used.
- :mod:`purerl.executors.fsdp`: the sharded model, the data-parallel ``value_and_grad``.
- :mod:`purerl.executors.wire`: numpy transfer of pytrees, versioned checksummed weight buckets.
"""

from purerl.executors.base import Executor, ExecutorError, Roles
from purerl.executors.local import LocalExecutor

__all__ = ["Executor", "ExecutorError", "LocalExecutor", "Roles"]
