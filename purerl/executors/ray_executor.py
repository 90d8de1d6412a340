"""The Ray executor: training ranks (FSDP2) and rollout workers as Ray actors, driven from one process.

Worker groups live on resource pools (Ray placement groups, one bundle per worker):

- ``train``: ``train_ranks`` actors forming one ``torch.distributed`` group (gloo on CPU, NCCL on
  GPU). Each holds the sharded policy (and reference) and runs the *unchanged* step function with
  :class:`~purerl.executors.fsdp.ShardedCausalLM` as ``policy`` and the data-parallel
  ``value_and_grad`` (and a sharded critic, for PPO). Each rank receives the whole rollout batch;
  the gradient effect and the no-grad forwards take the rank's own rows.
- ``rollout``: with ``placement="split"``, ``rollout_workers`` actors apart from the training
  ranks, each with an embedded engine; with ``"colocated"`` (verl's hybrid engine) the training
  ranks generate themselves from gathered weights.
- ``reward``: ``reward_workers`` CPU actors scoring contiguous shards of the responses with
  :func:`~purerl.rewards.score_responses` (none: the driver scores).

The driver keeps the small part of the state (step, RNG, data cursor, KL controller); params and
optimizer state stay on the ranks (the driver's copy holds ``policy={}``, ``policy_opt=None``).
Weights reach the rollout workers by :meth:`RayExecutor.engine` ``.sync``: gathered from the
shards, sent as versioned buckets (optionally checksummed), and every generate names the version
it expects.

Failures fail closed: a dead actor, an exception in a worker or a call that outlives its timeout
raises :class:`~purerl.executors.local.ExecutorError` naming the role and rank, after every actor
is killed (so no rank is left blocked in a collective).
"""

import os
import socket
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import attrs
import torch

from purerl.batch import Rollout
from purerl.executors.local import ExecutorError, StepFn
from purerl.executors.wire import (
    from_wire,
    load_weight_buckets,
    params_digest,
    to_wire,
    weight_buckets,
)
from purerl.model import CausalLM, Critic
from purerl.rewards import RewardFn, Scores, score_responses
from purerl.rollout.engine import make_engine
from purerl.rollout.merge import concat_rollouts, prompt_shards
from purerl.rollout.sampling import SamplingParams
from purerl.state import RngState, TrainState
from purerl.tree import replace, tree_map

__all__ = ["RayConfig", "RayExecutor"]

PLACEMENTS = ("colocated", "split")
_GRACE_S = 5.0  # how long, after one worker fails, the others may still report


@attrs.frozen
class RayConfig:
    """Where workers run and how long the driver waits for them.

    ``address``: None starts a local Ray instance (``ray.init()``); ``"auto"`` or ``"host:port"``
    joins a running cluster. ``reward_workers``: 0 scores on the driver, more spreads the reward
    function calls over that many CPU workers. ``step_timeout``/``sync_timeout`` bound one step / one weight sync;
    a rank that exceeds them ends the run.
    """

    train_ranks: int = 2
    rollout_workers: int = 1
    reward_workers: int = 0
    placement: str = "split"
    engine: str = "torch"
    address: str | None = None
    cpus_per_worker: float = attrs.field(default=1.0, converter=float)
    gpus_per_worker: float = attrs.field(default=0.0, converter=float)
    threads_per_worker: int = 1
    checksum: bool = False
    bucket_bytes: int = 64 << 20
    step_timeout: float = attrs.field(default=3600.0, converter=float)
    sync_timeout: float = attrs.field(default=600.0, converter=float)
    start_timeout: float = attrs.field(default=300.0, converter=float)

    def __attrs_post_init__(self) -> None:
        if self.placement not in PLACEMENTS:
            raise ValueError(f"RayConfig: placement must be one of {PLACEMENTS}, got {self.placement!r}")
        if self.train_ranks < 1 or (self.placement == "split" and self.rollout_workers < 1):
            raise ValueError("RayConfig: need ≥ 1 training rank and, for 'split', ≥ 1 rollout worker")
        if self.engine != "torch" and self.placement == "colocated":
            # vLLM sets up a process group of its own, which clashes with the training ranks' FSDP group
            raise ValueError(f"RayConfig: the {self.engine!r} engine runs on rollout workers (placement 'split')")


_RANK_FIELDS = ("policy", "policy_opt", "reference", "critic", "critic_opt")


def _driver_view(state: TrainState) -> TrainState:
    """What the driver keeps: the state without params and optimizer states (they stay on the ranks)."""
    return replace(state, policy={}, policy_opt=None, reference=None, critic=None, critic_opt=None)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class TrainRank:
    """One training rank (a Ray actor): sharded params, the step function, optionally an engine."""

    def __init__(self, rank: int, world: int, policy: CausalLM, critic: Critic | None, step_fn: Callable,
                 build: bool, threads: int, engine_kwargs: dict[str, Any] | None, device: str,
                 engine: str = "torch") -> None:
        torch.set_num_threads(threads)
        self.rank, self.world, self.skeleton, self.critic_skeleton, self.device = rank, world, policy, critic, device
        self.step_fn = step_fn() if build else step_fn
        self.engine = make_engine(engine, policy, device=device, **engine_kwargs) if engine_kwargs is not None else None
        self.state: TrainState | None = None

    def pid(self) -> int:
        return os.getpid()

    def address(self) -> tuple[str, int]:
        import ray

        return ray.util.get_node_ip_address(), _free_port()

    def init_process_group(self, host: str, port: int, timeout_s: float) -> None:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        backend = "nccl" if self.device == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://{host}:{port}", rank=self.rank,
                                world_size=self.world, timeout=timedelta(seconds=timeout_s))
        self.mesh = init_device_mesh(self.device, (self.world,))

    def load(self, wire_state: Any) -> None:
        """Shard a full state: policy, reference and critic through FSDP2, each optimizer state
        like its params."""
        from purerl.executors.fsdp import (
            ShardedCausalLM,
            ShardedCritic,
            shard_causal_lm,
            shard_like,
            shard_module,
            sharded_value_and_grad,
        )

        state = from_wire(wire_state)
        module, params = shard_causal_lm(self.skeleton, state.policy, mesh=self.mesh)
        modules = [(module, params)]
        reference = None
        if state.reference is not None:
            ref_module, reference = shard_causal_lm(self.skeleton, state.reference, mesh=self.mesh, trainable=False)
            modules.append((ref_module, reference))
        self.model = ShardedCausalLM.of(self.skeleton, modules)
        changes = dict(policy=params, policy_opt=shard_like(state.policy_opt, params), reference=reference)
        self.critic = None
        if state.critic is not None:
            if self.critic_skeleton is None:
                raise ValueError("the state has critic params but the executor was given no critic model")
            critic_module, critic = shard_module(self.critic_skeleton.module, state.critic, mesh=self.mesh,
                                                 buffers=self.critic_skeleton.buffers)
            self.critic = ShardedCritic.of(self.critic_skeleton, [(critic_module, critic)])
            changes.update(critic=critic, critic_opt=shard_like(state.critic_opt, critic))
        self.state = replace(state, **changes)
        self.value_and_grad = sharded_value_and_grad(self.rank, self.world)

    def step(self, small: Any, batch: Any) -> tuple[Any, dict[str, float]]:
        """``small``: the driver's state; ``batch``: ``(rollout, scores)``, the same on every rank."""
        to_device = lambda x: x.to(self.device) if isinstance(x, torch.Tensor) else x  # noqa: E731
        small, (rollout, scores) = tree_map(to_device, from_wire((small, batch)))
        state = replace(small, **{k: getattr(self.state, k) for k in _RANK_FIELDS})
        effects = dict(policy=self.model, value_and_grad=self.value_and_grad)
        if self.critic is not None:
            effects["critic"] = self.critic
        state, metrics = self.step_fn(state, rollout, scores, **effects)
        self.state = state
        return to_wire(_driver_view(state)), metrics

    def full_state(self) -> Any:
        """The whole state with full tensors (all ranks must call it; rank 0 returns it)."""
        from purerl.executors.fsdp import is_sharded

        full = tree_map(lambda x: x.full_tensor() if is_sharded(x) else x, self.state)
        full = tree_map(lambda x: x.detach() if isinstance(x, torch.Tensor) else x, full)
        return to_wire(full) if self.rank == 0 else None

    def weights(self, version: int, bucket_bytes: int, checksum: bool) -> Any:
        """Gathered policy weights as buckets (all ranks must call it; rank 0 returns them)."""
        from purerl.executors.fsdp import full_params

        full = full_params(self.state.policy)
        if self.rank != 0:
            return None
        return weight_buckets(full, version, bucket_bytes=bucket_bytes, checksum=checksum)

    def sync_engine(self, version: int, checksum: bool) -> str | None:
        """Colocated: the local engine gets the gathered weights (all ranks call it); with
        ``checksum``, returns their sha256."""
        from purerl.executors.fsdp import full_params

        full = full_params(self.state.policy)
        self.engine.sync(full, version)
        return params_digest(full) if checksum else None

    def generate(self, prompts: list[list[int]], sampling: SamplingParams, rng: RngState, version: int) -> Any:
        return to_wire(self.engine.generate(prompts, sampling, rng, version=version))

class RolloutWorker:
    """A rollout worker (a Ray actor): a rollout engine (``config.engine``) fed by weight sync."""

    def __init__(self, policy: CausalLM, engine_kwargs: dict[str, Any], threads: int, device: str,
                 engine: str = "torch") -> None:
        torch.set_num_threads(threads)
        self.engine = make_engine(engine, policy, device=device, **engine_kwargs)
        self.device = device
        self.names: set[str] | None = None

    def pid(self) -> int:
        return os.getpid()

    def load_weights(self, version: int, buckets: list[Any]) -> str | None:
        """Load synced weights (each bucket's checksum verified when it has one); returns the
        sha256 of all of them in checksum mode."""
        params = load_weight_buckets(buckets, version, self.names, device=self.device)
        self.names = set(params)
        self.engine.sync(params, version)
        return params_digest(params) if buckets[0].sha256 is not None else None

    def generate(self, prompts: list[list[int]], sampling: SamplingParams, rng: RngState, version: int) -> Any:
        return to_wire(self.engine.generate(prompts, sampling, rng, version=version))


class RewardWorker:
    """A reward worker (a Ray actor): scores one shard of the responses."""

    def pid(self) -> int:
        return os.getpid()

    def score(self, fn: RewardFn, responses: list[str], truths: list[str], timeout: float, penalty: float,
              first_index: int) -> Scores:
        return score_responses(fn, responses, truths, timeout=timeout, penalty=penalty, first_index=first_index)


class _RemoteEngine:
    """The driver's view of the rollout workers, with the :class:`RolloutEngine` interface."""

    def __init__(self, executor: "RayExecutor", pad_token_id: int) -> None:
        self.executor, self.pad_token_id = executor, pad_token_id
        self.version: int | None = None

    def sync(self, params: Any, version: int) -> None:
        """Publish the training ranks' current weights as ``version`` (``params`` is the driver's
        placeholder and is ignored: the weights live on the ranks)."""
        self.executor.sync_weights(version)
        self.version = version

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, rng: RngState,
                 *, version: int | None = None) -> Rollout:
        ex = self.executor
        version = self.version if version is None else version
        shards = prompt_shards(len(prompts), len(ex.rollout))
        calls = [(w.generate.remote([list(p) for p in prompts[sl]], sampling, rng if len(shards) == 1 else
                                    rng.fold_in(i), version), ex.rollout_label(i))
                 for i, (w, sl) in enumerate(zip(ex.rollout, shards))]
        parts = ex.wait(calls, ex.config.step_timeout, "generate")
        return concat_rollouts([from_wire(p) for p in parts], self.pad_token_id)

    def close(self) -> None:
        """Nothing of its own: the workers it drives are the executor's, stopped by its ``close``."""


class RayExecutor:
    """Runs a step function on FSDP2 training ranks and generates on rollout workers, over Ray.

    ``engine_kwargs`` are the keyword arguments of the rollout workers' engine (``config.engine``,
    built by :func:`~purerl.rollout.engine.make_engine`: ``eos_token_ids``, ``pad_token_id``,
    ``decode``, backend options); everything passed in must pickle.
    ``step_fn`` may be ``None`` with ``make_step_fn`` given instead: a picklable zero-argument
    function that builds the step function on each rank (for step functions that close over
    objects that do not pickle, e.g. under jaxtyping's import hook in the test suite). With a
    ``critic`` (PPO), a state with critic params gets a sharded critic, passed to the step
    function as ``critic=``.
    """

    def __init__(self, step_fn: StepFn | None, policy: CausalLM, *, engine_kwargs: dict[str, Any],
                 config: RayConfig = RayConfig(), ray_init: dict[str, Any] | None = None,
                 make_step_fn: Callable[[], StepFn] | None = None, critic: Critic | None = None) -> None:
        if (step_fn is None) == (make_step_fn is None):
            raise ValueError("RayExecutor: give exactly one of step_fn and make_step_fn")
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.config = config
        self.actors: list[tuple[Any, str]] = []
        self._closed = False
        colocated = config.placement == "colocated"
        workers = config.train_ranks + (0 if colocated else config.rollout_workers) + config.reward_workers
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            local = config.address is None
            # "local" always starts a fresh instance (never joins a cluster some other run left behind)
            ray.init(address=config.address or "local", include_dashboard=False, log_to_driver=True,
                     **({"num_cpus": max(os.cpu_count() or 1, int(workers * config.cpus_per_worker + 0.999))}
                        if local else {}), **(ray_init or {}))
        device = "cuda" if config.gpus_per_worker > 0 else "cpu"
        bundle = {"CPU": config.cpus_per_worker, **({"GPU": config.gpus_per_worker} if config.gpus_per_worker else {})}
        try:
            self.pools = {"train": placement_group([bundle] * config.train_ranks, strategy="PACK")}
            if not colocated:
                self.pools["rollout"] = placement_group([bundle] * config.rollout_workers, strategy="PACK")
            if config.reward_workers:
                self.pools["reward"] = placement_group([{"CPU": config.cpus_per_worker}] * config.reward_workers,
                                                       strategy="SPREAD")
            for name, pool in self.pools.items():
                if not pool.wait(config.start_timeout):
                    raise ExecutorError(f"Ray could not reserve the {name} pool ({len(pool.bundle_specs)} × {bundle}) "
                                        f"within {config.start_timeout:.0f} s: not enough resources in the cluster")

            def on(pool: str, index: int) -> dict[str, Any]:
                gpus = 0 if pool == "reward" else config.gpus_per_worker
                return {"scheduling_strategy": PlacementGroupSchedulingStrategy(self.pools[pool], index),
                        "num_cpus": config.cpus_per_worker, "num_gpus": gpus, "max_restarts": 0}

            train_cls = ray.remote(TrainRank)
            self.train = [train_cls.options(**on("train", r)).remote(
                r, config.train_ranks, policy, critic, step_fn or make_step_fn, step_fn is None,
                config.threads_per_worker, engine_kwargs if colocated else None, device, config.engine)
                for r in range(config.train_ranks)]
            self.actors += [(a, f"train rank {r}") for r, a in enumerate(self.train)]
            if colocated:
                self.rollout = self.train
            else:
                rollout_cls = ray.remote(RolloutWorker)
                self.rollout = [rollout_cls.options(**on("rollout", i)).remote(
                    policy, engine_kwargs, config.threads_per_worker, device, config.engine)
                    for i in range(config.rollout_workers)]
                self.actors += [(a, f"rollout worker {i}") for i, a in enumerate(self.rollout)]
            reward_cls = ray.remote(RewardWorker)
            self.reward = [reward_cls.options(**on("reward", i)).remote() for i in range(config.reward_workers)]
            self.actors += [(a, f"reward worker {i}") for i, a in enumerate(self.reward)]
            (host, port), = self.wait([(self.train[0].address.remote(), "train rank 0")], config.start_timeout, "start")
            self.wait([(w.init_process_group.remote(host, port, config.step_timeout), f"train rank {r}")
                       for r, w in enumerate(self.train)], config.start_timeout, "init_process_group")
        except BaseException:
            self.close()
            raise
        self.engine = _RemoteEngine(self, engine_kwargs["pad_token_id"])
        self.last_sync_digests: list[str | None] = []  # per rollout engine, in checksum mode

    # ---- plumbing -------------------------------------------------------------------------------
    def rollout_label(self, i: int) -> str:
        return f"train rank {i}" if self.config.placement == "colocated" else f"rollout worker {i}"

    def worker_pids(self) -> dict[str, int]:
        """``{"train rank 0": pid, …, "rollout worker 0": pid}``."""
        pids = self.wait([(a.pid.remote(), label) for a, label in self.actors], self.config.start_timeout, "pid")
        return {label: pid for (_, label), pid in zip(self.actors, pids)}

    def wait(self, calls: list[tuple[Any, str]], timeout: float, what: str) -> list[Any]:
        """The results of ``calls`` (``(ObjectRef, label)``), failing closed on the first error or
        when ``timeout`` seconds pass.

        After a first failure the other calls get a short grace period, so that when one rank dies
        and its peers then fail in a broken collective, the message names the dead one first.
        """
        import ray

        labels = {ref: label for ref, label in calls}
        results: dict[Any, Any] = {}
        pending = list(labels)
        deadline = time.monotonic() + timeout
        failures: list[tuple[bool, str]] = []
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            for ref in ready:
                failure = self._result(ref, labels[ref], results)
                if failure is not None:
                    failures.append(failure)
                    deadline = min(deadline, time.monotonic() + _GRACE_S)
        if failures or pending:
            self.close()
            failures.sort(key=lambda f: not f[0])  # deaths first
            messages = [m for _, m in failures]
            if pending and not failures:
                messages.append(f"{', '.join(labels[r] for r in pending)} did not answer within {timeout:.0f} s")
            raise ExecutorError(f"{what}: {'; '.join(messages)}; the run is stopped")
        return [results[ref] for ref, _ in calls]

    @staticmethod
    def _result(ref: Any, label: str, results: dict[Any, Any]) -> tuple[bool, str] | None:
        """Store the result of a finished call, or return ``(died, message)``."""
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        try:
            results[ref] = ray.get(ref)
            return None
        except RayActorError as e:
            return True, f"{label} died ({type(e).__name__})"
        except RayTaskError as e:
            cause = e.cause if e.cause is not None else e
            return False, f"{label} failed: {type(cause).__name__}: {cause}"

    def close(self) -> None:
        """Kill every actor and release the pools (and Ray itself, when this executor started it)."""
        if self._closed:
            return
        self._closed = True
        import ray

        for actor, _ in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # an actor that is already gone
                pass
        from ray.util.placement_group import remove_placement_group

        for pool in getattr(self, "pools", {}).values():
            try:
                remove_placement_group(pool)
            except Exception:
                pass
        if self._owns_ray:
            ray.shutdown()

    def __enter__(self) -> "RayExecutor":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---- the executor interface -----------------------------------------------------------------
    def start(self, state: TrainState) -> TrainState:
        """Send the full ``state`` to the training ranks (they shard it); the driver keeps the rest."""
        import ray

        ref = ray.put(to_wire(state))
        self.wait([(w.load.remote(ref), f"train rank {r}") for r, w in enumerate(self.train)],
                  self.config.start_timeout, "load state")
        return _driver_view(state)

    def step(self, state: TrainState, rollout: Rollout, scores: torch.Tensor) -> tuple[TrainState, dict[str, float]]:
        import ray

        small, batch = ray.put(to_wire(_driver_view(state))), ray.put(to_wire((rollout, scores)))
        results = self.wait([(w.step.remote(small, batch), f"train rank {r}")
                             for r, w in enumerate(self.train)], self.config.step_timeout, "step")
        new, metrics = from_wire(results[0][0]), results[0][1]
        for r, (other, _) in enumerate(results[1:], 1):
            if from_wire(other).step != new.step:
                self.close()
                raise ExecutorError(f"step: train rank {r} is at step {from_wire(other).step}, rank 0 at {new.step}")
        return _driver_view(new), metrics

    def sync_weights(self, version: int) -> None:
        """Gather the policy from the shards and load it into every rollout engine as ``version``."""
        c = self.config
        if c.placement == "colocated":
            self.last_sync_digests = self.wait([(w.sync_engine.remote(version, c.checksum), f"train rank {r}")
                                                for r, w in enumerate(self.train)], c.sync_timeout, "weight sync")
            return
        refs = [w.weights.remote(version, c.bucket_bytes, c.checksum) for w in self.train]
        self.wait([(ref, f"train rank {r}") for r, ref in enumerate(refs)], c.sync_timeout, "weight sync")
        self.last_sync_digests = self.wait([(w.load_weights.remote(version, refs[0]), f"rollout worker {i}")
                                            for i, w in enumerate(self.rollout)], c.sync_timeout, "weight sync")

    def score(self, fn: RewardFn, responses: Sequence[str], ground_truths: Sequence[str], *,
              timeout: float, penalty: float) -> Scores:
        """Rewards on the reward workers (contiguous shards), or on the driver when there are none."""
        if not self.reward:
            return score_responses(fn, responses, ground_truths, timeout=timeout, penalty=penalty)
        import ray

        fn_ref = ray.put(fn)
        shards = prompt_shards(len(responses), len(self.reward))
        calls = [(w.score.remote(fn_ref, list(responses[sl]), list(ground_truths[sl]), timeout, penalty, sl.start),
                  f"reward worker {i}") for i, (w, sl) in enumerate(zip(self.reward, shards))]
        # each worker's threads time out after `timeout`; the margin covers transfer and start-up
        return Scores.concat(self.wait(calls, 2 * timeout + 30, "reward"))

    def full_state(self, state: TrainState) -> TrainState:
        """The full state gathered from the ranks, with the driver's step, RNG, cursor and KL."""
        parts = self.wait([(w.full_state.remote(), f"train rank {r}") for r, w in enumerate(self.train)],
                          self.config.sync_timeout, "gather state")
        full = from_wire(parts[0])
        return replace(state, **{k: getattr(full, k) for k in _RANK_FIELDS})
