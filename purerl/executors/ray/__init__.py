"""The Ray executor: training ranks (FSDP2) and rollout workers as Ray actors, driven from one process.

Worker groups live on resource pools (Ray placement groups, one bundle per worker):

- ``train``: ``train_ranks`` actors forming one ``torch.distributed`` group (gloo on CPU, NCCL on
  GPU). Each holds the sharded policy (and reference) and runs the *unchanged* step function with
  :class:`~purerl.executors.fsdp.ShardedCausalLM` as ``policy`` and the data-parallel
  ``value_and_grad`` (and a sharded critic, for PPO). Each rank receives the whole rollout batch;
  the gradient effect and the no-grad forwards take the rank's own rows.
- ``rollout``: ``rollout_workers`` actors apart from the training ranks, each with a rollout
  engine; with ``placement="colocated"`` (verl's hybrid engine) or ``"fully_collocated"`` the
  training ranks generate themselves from gathered weights.
- ``critic``, ``reference``: with ``"split_collocate"`` or ``"standalone"``, the roles the
  placement moves off the training ranks (:class:`~.actors.RoleRank`; the step reaches them
  through :mod:`~.roles`).
- ``reward``: ``reward_workers`` CPU actors scoring contiguous shards of the responses with
  :func:`~purerl.rewards.score_responses` (none: the driver scores) and, with
  a reward model, each holding the learned reward model (loaded once, at start) for
  ``score_model`` (none: the driver loads it on first use and scores on its CPU).

Modules: :mod:`~.config` (what the workers are built from: :class:`RaySetup`, :class:`StepFactory`),
:mod:`~.actors` (the actor classes), :mod:`~.roles` (the roles on other pools, as the ranks see them),
:mod:`~.pools` (starting Ray, pools, waiting that fails closed), :mod:`~.weights` (publishing weight versions through
the object store), :mod:`~.executor` (:class:`RayExecutor`).

Weights reach the rollout workers as numbered versions gathered from the shards (optionally
checksummed), and every generate names the version it expects. Failures fail closed: a dead actor,
an exception in a worker or a call that outlives its timeout raises
:class:`~purerl.executors.base.ExecutorError` naming the role and rank, after every actor is
killed (so no rank is left blocked in a collective). Imports Ray only when an executor starts.
"""

from purerl.executors.ray.config import RaySetup, StepFactory
from purerl.executors.ray.executor import RayExecutor

__all__ = ["RayExecutor", "RaySetup", "StepFactory"]
