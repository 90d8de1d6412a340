"""The Ray executor's worker groups on their resource pools, and the one way to wait for them.

Pools are Ray placement groups, one bundle per worker: ``train`` (the FSDP2 ranks, one
``torch.distributed`` group), ``rollout`` (when the ranks do not generate), ``reward`` (reward
functions, and the reward model when the placement puts it there: each reward worker loads it at
start), and ``critic`` / ``reference`` when the placement gives those roles pools of their own
(started with the state, each rank group a ``torch.distributed`` group of its own). Waiting fails
closed: the first dead, failed or silent worker stops every actor (so no rank is left blocked in
a collective) and its message is the run's error, whichever thread waits next.
"""

import contextlib
import ipaddress
import os
import signal
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from purerl.config.execution import ExecutorConfig
from purerl.executors.base import ExecutorError, Roles
from purerl.executors.ray.actors import RewardWorker, RoleRank, RolloutWorker, TrainRank
from purerl.executors.ray.config import RaySetup, StepFactory, rank_step
from purerl.models import CausalLM, Critic
from purerl.rollout.engines import ENGINES
from purerl.step.recipes import StepFn

__all__ = ["WorkerGroups", "join_ray", "start_local_ray"]

_GRACE_S = 5.0  # how long, after one worker fails, the others may still report
# A rank waiting in a collective for a stopped or hung peer gives up (torch.distributed's timeout)
# before the driver's step deadline, so the driver hears its failure and names the silent peer
# rather than reporting both ranks as silent.
_COLLECTIVE_SHARE = 0.8


@contextlib.contextmanager
def _single_machine_mode() -> Iterator[None]:
    """While entered, Ray keeps a node on loopback: the single-machine mode it uses on macOS and
    Windows (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, read by the driver when it picks its node's
    address and by every Ray process it starts). Ray offers no other way: its services listen on
    the node's address, which it otherwise takes from the network."""
    from ray._private import ray_constants

    name = ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR
    previous_env, previous_flag = os.environ.get(name), ray_constants.ENABLE_RAY_CLUSTER
    os.environ[name] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = previous_flag
        if previous_env is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = previous_env


@contextlib.contextmanager
def _keeping_signal_handlers() -> Iterator[None]:
    """While entered, ``ray.init`` may install its own SIGTERM handling; on leaving, the driver's
    handlers are put back. Ray replaces the driver's SIGTERM handler with ``sys.exit``, and its
    core worker installs a C++ one that aborts the process (exit status 134): either would end a run
    without the checkpoint its stop request (:class:`~purerl.loop.recording.StopRequest`) writes."""
    names = (signal.SIGINT, signal.SIGTERM)
    main = threading.current_thread() is threading.main_thread()
    saved = {signum: signal.getsignal(signum) for signum in names} if main else {}
    try:
        yield
    finally:
        for signum, handler in saved.items():
            if handler is not None:  # None: a handler not installed from Python, nothing to put back
                signal.signal(signum, handler)  # also takes the signal back from Ray's C++ handler


def _on_loopback(address: str) -> bool:
    """Whether a Ray address (``host:port``, ``ray://host:port``) names this machine's loopback."""
    host = address.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def start_local_ray(num_cpus: int, temp_dir: str | None = None, **init_kwargs: Any) -> None:
    """Start the private Ray instance a run uses: always a fresh one (``address="local"``, never a
    cluster some other run left behind), no dashboard, every service listening on loopback
    (:func:`_single_machine_mode`, for the start only). Ray's token authentication stays as Ray
    sets it (on for a new local instance since Ray 2.60; only an explicit ``RAY_AUTH_MODE=disabled``
    in the environment turns it off). Raises ``ExecutorError`` if Ray still chose a network
    address."""
    import ray

    with _single_machine_mode(), _keeping_signal_handlers():
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False,
                 **({"_temp_dir": temp_dir} if temp_dir else {}), **init_kwargs)
    address = ray.util.get_node_ip_address()
    if not _on_loopback(address):
        ray.shutdown()
        raise ExecutorError(f"the local Ray instance chose the network address {address}, not loopback: this Ray "
                            f"version ({ray.__version__}) has no single-machine mode on this platform; start Ray "
                            "yourself and pass --ray-address")


def join_ray(address: str, **init_kwargs: Any) -> None:
    """Join the running Ray cluster at ``address``; one on this machine's loopback (as
    :func:`start_local_ray` starts) is joined in its single-machine mode."""
    import ray

    with _single_machine_mode() if _on_loopback(address) else contextlib.nullcontext(), _keeping_signal_handlers():
        ray.init(address=address, include_dashboard=False, **init_kwargs)


class WorkerGroups:
    """Starts (or joins) Ray, reserves the pools and starts the actors: ``train`` ranks,
    ``rollout`` workers (the training ranks themselves when colocated) and ``reward`` workers;
    ``actors`` lists them all with their labels ("train rank 0", "rollout worker 1", …).
    ``roles.reward_model`` is a folder (or None)."""

    def __init__(self, config: ExecutorConfig, roles: Roles, step_fn: StepFn | StepFactory, setup: RaySetup) -> None:
        import ray
        from ray.util.placement_group import placement_group

        policy, critic, reward_model = roles.policy, roles.critic, roles.reward_model
        engine, engine_kwargs, ray_init = setup.engine, setup.engine_kwargs, setup.ray_init
        self.config, self.offload = config, setup.offload
        self.actors: list[tuple[Any, str]] = []
        self.pools: dict[str, Any] = {}
        self.failure: str | None = None
        self._lock = threading.Lock()
        self._closed = False
        self.rendezvous: list[Path] = []  # the file rendezvous of one-node groups, removed on close
        colocated = config.colocated
        self.role_ranks: dict[str, list[Any]] = {}  # the critic's and the reference's pools, once started
        self.owns_ray = not ray.is_initialized()
        if self.owns_ray:
            if config.ray_address is None:
                cpus = max(os.cpu_count() or 1, int(config.workers * config.cpus_per_worker + 0.999))
                start_local_ray(cpus, **{"log_to_driver": True, **(ray_init or {})})
            else:
                join_ray(config.ray_address, **{"log_to_driver": True, **(ray_init or {})})
        extra = config.pool_resources
        bundle = {"CPU": config.cpus_per_worker, **({"GPU": config.gpus_per_worker} if config.gpus_per_worker else {})}
        try:
            self.pools["train"] = placement_group([{**bundle, **extra.get("train", {})}] * config.train_ranks,
                                                  strategy="PACK")
            if not colocated:  # spread: generators on several nodes do not all fail with one
                self.pools["rollout"] = placement_group([{**bundle, **extra.get("rollout", {})}]
                                                        * config.rollout_workers, strategy="SPREAD")
            reward_bundle = {"CPU": config.cpus_per_worker,
                             **({"GPU": config.reward_gpus_per_worker} if config.reward_gpus_per_worker else {}),
                             **extra.get("reward", {})}
            if config.reward_workers:
                self.pools["reward"] = placement_group([reward_bundle] * config.reward_workers, strategy="SPREAD")
            for name, pool in self.pools.items():
                if not pool.wait(config.start_timeout):
                    raise ExecutorError(f"Ray could not reserve the {name} pool ({len(pool.bundle_specs)} × "
                                        f"{pool.bundle_specs[0]}) within {config.start_timeout:.0f} s: not enough "
                                        "resources in the cluster")

            self._bundle = bundle
            built = rank_step(step_fn)
            on = self._on
            device, threads = config.device, config.threads_per_worker
            concurrency = ENGINES[engine].worker_concurrency  # 2: ``interrupt`` reaches a worker while it generates
            self._new_rollout_worker = lambda i: ray.remote(RolloutWorker).options(
                **on("rollout", i), max_concurrency=concurrency).remote(policy, engine_kwargs, threads, device, engine)
            self.train = [ray.remote(TrainRank).options(**on("train", r)).remote(
                r, config.train_ranks, policy, critic, *built, threads, engine_kwargs if colocated else None,
                device, engine, setup.offload) for r in range(config.train_ranks)]
            self.actors += [(a, f"train rank {r}") for r, a in enumerate(self.train)]
            if colocated:
                self.rollout = self.train
            else:
                self.rollout = [self._new_rollout_worker(i) for i in range(config.rollout_workers)]
                self.actors += [(a, f"rollout worker {i}") for i, a in enumerate(self.rollout)]
            reward_device = "cuda" if config.reward_gpus_per_worker > 0 else "cpu"
            self.reward = [ray.remote(RewardWorker).options(**on("reward", i)).remote(
                reward_model, reward_device, threads, config.reward_batch_size)
                for i in range(config.reward_workers)]
            self.actors += [(a, f"reward worker {i}") for i, a in enumerate(self.reward)]
            self._join_group(self.train, "train rank")
            if reward_model is not None and config.roles["reward_model"] == "reward":
                # each reward worker loads it once, now: a bad folder fails here
                self.wait([(w.load_reward_model.remote(), f"reward worker {i}") for i, w in enumerate(self.reward)],
                          config.start_timeout, "load reward model")
            if reward_model is not None and config.roles["reward_model"] == "train":
                self.host_reward_model(self.train, "train rank", reward_model)
        except BaseException:
            self.close()
            raise

    def _on(self, pool: str, index: int) -> dict[str, Any]:
        """Ray options placing a worker on bundle ``index`` of ``pool``."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        config = self.config
        gpus = config.reward_gpus_per_worker if pool == "reward" else config.gpus_per_worker
        return {"scheduling_strategy": PlacementGroupSchedulingStrategy(self.pools[pool], index),
                "num_cpus": config.cpus_per_worker, "num_gpus": gpus, "max_restarts": 0}

    def _join_group(self, ranks: list[Any], label: str) -> None:
        """Make ``ranks`` one ``torch.distributed`` group of their own."""
        config = self.config
        places = self.wait([(w.place.remote(), f"{label} {r}") for r, w in enumerate(ranks)], config.start_timeout,
                           "start")
        if len({node for node, _, _ in places}) == 1:  # one node: a file rendezvous, collectives on loopback
            self.rendezvous.append(Path(tempfile.gettempdir()) / f"purerl-rendezvous-{uuid.uuid4().hex}")
            init_method = f"file://{self.rendezvous[-1]}"
        else:
            _, host, port = places[0]
            init_method = f"tcp://{host}:{port}"
        collective_timeout = _COLLECTIVE_SHARE * config.step_timeout
        self.wait([(w.init_process_group.remote(init_method, collective_timeout), f"{label} {r}")
                   for r, w in enumerate(ranks)], config.start_timeout, "init_process_group")

    def host_reward_model(self, ranks: list[Any], label: str, path: str) -> None:
        """``ranks`` load the reward model at ``path`` (each once, now: a bad folder fails here)."""
        config = self.config
        self.wait([(w.host_reward_model.remote(path, config.device, config.reward_batch_size), f"{label} {r}")
                   for r, w in enumerate(ranks)], config.start_timeout, "load reward model")

    def start_role_pool(self, pool: str, policy: CausalLM, critic: Critic | None) -> list[Any]:
        """Reserve pool ``pool`` (``critic`` or ``reference``) and start its ranks
        (``executor.critic_workers`` / ``reference_workers``), one group of their own."""
        import ray
        from ray.util.placement_group import placement_group

        config = self.config
        count = config.critic_workers if pool == "critic" else config.reference_workers
        try:
            bundle = {**self._bundle, **config.pool_resources.get(pool, {})}
            self.pools[pool] = group = placement_group([bundle] * count, strategy="PACK")
            if not group.wait(config.start_timeout):
                raise ExecutorError(f"Ray could not reserve the {pool} pool ({count} × {group.bundle_specs[0]}) within "
                                    f"{config.start_timeout:.0f} s: not enough resources in the cluster")
            ranks = [ray.remote(RoleRank).options(**self._on(pool, r)).remote(
                r, count, policy, critic, config.threads_per_worker, config.device, self.offload)
                for r in range(count)]
            self.actors += [(a, f"{pool} rank {r}") for r, a in enumerate(ranks)]
            self._join_group(ranks, f"{pool} rank")
        except BaseException:
            self.close()
            raise
        self.role_ranks[pool] = ranks
        return ranks

    def rollout_label(self, i: int) -> str:
        return f"train rank {i}" if self.config.colocated else f"rollout worker {i}"

    def restart_rollout_worker(self, i: int) -> None:
        """Kill rollout worker ``i`` (if it still runs) and start a new one on its bundle; it holds
        no weights until it is sent a version."""
        import ray

        if self.failure is not None:
            raise ExecutorError(self.failure)
        label = f"rollout worker {i}"
        with self._lock:
            old = self.rollout[i]
            try:
                ray.kill(old, no_restart=True)
            except Exception:  # already gone
                pass
            self.rollout[i] = new = self._new_rollout_worker(i)
            self.actors = [(new, label) if actor is old else (actor, name) for actor, name in self.actors]
        self.wait([(new.pid.remote(), label)], self.config.start_timeout, "restart", fatal=False)

    def wait(self, calls: list[tuple[Any, str]], timeout: float, what: str, *, fatal: bool = True) -> list[Any]:
        """The results of ``calls`` (``(ObjectRef, label)``), failing closed on the first error or
        when ``timeout`` seconds pass.

        After a first failure the other calls get a short grace period, so that when one rank dies
        and its peers then fail in a broken collective, the message names the dead one first. Safe
        to call from several threads: once one call has failed, every wait raises that failure.
        With ``fatal=False`` (calls to workers that can be restarted, e.g. an asynchronous
        generator's rollout workers) a failure raises :class:`ExecutorError` and stops nothing.
        """
        import ray

        if self.failure is not None:
            raise ExecutorError(self.failure)
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
            # deaths first, then the silent (a stopped or hung rank makes its peers fail in a
            # collective: the silent one is the cause), then the other failures
            deaths = [m for died, m in failures if died]
            silent = ([f"{', '.join(labels[r] for r in pending)} did not answer within {timeout:.0f} s"]
                      if pending and not failures else
                      [f"{', '.join(labels[r] for r in pending)} did not answer (stopped or hung?)"] if pending else [])
            messages = list(dict.fromkeys(deaths + silent + [m for died, m in failures if not died]))
            if not fatal:
                raise ExecutorError(f"{what}: {'; '.join(messages)}")
            self.stop(f"{what}: {'; '.join(messages)}; the run is stopped")
            raise ExecutorError(self.failure)
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
            if isinstance(cause, ExecutorError):  # the worker names another that failed (a role's pool rank)
                return True, str(cause)
            return False, f"{label} failed: {type(cause).__name__}: {cause}"

    def stop(self, failure: str) -> None:
        """Record the run's first failure and kill every actor (Ray itself stays up until
        :meth:`close`: another thread may still be waiting on it)."""
        with self._lock:
            if self.failure is None:
                self.failure = failure
        self._kill()

    def _kill(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        with self._lock:
            actors, pools, self.actors, self.pools = self.actors, self.pools, [], {}
        for actor, _ in actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # an actor that is already gone
                pass
        for pool in pools.values():
            try:
                remove_placement_group(pool)
            except Exception:
                pass

    def close(self) -> None:
        """Kill every actor and release the pools (and Ray itself, when these groups started it)."""
        if self._closed:
            return
        self._closed = True
        self._kill()
        for path in self.rendezvous:  # killed ranks never destroy their FileStore, which would remove it
            path.unlink(missing_ok=True)
        if self.owns_ray:
            import ray

            ray.shutdown()
