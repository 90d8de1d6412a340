"""The Ray executor: the executor interface over the worker groups, and the driver's view of the
rollout workers as one rollout engine."""

import contextlib
import itertools
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import attrs
import numpy as np
import torch

from purerl.batch import Rewards, Rollout
from purerl.config.execution import ExecutorConfig
from purerl.executors.base import EngineSlot, ExecutorError, Roles
from purerl.executors.ray.actors import ShippedRewardFn
from purerl.executors.ray.config import RaySetup, StepFactory, rank_step
from purerl.executors.ray.pools import WorkerGroups
from purerl.executors.ray.weights import load_published, publish, sync_colocated
from purerl.executors.wire import from_wire, to_wire
from purerl.models import CausalLM
from purerl.rewards import RewardFn, Scores, score_responses
from purerl.rewards.model import RewardModel
from purerl.rewards.scoring import check_score_inputs
from purerl.rollout.engines import ENGINES
from purerl.rollout.merge import concat_rollouts, prompt_shards
from purerl.rollout.queue import Published, Weights
from purerl.rollout.sampling import SamplingParams
from purerl.state import RngState, TrainState, with_params, without_params
from purerl.step.recipes import StepFn
from purerl.tree import replace

__all__ = ["RayExecutor", "RaySetup", "StepFactory"]


_CALLS = itertools.count()
# a training rank waiting on a role's pool gives up before the driver's step deadline, so the
# driver hears which pool rank failed rather than a silent training rank
_ROLE_SHARE = 0.7


@contextlib.contextmanager
def _interrupting(workers: list[Any], call: int | None, interrupt: Callable[[], bool] | None) -> Iterator[None]:
    """While entered, poll ``interrupt`` (now, then every 50 ms) and, once it is True, tell ``workers`` to
    stop their open rows of generate call ``call``."""
    if interrupt is None:
        yield
        return
    done = threading.Event()

    def watch() -> None:
        while not interrupt():
            if done.wait(0.05):
                return
        for worker in workers:
            worker.interrupt.remote(call)

    watcher = threading.Thread(target=watch, name="purerl-interrupt", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join()


class RemoteEngine:
    """The driver's view of rollout workers ``workers`` (indices into the rollout group), with the
    :class:`RolloutEngine` interface: ``generate`` shards the prompts over them; they hold the
    weights the executor loaded (:meth:`RayExecutor.engine`). ``fatal``: a failed call stops the
    whole executor (else it only raises: an asynchronous generator's workers are restarted)."""

    def __init__(self, executor: "RayExecutor", pad_token_id: int, workers: Sequence[int], fatal: bool = True,
                 generator: int = 0) -> None:
        self.executor, self.pad_token_id, self.workers, self.fatal = executor, pad_token_id, list(workers), fatal
        self.generator = generator
        self.version: int | None = None
        self.kind = executor.engine_kind  # what its workers' engines can do (stop and continue rows, …)
        self.device = torch.device("cpu")  # the workers' rollouts come back on the host

    def sync(self, params: Any, version: int) -> None:
        raise TypeError("RemoteEngine: its weights are loaded by the Ray executor (RayExecutor.engine), "
                        "never passed in from the driver")

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, rng: RngState,
                 *, version: int | None = None, streams: Sequence[int] | None = None,
                 interrupt: Callable[[], bool] | None = None, samples: Sequence[int] | None = None,
                 start: int = 0) -> Rollout:
        """Each worker samples its shard of the prompts with the same ``rng`` and the shard's
        streams: the samples do not depend on the number of workers. ``interrupt`` is polled on
        the driver; once True, the workers are told to stop their open rows."""
        ex = self.executor
        version = self.version if version is None else version
        streams = list(range(len(prompts)) if streams is None else streams)
        shards = prompt_shards(len(prompts), len(self.workers))
        call = None if interrupt is None else next(_CALLS)
        # only a continued or interruptible call names the extras (colocated ranks take neither)
        extra = lambda sl: {} if call is None and samples is None and not start else {  # noqa: E731
            "samples": None if samples is None else list(samples[sl]), "start": start, "call": call}
        calls = [(ex.rollout[i].generate.remote([list(p) for p in prompts[sl]], sampling, rng, version, streams[sl],
                                                **extra(sl)), ex.groups.rollout_label(i))
                 for i, sl in zip(self.workers, shards)]
        with _interrupting([ex.rollout[i] for i, _ in zip(self.workers, shards)], call, interrupt), \
                ex.marking_broken(self):
            parts = ex.groups.wait(calls, ex.generate_timeout or ex.config.step_timeout, "generate", fatal=self.fatal)
        return concat_rollouts([from_wire(p) for p in parts], self.pad_token_id, mixed_versions=True)

    def release(self) -> None:
        """The workers' weights live apart from the trainer's: nothing to free."""

    def close(self) -> None:
        """Nothing of its own: the workers it drives are the executor's, stopped by its ``close``."""


class RayExecutor:
    """Runs a step function on FSDP2 training ranks and generates on rollout workers, over Ray.

    ``step_fn``: the step function, or a :class:`StepFactory` that builds it on each rank.
    ``roles`` (:class:`~purerl.executors.base.Roles`, or a bare policy): the policy is sharded on
    the training ranks; a critic (PPO) shards like it once a state with critic params starts and is
    passed to the step as ``critic=``; a distillation teacher is sharded where the placement puts
    it (the training ranks, or the reference's pool) and passed to the step as ``teacher=``; the
    reward model (a folder) is loaded once by each worker of the pool the placement gives it (with
    no such workers, by the driver on first use); the canary is run by each asynchronous
    generator's rollout workers after every load (:func:`~purerl.executors.ray.weights.load_published`;
    synchronous syncs are checked by the step). ``setup``: the workers' engine, the generators,
    offload (:class:`RaySetup`). ``config``: the job's ``executor`` section (worker counts,
    placement, resources, timeouts); evaluation takes turns with the first generator whose workers
    are not waiting for a restart.

    The driver keeps the small part of the state (:func:`~purerl.state.without_params`); params
    and optimizer states stay on the ranks. Its engine generates on the rollout workers; in
    ``split`` placement a generator thread may drive it while the ranks train
    (:func:`purerl.loop.async_train.train_async`), pulling versions made by :meth:`publish`.
    """

    def __init__(self, step_fn: StepFn | StepFactory, roles: Roles | CausalLM, setup: RaySetup,
                 config: ExecutorConfig = ExecutorConfig(kind="ray")) -> None:
        roles = Roles.of(roles)
        if isinstance(roles.reward_model, RewardModel):
            raise TypeError("RayExecutor: the reward model must be a folder its workers load, not a loaded RewardModel")
        if roles.reward_model is not None:
            roles = attrs.evolve(roles, reward_model=str(roles.reward_model))
        self.config, self.roles, self.engine_kind = config, roles, ENGINES[setup.engine]
        self.reward_model = roles.reward_model
        self.canary = roles.canary if setup.generators >= 1 else None  # synchronous syncs: the step checks them
        self.generate_timeout = setup.generate_timeout
        self.groups = WorkerGroups(config, roles, step_fn, setup)
        self.train, self.rollout, self.reward = self.groups.train, self.groups.rollout, self.groups.reward
        pad, generators = setup.engine_kwargs["pad_token_id"], setup.generators
        if generators > len(self.rollout):
            self.close()
            raise ValueError(f"RayExecutor: {generators} generators need as many rollout workers, it has "
                             f"{len(self.rollout)}")
        self.slots = ([EngineSlot(RemoteEngine(self, pad, range(len(self.rollout))), self._load)] if generators < 1
                      else [EngineSlot(RemoteEngine(self, pad, range(len(self.rollout))[sl], fatal=False, generator=g),
                                       self._load)
                            for g, sl in enumerate(prompt_shards(len(self.rollout), generators))])
        self.broken: set[int] = set()  # generators whose workers failed and are not restarted yet
        self.remote_parts: set[str] = set()  # the state's parts on pools of their own ("critic", "reference")
        self._published = Published()
        self.last_sync_digests: list[str | None] = []  # per rollout engine, in checksum mode
        self.driver_reward_model: RewardModel | None = None  # with no reward workers, loaded on first use

    def wait(self, calls: list[tuple[Any, str]], timeout: float, what: str) -> list[Any]:
        """:meth:`WorkerGroups.wait`: results, or :class:`ExecutorError` naming the worker."""
        return self.groups.wait(calls, timeout, what)

    def worker_pids(self) -> dict[str, int]:
        """``{"train rank 0": pid, …, "rollout worker 0": pid}``."""
        actors = list(self.groups.actors)
        pids = self.wait([(a.pid.remote(), label) for a, label in actors], self.config.start_timeout, "pid")
        return {label: pid for (_, label), pid in zip(actors, pids)}

    def close(self) -> None:
        """Kill every actor and release the pools (and Ray itself, when this executor started it)."""
        self.groups.close()

    def __enter__(self) -> "RayExecutor":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---- the executor interface -----------------------------------------------------------------
    def start(self, state: TrainState) -> TrainState:
        """Send the full ``state`` to where its parts live (the training ranks shard the policy;
        the critic's and the reference's pools, when the placement has them, start now and shard
        theirs) and publish its policy; the driver keeps the rest. Each start begins a run on the
        same workers: the versions published before are forgotten, and every engine loads the new
        run's weights when it is first used."""
        import ray

        self._published = Published()
        for slot in self.slots:
            slot.restart(lambda engine: None)  # nothing to restart: it only holds no version now

        roles, parts = self.config.roles, {}
        if roles["critic"] == "critic" and state.critic is not None:
            parts["critic"] = {"critic": state.critic, "critic_opt": state.critic_opt}
            state = replace(state, critic=None, critic_opt=None)
        if roles["reference"] == "reference" and state.reference:
            parts["reference"] = {"reference": state.reference}
            state = replace(state, reference=None)
        teacher_pool = roles["teacher"] if self.roles.teacher is not None else None
        rm_pool = roles["reward_model"] if self.reward_model is not None else None
        for pool in ("critic", "reference"):
            if (pool in parts or pool in (rm_pool, teacher_pool)) and pool not in self.groups.role_ranks:
                ranks = self.groups.start_role_pool(pool, self.roles.policy, self.roles.critic)
                if rm_pool == pool:
                    self.groups.host_reward_model(ranks, f"{pool} rank", self.reward_model)
        for pool, part in parts.items():
            ref = ray.put(to_wire(part))
            self.wait([(w.load.remote(ref), f"{pool} rank {r}") for r, w in enumerate(self.groups.role_ranks[pool])],
                      self.config.start_timeout, "load state")
        remote = {pool: self.groups.role_ranks[pool] for pool in parts}
        if teacher_pool not in (None, "train"):
            self._host_teacher(self.groups.role_ranks[teacher_pool], f"{teacher_pool} rank")
            remote["teacher"] = self.groups.role_ranks[teacher_pool]
        if remote:
            self.wait([(w.attach_roles.remote(remote, _ROLE_SHARE * self.config.step_timeout), f"train rank {r}")
                       for r, w in enumerate(self.train)], self.config.start_timeout, "attach roles")
        self.remote_parts = set(parts)
        ref = ray.put(to_wire(state))
        self.wait([(w.load.remote(ref), f"train rank {r}") for r, w in enumerate(self.train)],
                  self.config.start_timeout, "load state")
        if teacher_pool == "train":
            self._host_teacher(self.train, "train rank")
        self.publish(state)
        return without_params(state)

    def _host_teacher(self, ranks: list[Any], label: str) -> None:
        """The teacher's skeleton and frozen params to ``ranks``, which shard them (once per run)."""
        import ray

        teacher = self.roles.teacher
        skeleton, params, vocab = ray.put(teacher.model), ray.put(to_wire(teacher.params)), teacher.vocab
        self.wait([(w.host_teacher.remote(skeleton, params, vocab), f"{label} {r}") for r, w in enumerate(ranks)],
                  self.config.start_timeout, "host teacher")

    def step(self, state: TrainState, rollout: Rollout, rewards: torch.Tensor | Rewards
             ) -> tuple[TrainState, dict[str, float]]:
        import ray

        small, batch = ray.put(to_wire(without_params(state))), ray.put(to_wire((rollout, rewards)))
        results = self.wait([(w.step.remote(small, batch), f"train rank {r}")
                             for r, w in enumerate(self.train)], self.config.step_timeout, "step")
        new, metrics = from_wire(results[0][0]), results[0][1]
        for r, (other, _) in enumerate(results[1:], 1):
            if from_wire(other).step != new.step:
                self.groups.stop(f"step: train rank {r} is at step {from_wire(other).step}, rank 0 at {new.step}")
                raise ExecutorError(self.groups.failure)
        self.publish(new)
        return without_params(new), metrics

    def rebind(self, step_fn: StepFn | StepFactory) -> None:
        self.wait([(w.rebind.remote(*rank_step(step_fn)), f"train rank {r}") for r, w in enumerate(self.train)],
                  self.config.start_timeout, "rebind")

    def publish(self, state: TrainState) -> None:
        """The policy at ``state.step``: with split placement, gathered from the shards into Ray's
        object store (the driver holds only a reference) for the rollout workers to load, while the
        ranks go on training; colocated, it stays on the ranks until their engines load it."""
        payload = None if self.config.colocated else publish(self.groups, state.step)
        self._published.publish(Weights(state.step, payload))

    def newest(self, at_least: int = 0, stop: threading.Event | None = None) -> Weights | None:
        return self._published.newest(at_least, stop)

    def engine(self, weights: Weights, purpose: str = "generate",
               generator: int = 0) -> contextlib.AbstractContextManager[RemoteEngine]:
        """The rollout workers of ``generator`` (or, colocated, the ranks' engines) holding
        ``weights``: evaluation takes turns with the first generator whose workers are not
        waiting for a restart."""
        if not 0 <= generator < len(self.slots):
            raise ValueError(f"RayExecutor: generator {generator}, but it has {len(self.slots)} (RaySetup.generators)")
        if purpose != "generate":
            generator = min(set(range(len(self.slots))) - self.broken, default=0)
        return self.slots[generator].use(weights)

    @contextlib.contextmanager
    def marking_broken(self, engine: RemoteEngine) -> Iterator[None]:
        """While entered, a failure of ``engine``'s (restartable) workers marks its generator broken."""
        try:
            yield
        except ExecutorError:
            if not engine.fatal:
                self.broken.add(engine.generator)
            raise

    def reload(self, weights: Weights, generator: int = 0) -> None:
        self.slots[generator].load_held(weights)

    def restart_generator(self, generator: int) -> None:
        """Start generator ``generator``'s rollout workers anew; they load the next version it uses."""
        def start(engine: RemoteEngine) -> None:
            for i in engine.workers:
                self.groups.restart_rollout_worker(i)

        self.slots[generator].restart(start)
        self.broken.discard(generator)

    def _load(self, engine: RemoteEngine, weights: Weights) -> None:
        if weights.payload is None:  # colocated: every rank's own engine gets the gathered policy
            self.last_sync_digests = sync_colocated(self.groups, weights.version)
        else:
            with self.marking_broken(engine):
                self.last_sync_digests = load_published(self.groups, weights.payload, engine.workers,
                                                        fatal=engine.fatal, canary=self.canary)
        engine.version = weights.version

    def score(self, fn: RewardFn, responses: Sequence[str], ground_truths: Sequence[str], *,
              timeout: float, penalty: float, data_sources: Sequence[str] | None = None,
              extra_infos: Sequence[dict] | None = None, batch_timeout: float | None = None) -> Scores:
        """Rewards on the reward workers (contiguous shards), or on the driver when there are none.
        The function travels with the driver's ``sys.path`` (:class:`ShippedRewardFn`)."""
        if not self.reward:
            return score_responses(fn, responses, ground_truths, timeout=timeout, penalty=penalty,
                                   data_sources=data_sources, extra_infos=extra_infos, batch_timeout=batch_timeout)
        import ray

        check_score_inputs(responses, ground_truths, data_sources, extra_infos)  # before sharding them
        fn_ref = ray.put(ShippedRewardFn(fn))
        shards = prompt_shards(len(responses), len(self.reward))
        part = lambda xs, sl: None if xs is None else list(xs[sl])  # noqa: E731
        calls = [(w.score.remote(fn_ref, list(responses[sl]), list(ground_truths[sl]), timeout, penalty, sl.start,
                                 part(data_sources, sl), part(extra_infos, sl), batch_timeout),
                  f"reward worker {i}") for i, (w, sl) in enumerate(zip(self.reward, shards))]
        # each worker ends its shard by its deadlines; the margin covers transfer and start-up
        return Scores.concat(self.wait(calls, 2 * (batch_timeout or timeout) + 30, "reward"))

    def score_model(self, prompts: Sequence[str], responses: Sequence[str]) -> torch.Tensor:
        """The reward model's scores (float32 ``[n]``, in order): contiguous shards on the workers
        of the pool the placement gives it (the reward workers by default, each holding the model);
        with no reward workers, on the driver's CPU (loaded on first use)."""
        if self.reward_model is None:
            raise ValueError("RayExecutor.score_model: no reward model (give Roles(policy, reward_model=path))")
        if len(prompts) != len(responses):
            raise ValueError(f"score_model: {len(prompts)} prompts but {len(responses)} responses")
        pool = self.config.roles["reward_model"]
        hosts = {"reward": self.reward, "train": self.train}.get(pool) or self.groups.role_ranks.get(pool)
        if hosts is None:
            raise ValueError(f"RayExecutor.score_model: the reward model lives on the {pool} pool, started by "
                             "RayExecutor.start")
        if not hosts:
            if self.driver_reward_model is None:
                self.driver_reward_model = RewardModel(self.reward_model)
            return self.driver_reward_model.score(prompts, responses, batch_size=self.config.reward_batch_size)
        label = {"reward": "reward worker", "train": "train rank"}.get(pool, f"{pool} rank")
        shards = prompt_shards(len(prompts), len(hosts))
        calls = [(w.score_model.remote(list(prompts[sl]), list(responses[sl])), f"{label} {i}")
                 for i, (w, sl) in enumerate(zip(hosts, shards))]
        parts = self.wait(calls, self.config.step_timeout, "reward model")
        return torch.from_numpy(np.concatenate(parts)) if parts else torch.zeros(0)

    def full_state(self, state: TrainState) -> TrainState:
        """The full state gathered from the ranks (and from the critic's and the reference's pools),
        with the driver's step, RNG, cursor and KL."""
        parts = self.wait([(w.full_state.remote(), f"train rank {r}") for r, w in enumerate(self.train)],
                          self.config.sync_timeout, "gather state")
        full = from_wire(parts[0])
        for pool in sorted(self.remote_parts):
            ranks = self.groups.role_ranks[pool]
            held = self.wait([(w.full_state.remote(), f"{pool} rank {r}") for r, w in enumerate(ranks)],
                             self.config.sync_timeout, "gather state")
            full = replace(full, **from_wire(held[0]))
        return with_params(state, full)
