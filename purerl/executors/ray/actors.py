"""The Ray executor's actors: a training rank, a role's rank, a rollout worker (the reward workers:
:mod:`~.reward_actors`).

Each is a plain class made remote by the executor (``ray.remote(cls)``), so it can also be
built and tested in-process. Everything they receive or return crosses a process boundary as
numpy (:mod:`purerl.executors.wire`).
"""

import os
import socket
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

from purerl.executors.ray.reward_actors import RewardModelHost, RewardWorker, ShippedRewardFn
from purerl.executors.wire import (
    from_wire,
    load_weight_buckets,
    params_digest,
    to_wire,
    weight_buckets,
)
from purerl.models import CausalLM, Critic
from purerl.rollout.engine import make_engine
from purerl.rollout.sampling import SamplingParams
from purerl.state import RngState, TrainState, with_params, without_params
from purerl.tree import replace, tree_map

__all__ = ["Rank", "RewardModelHost", "RewardWorker", "RoleRank", "RolloutWorker", "ShippedRewardFn", "TrainRank"]


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class Rank(RewardModelHost):
    """A member of a ``torch.distributed`` group (the training ranks, or a role's pool)."""

    rank: int
    world: int
    device: str

    def pid(self) -> int:
        return os.getpid()

    def place(self) -> tuple[str, str, int]:
        """Where this rank runs: its Ray node, that node's address, and a free port there."""
        import ray

        ip = ray.util.get_node_ip_address()
        return ray.get_runtime_context().get_node_id(), ip, _free_port(ip)

    def init_process_group(self, init_method: str, timeout_s: float) -> None:
        """Join the group at ``init_method``: a ``file://`` rendezvous when every rank runs on
        this node (nothing listens on the network: collectives on loopback), else ``tcp://``."""
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        if init_method.startswith("file://"):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
            os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
        backend = "nccl" if self.device == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=init_method, rank=self.rank, world_size=self.world,
                                timeout=timedelta(seconds=timeout_s))
        self.mesh = init_device_mesh(self.device, (self.world,))

    def _here(self, wire: Any) -> Any:
        """A tree from the wire, its tensors on this rank's device."""
        return tree_map(lambda x: x.to(self.device) if isinstance(x, torch.Tensor) else x, from_wire(wire))

    def _gathered(self, tree: Any) -> Any:
        """``tree`` with full tensors, on the wire from rank 0 (None elsewhere; every rank must call it)."""
        from purerl.executors.fsdp import is_sharded

        full = tree_map(lambda x: x.full_tensor().detach() if is_sharded(x)
                        else x.detach() if isinstance(x, torch.Tensor) else x, tree)
        return to_wire(full) if self.rank == 0 else None

    def host_reward_model(self, path: str, device: str, batch_size: int) -> None:
        """Host the reward model at ``path`` too (loaded now: a bad folder fails the start)."""
        self.reward_model_path, self.reward_device, self.reward_batch_size = path, device, batch_size
        self.load_reward_model()


    def _sharded_reference(self, params: Any) -> tuple[Any, Any]:
        """The frozen reference sharded over this group (in host memory between uses under params
        offload): the model that computes it and its params (:func:`~purerl.executors.fsdp.sharded_model`)."""
        from purerl.executors.fsdp import sharded_model

        return sharded_model(self.skeleton, self.mesh, params, trainable=False, offload=self.offload.params)

    def host_teacher(self, skeleton: CausalLM, wire_params: Any, vocab: int | None = None) -> None:
        """Hold a distillation teacher: its frozen params sharded over this group, its forwards split by
        rows like the reference's (:class:`~purerl.step.roles.LocalTeacher`)."""
        from purerl.executors.fsdp import sharded_model
        from purerl.step.roles import LocalTeacher

        model, params = sharded_model(skeleton, self.mesh, from_wire(wire_params), trainable=False,
                                      offload=self.offload.params)
        self.teacher = LocalTeacher(model, params, vocab)

    def teacher_scores(self, seqs: Any, temperature: float, batching: Any, top_k: int | None) -> Any:
        """The hosted teacher's scores of ``seqs`` (:func:`~purerl.step.experience.teacher_scores`)."""
        out = self.teacher.scores(self._here(seqs), temperature=temperature, batching=batching, top_k=top_k)
        return to_wire(out) if self.rank == 0 else None

    def _sharded_critic(self, params: Any, where: str) -> tuple[Any, Any]:
        """The critic sharded like the policy: its sharded model and params
        (:func:`~purerl.executors.fsdp.sharded_critic`). ``where`` names who was given critic params without a
        critic model, for the error."""
        from purerl.executors.fsdp import sharded_critic

        if self.critic_skeleton is None:
            raise ValueError(f"{where} was given critic params but no critic model")
        return sharded_critic(self.critic_skeleton, self.mesh, params, offload=self.offload.params)


class TrainRank(Rank):
    """One training rank: sharded params, the step function, optionally an engine (colocated),
    and the roles the placement puts on other pools (:meth:`attach_roles`)."""

    def __init__(self, rank: int, world: int, policy: CausalLM, critic: Critic | None, step_fn: Callable,
                 build: bool, threads: int, engine_kwargs: dict[str, Any] | None, device: str,
                 engine: str = "torch", offload: Any = None) -> None:
        from purerl.executors.fsdp import Offload

        torch.set_num_threads(threads)
        self.rank, self.world, self.skeleton, self.critic_skeleton, self.device = rank, world, policy, critic, device
        self.offload = offload or Offload()
        self.step_fn = step_fn() if build else step_fn
        self.engine = make_engine(engine, policy, device=device, **engine_kwargs) if engine_kwargs is not None else None
        self.state: TrainState | None = None
        self.remote_roles: dict[str, Any] = {}
        self.teacher = None  # a distillation teacher these ranks hold (host_teacher)

    def rebind(self, step_fn: Callable, build: bool) -> None:
        """The step function from the next step on (``build``: ``step_fn`` builds it)."""
        self.step_fn = step_fn() if build else step_fn

    def attach_roles(self, pools: dict[str, list[Any]], timeout_s: float) -> None:
        """The critic, the reference and/or a distillation teacher live on ``pools`` (``{role: [rank
        handles], …}``): the step function gets roles that run their stages there (rank 0 calls,
        every rank gets the result)."""
        from purerl.executors.ray.roles import RemoteCritic, RemoteReference, RemoteTeacher

        kinds = {"critic": RemoteCritic, "reference": RemoteReference, "teacher": RemoteTeacher}
        self.remote_roles = {name: kinds[name](ranks, self.rank, self.device, timeout_s)
                             for name, ranks in pools.items()}

    def load(self, wire_state: Any) -> None:
        """Shard a full state: policy, reference and critic through FSDP2, each optimizer state
        like its params."""
        from purerl.executors.fsdp import ShardedCausalLM, shard_like, sharded_model, sharded_value_and_grad

        state = from_wire(wire_state)
        self.model, params = sharded_model(self.skeleton, self.mesh, state.policy, offload=self.offload.params)
        reference = state.reference  # a LoRA policy's is {}: its own base, adapters off
        if state.reference:
            reference_model, reference = self._sharded_reference(state.reference)
            if isinstance(self.model, ShardedCausalLM):  # one model runs the FSDP2 module that owns the params
                self.model = ShardedCausalLM.of(self.skeleton, [(self.model.owner(params), params),
                                                               (reference_model.owner(reference), reference)])
        changes = dict(policy=params, policy_opt=shard_like(state.policy_opt, params), reference=reference)
        self.critic = None
        if state.critic is not None:
            self.critic, critic = self._sharded_critic(state.critic, "the executor")
            changes.update(critic=critic, critic_opt=shard_like(state.critic_opt, critic))
        self.state = self._optimizers_to("cpu", replace(state, **changes))
        self.value_and_grad = sharded_value_and_grad(self.rank, self.world)

    def _optimizers_to(self, device: str, state: TrainState) -> TrainState:
        """With optimizer offload, ``state`` with its optimizer states on ``device``."""
        from purerl.executors.fsdp import moved

        if not self.offload.optimizer:
            return state
        return replace(state, policy_opt=moved(state.policy_opt, device), critic_opt=moved(state.critic_opt, device))

    def step(self, small: Any, batch: Any) -> tuple[Any, dict[str, float]]:
        """``small``: the driver's state; ``batch``: ``(rollout, scores)``, the same on every rank."""
        small, (rollout, scores) = self._here((small, batch))
        effects = dict(policy=self.model, value_and_grad=self.value_and_grad)
        if self.critic is not None:
            effects["critic"] = self.critic
        if self.teacher is not None:
            effects["teacher"] = self.teacher
        effects.update(self.remote_roles)
        state = self._optimizers_to(self._params_device(), with_params(small, self.state))
        state, metrics = self.step_fn(state, rollout, scores, **effects)
        self.state = self._optimizers_to("cpu", state)
        return to_wire(without_params(self.state)), metrics

    def _params_device(self) -> str:
        """Where the policy's shards are (the host under params offload): the optimizer steps there."""
        return "cpu" if self.offload.params else self.device

    def full_state(self) -> Any:
        """The whole state with full tensors (all ranks must call it; rank 0 returns it)."""
        return self._gathered(self._optimizers_to(self._params_device(), self.state))  # collectives on the device

    def publish_weights(self, version: int, bucket_bytes: int, checksum: bool) -> list[Any] | None:
        """Gather the policy and put it in Ray's object store as weight buckets (all ranks must
        call it). Rank 0 returns ``[ref]``: a reference the driver passes on without fetching."""
        import ray

        from purerl.executors.fsdp import full_params

        full = full_params(self.state.policy)
        if self.rank != 0:
            return None
        return [ray.put(weight_buckets(full, version, bucket_bytes=bucket_bytes, checksum=checksum))]

    def sync_engine(self, version: int, checksum: bool) -> str | None:
        """Colocated: the local engine gets the gathered weights (all ranks call it); with
        ``checksum``, returns their sha256."""
        from purerl.executors.fsdp import full_params

        full = full_params(self.state.policy)
        self.engine.sync(full, version)
        return params_digest(full) if checksum else None

    def generate(self, prompts: list[list[int]], sampling: SamplingParams, rng: RngState, version: int,
                 streams: list[int] | None = None) -> Any:
        return to_wire(self.engine.generate(prompts, sampling, rng, version=version, streams=streams))


class RoleRank(Rank):
    """One rank of a pool that holds a role apart from the actor: the critic (values, updates),
    the reference (log-probs) and, where the placement says so, the reward model
    (:meth:`host_reward_model`). The ranks of a pool shard their params with FSDP2 and split each
    batch's rows, like the training ranks; every rank of the pool is called, rank 0 answers."""

    def __init__(self, rank: int, world: int, policy: CausalLM, critic: Critic | None, threads: int,
                 device: str, offload: Any = None) -> None:
        from purerl.executors.fsdp import Offload

        torch.set_num_threads(threads)
        self.rank, self.world, self.device = rank, world, device
        self.skeleton, self.critic_skeleton = policy, critic
        self.offload = offload or Offload()
        self.held: dict[str, Any] = {}  # "critic", "critic_opt", "reference": this pool's part of the state

    def load(self, wire_params: Any) -> None:
        """Shard this pool's part of the state: ``{"critic": params, "critic_opt": state}`` and/or
        ``{"reference": params}``."""
        from purerl.executors.fsdp import moved, shard_like, sharded_value_and_grad

        parts = from_wire(wire_params)
        if "critic" in parts:
            self.critic, params = self._sharded_critic(parts["critic"], "the critic's pool")
            opt_state = shard_like(parts["critic_opt"], params)
            self.held.update(critic=params, critic_opt=moved(opt_state, "cpu") if self.offload.optimizer else opt_state)
        if "reference" in parts:
            self.reference, self.held["reference"] = self._sharded_reference(parts["reference"])
        self.value_and_grad = sharded_value_and_grad(self.rank, self.world)

    def values(self, seqs: Any, batching: Any) -> Any:
        """The critic's values of ``seqs`` (:func:`~purerl.step.experience.critic_values`)."""
        from purerl.step.experience import critic_values

        out = critic_values(self.critic, self.held["critic"], self._here(seqs), batching=batching)
        return to_wire(out) if self.rank == 0 else None

    def update_critic(self, batch: Any, optimizer: Any, loss: Any, batching: Any, rng: RngState) -> dict[str, float]:
        """One critic update on the shaped ``batch`` with the step's ``optimizer``, ``loss`` and
        ``batching``; its metrics."""
        from purerl.executors.fsdp import moved
        from purerl.step.update import critic_update

        opt_state = self.held["critic_opt"]
        if self.offload.optimizer:  # in host memory between updates; the update runs where the params are
            opt_state = moved(opt_state, "cpu" if self.offload.params else self.device)
        params, opt_state, metrics = critic_update(self.held["critic"], opt_state, self._here(batch),
                                                   critic=self.critic, loss=loss, batching=batching,
                                                   optimizer=optimizer, rng=rng, value_and_grad=self.value_and_grad)
        self.held.update(critic=params, critic_opt=moved(opt_state, "cpu") if self.offload.optimizer else opt_state)
        return metrics

    def reference_logprobs(self, seqs: Any, temperature: float, batching: Any) -> Any:
        """Log-probs of ``seqs``' responses under the reference at ``temperature``
        (:func:`~purerl.step.experience.reference_logprobs`)."""
        from purerl.step.experience import reference_logprobs

        out = reference_logprobs(self.reference, self.held["reference"], self._here(seqs), temperature=temperature,
                                 batching=batching)
        return to_wire(out) if self.rank == 0 else None

    def full_state(self) -> Any:
        """This pool's part of the state with full tensors (all ranks must call it; rank 0 returns it)."""
        return self._gathered(self.held)


class RolloutWorker:
    """A rollout worker: a rollout engine (built by name) fed by weight sync."""

    def __init__(self, policy: CausalLM, engine_kwargs: dict[str, Any], threads: int, device: str,
                 engine: str = "torch") -> None:
        torch.set_num_threads(threads)
        self.engine = make_engine(engine, policy, device=device, **engine_kwargs)
        self.policy, self.device = policy, device
        self.names: set[str] | None = None
        self.slowdown, self.scrambled = 1.0, 1.0
        self.calls: set[int] = set()  # generate calls to interrupt (the actor runs two methods at once)

    def pid(self) -> int:
        return os.getpid()

    def straggle(self, factor: float) -> None:
        """Fault injection for benchmarks and tests: each ``generate`` call then takes ``factor``
        times its compute time (it sleeps the rest), as on a slower device."""
        self.slowdown = float(factor)

    def scramble(self, factor: float) -> None:
        """Fault injection for tests: each later load scales the first matrix by ``factor`` on its way
        into the engine, as a sync that corrupts a tensor would (the weight-sync canary must see it)."""
        self.scrambled = float(factor)

    def load_weights(self, version: int, buckets: list[Any], canary: bool = False) -> tuple[str | None, float | None]:
        """Load synced weights (each bucket's checksum verified when it has one); returns the
        sha256 of all of them in checksum mode, and with ``canary`` the engine's canary gap to a
        forward of the params as they arrived (:meth:`~purerl.rollout.canary.Canary.gap`)."""
        from purerl.rollout.canary import Canary

        params = load_weight_buckets(buckets, version, self.names, device=self.device)
        self.names = set(params)
        if self.scrambled != 1.0:
            name = next(n for n, p in params.items() if p.ndim == 2)
            self.engine.sync({**params, name: params[name] * self.scrambled}, version)
        else:
            self.engine.sync(params, version)
        gap = Canary(self.policy).gap(self.engine, params, version) if canary else None
        return (params_digest(params) if buckets[0].sha256 is not None else None), gap

    def generate(self, prompts: list[list[int]], sampling: SamplingParams, rng: RngState, version: int,
                 streams: list[int] | None = None, samples: list[int] | None = None, start: int = 0,
                 call: int | None = None) -> Any:
        began = time.perf_counter()
        options: dict[str, Any] = {} if call is None else {"interrupt": lambda: call in self.calls}
        if samples is not None or start:  # a continued row (engines that cannot continue never get one)
            options.update(samples=samples, start=start)
        try:
            rollout = to_wire(self.engine.generate(prompts, sampling, rng, version=version, streams=streams,
                                                   **options))
        finally:
            self.calls.discard(call)
        if self.slowdown > 1.0:
            time.sleep((self.slowdown - 1.0) * (time.perf_counter() - began))
        return rollout

    def interrupt(self, call: int) -> None:
        """Stop the open rows of generate call ``call`` (a late signal names a call that has ended:
        call ids are never reused, so it changes nothing)."""
        self.calls.add(call)
