"""The sections of a job's configuration that say how it runs rather than what it learns: where
each role lives and on what (:class:`ExecutorConfig`, :data:`PLACEMENTS`) and whether generation
overlaps training (:class:`AsyncConfig`). Executors and the asynchronous loop take these sections.
"""

import math
from typing import Any

import attrs

from purerl.config.loading import ConfigError, boolean, one_of, section
from purerl.executor_kinds import EXECUTORS, ExecutorKind
from purerl.validators import at_least, positive

__all__ = ["PLACEMENTS", "POOLS", "AsyncConfig", "ExecutorConfig"]


POOLS = ("train", "rollout", "reward", "critic", "reference")

PLACEMENTS = {
    "split": {"rollout": "rollout", "reference": "train", "critic": "train", "reward_model": "reward"},
    "colocated": {"rollout": "train", "reference": "train", "critic": "train", "reward_model": "reward"},
    "hybrid_engine": {"rollout": "train", "reference": "train", "critic": "train", "reward_model": "reward"},
    "fully_collocated": {"rollout": "train", "reference": "train", "critic": "train", "reward_model": "train"},
    "split_collocate": {"rollout": "rollout", "reference": "train", "critic": "critic", "reward_model": "critic"},
    "standalone": {"rollout": "rollout", "reference": "reference", "critic": "critic", "reward_model": "reward"},
}
"""Where each role lives under each ``executor.placement``: the pool (``train`` is the actor's).
``colocated`` = ``hybrid_engine`` (verl's); ``split_collocate``: OpenRLHF's default."""


def _pool_resources(_: Any, attribute: Any, value: dict) -> None:
    """Pools of :data:`POOLS`, each a table of resource names to amounts > 0."""
    for pool, resources in value.items():
        if pool not in POOLS:
            raise ConfigError(f"executor.pool_resources: no pool {pool!r} (pools: {', '.join(POOLS)})")
        if not isinstance(resources, dict) or not all(
                isinstance(k, str) and isinstance(v, (int, float)) and v > 0 for k, v in resources.items()):
            raise ConfigError(f"executor.pool_resources.{pool}: a table of resource names to amounts > 0, "
                              f"got {resources!r}")


@section
class ExecutorConfig:
    """Where each role lives and on what: ``local`` (one process) or ``ray`` (FSDP2 training ranks,
    rollout workers or the ranks generating, reward workers, and the pools of :data:`PLACEMENTS`; a pool
    of several workers shards its role with FSDP2 like the ranks). A worker silent longer than its
    timeout ends the run, naming it."""

    kind: str = attrs.field(default="local", validator=one_of(EXECUTORS, "executor"))
    """The executor (:data:`~purerl.executor_kinds.EXECUTORS`): ``local``, one process; ``ray``, FSDP2 training
    ranks and workers as Ray actors."""
    ray_address: str | None = None
    """Join this Ray cluster (``auto`` or ``host:port``; None: start a private local Ray instance)."""
    placement: str = attrs.field(default="split", validator=one_of(tuple(PLACEMENTS), "placement"))
    """Where each role lives (:data:`PLACEMENTS`): ``split`` (rollout workers apart), ``colocated`` =
    ``hybrid_engine`` (the ranks generate), ``fully_collocated`` (every role on the ranks, the reward model
    too), ``split_collocate`` (the critic and the reward model on a ``critic`` pool), ``standalone`` (the
    critic on a ``critic`` pool, the reference on a ``reference`` pool, the reward model on the reward
    workers)."""
    train_ranks: int = attrs.field(default=2, validator=at_least(1))
    """FSDP2 training ranks (Ray actors)."""
    rollout_workers: int = attrs.field(default=1, validator=at_least(1))
    """Rollout workers generating apart from the ranks (asynchronous training: at least one per generator)."""
    reward_workers: int = attrs.field(default=0, validator=at_least(0))
    """Workers scoring rewards; they hold the reward model (0: the driver scores)."""
    critic_workers: int = attrs.field(default=1, validator=at_least(1))
    """Workers of the ``critic`` pool (placements ``split_collocate`` and ``standalone``)."""
    reference_workers: int = attrs.field(default=1, validator=at_least(1))
    """Workers of the ``reference`` pool (placement ``standalone``)."""
    gpus_per_worker: float = attrs.field(default=0.0, validator=at_least(0))
    """GPUs in each worker's bundle (> 0: the workers compute on CUDA)."""
    cpus_per_worker: float = attrs.field(default=1.0, validator=positive)
    """CPUs in each worker's bundle, and as many torch threads."""
    reward_gpus_per_worker: float = attrs.field(default=0.0, validator=at_least(0))
    """GPUs in each reward worker's bundle."""
    reward_batch_size: int = attrs.field(default=16, validator=at_least(1))
    """Texts a reward worker's reward model scores at a time."""
    sync_checksum: bool = False
    """Check the weights sent to the rollout workers with sha256."""
    sync_canary: bool = True
    """The engine's log-probs of what it sampled must equal the trainer's under the same weights version
    (checked by the step's first mini-batch, :attr:`~purerl.step.settings.ActorLoss.sync_tolerance`; an
    asynchronous generator's or an evaluation's load by :mod:`purerl.rollout.canary`), or the run stops
    naming the version."""
    bucket_bytes: int = attrs.field(default=64 << 20, validator=at_least(1))
    """Weights travel to the rollout workers in buckets of this many bytes."""
    step_timeout: float = attrs.field(default=3600.0, validator=positive)
    """Seconds a step may take before a silent worker ends the run."""
    sync_timeout: float = attrs.field(default=600.0, validator=positive)
    """Seconds a weight sync may take."""
    start_timeout: float = attrs.field(default=300.0, validator=positive)
    """Seconds starting the workers may take."""
    ray_temp_dir: str | None = None
    """The temp and log folder of a locally started Ray (None: Ray's default)."""
    pool_resources: dict[str, dict[str, float]] = attrs.field(factory=dict, validator=_pool_resources)
    """Custom Ray resources that each worker of a pool (``train``, ``rollout``, ``reward``, ``critic``,
    ``reference``) asks for besides its CPUs and GPUs, to pin roles to nodes: start the generating nodes with
    ``ray start --resources='{"rollout_node": 8}'`` and set ``pool_resources.rollout.rollout_node = 1``."""

    @property
    def of_kind(self) -> ExecutorKind:
        """The registered kind ``kind`` names: what it can do (:class:`~purerl.executor_kinds.ExecutorKind`)."""
        return EXECUTORS[self.kind]

    @property
    def device(self) -> str:
        """Where the Ray workers compute: CUDA when they are given GPUs."""
        return "cuda" if self.gpus_per_worker > 0 else "cpu"

    @property
    def threads_per_worker(self) -> int:
        return max(1, math.floor(self.cpus_per_worker))

    @property
    def roles(self) -> dict[str, str]:
        """``{role: pool}`` for the rollout, the reference, the critic, the reward model and a
        distillation teacher, which lives where the reference does (frozen both, they share that pool)."""
        roles = PLACEMENTS[self.placement]
        return {**roles, "teacher": roles["reference"]}

    @property
    def colocated(self) -> bool:
        """Whether the training ranks generate (no rollout pool)."""
        return self.roles["rollout"] == "train"

    @property
    def workers(self) -> int:
        """Ray actors at most: training ranks, rollout workers (not colocated), reward workers and
        the critic's and the reference's pools (when the placement has them)."""
        pools = set(self.roles.values())
        return (self.train_ranks + (0 if self.colocated else self.rollout_workers) + self.reward_workers
                + (self.critic_workers if "critic" in pools else 0)
                + (self.reference_workers if "reference" in pools else 0))


@section
class AsyncConfig:
    """Generation overlapping training: generators sample with published weights while the trainer
    updates, through a bounded queue, under a staleness bound."""

    enable: bool = False
    """A generator samples with published weights while the trainer updates."""
    max_staleness: int = attrs.field(default=1, validator=at_least(0))
    """``k``: a batch sampled with weights version ``v`` may be trained on by the trainer at version
    ``≤ v + k``."""
    stale_policy: str = attrs.field(default="wait", validator=one_of(("wait", "drop"), "stale policy"))
    """``wait``: a generator does not start the batch of step ``i`` before version ``i − 1 − k`` is published,
    so no batch is ever too stale (``k = 0`` is the synchronous trainer, step for step); ``drop``: generators
    never wait for weights and the trainer drops (and counts) the batches that are too stale."""
    queue_batches: int = attrs.field(default=2, validator=at_least(1))
    """The bound of the queue: at most ``queue_batches + 1`` batches are under way or waiting for the trainer
    (generators stop taking prompts meanwhile), so at most ``queue_batches`` wait when the trainer takes one."""
    generators: int = attrs.field(default=1, validator=at_least(1))
    """Independent generator loops, each with its engine (locally, a model copy of its own; on Ray, its share
    of the rollout workers), taking prompt groups from one cursor and handing them in as they finish; the
    trainer takes each step's groups in prompt order."""
    groups_per_call: int = attrs.field(default=0, validator=at_least(0))
    """Prompt groups a generator takes at a time (0: a step's prompts shared equally among the generators)."""
    restarts: int = attrs.field(default=3, validator=at_least(0))
    """A generator that fails is restarted (on Ray, with new rollout workers), its groups handed out again, up
    to this many times in the run; then the run fails, naming it."""
    restart_backoff_s: float = attrs.field(default=1.0, validator=at_least(0))
    """Seconds before the first restart of a generator, doubling each time."""
    status_every_s: float = attrs.field(default=5.0, validator=positive)
    """The run folder's ``status.json`` is rewritten every this many seconds."""
    interruptible: bool = attrs.field(default=False, validator=boolean)
    """A generator that sees newer weights published mid-generation stops, keeps the tokens sampled so far
    (with their log-probs), loads the new weights and continues the open rows (:mod:`purerl.rollout.partial`;
    the embedded engine only)."""
    generate_timeout: float | None = attrs.field(default=None, validator=attrs.validators.optional(positive))
    """On Ray: seconds a generator's workers may take for one generate call before the generator counts as
    failed and is restarted (None: ``executor.step_timeout``)."""
