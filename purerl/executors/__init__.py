"""Executors: where a run's effects happen. The same step function runs under each.

- :mod:`purerl.executors.local`: the executor interface and the in-process executor (default).
- :mod:`purerl.executors.ray`: Ray worker groups (FSDP2 training ranks, rollout and
  reward workers); imports Ray only when used.
- :mod:`purerl.executors.fsdp`: the sharded model, the data-parallel ``value_and_grad``.
- :mod:`purerl.executors.wire`: numpy transfer of pytrees, versioned checksummed weight buckets.
"""

from purerl.executors.local import Executor, ExecutorError, LocalExecutor, StepFn

__all__ = ["Executor", "ExecutorError", "LocalExecutor", "StepFn"]
