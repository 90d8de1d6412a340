"""Training ranks: the state's params are shards over the ranks; gradients are an effect.

For a model a lean family computes (every registered architecture), the params tree holds ``DTensor`` shards
(FSDP as a function of sharded params, :mod:`purerl.models.sharding`) and the forwards are the lean family's,
the code the exactness harness checks: :class:`ShardedLeanLM` and :class:`ShardedLeanCritic` read each
weight gathered, and autograd reduce-scatters its gradient onto the shard. Routing replay, packed and
shared-prompt forwards and activation checkpointing run there as in one process.

For an architecture no family computes, the HF module runs under FSDP2 (:mod:`purerl.executors.fsdp_modules`).
:func:`sharded_model` and :func:`sharded_critic` choose.

Every rank holds the whole micro-batch; the data-parallel stages (:mod:`purerl.executors.data_parallel`)
split its rows over the ranks. Everything else in a step (advantages, KL control, metrics, the rejection
decision) runs on the whole batch on every rank, so the ranks stay identical without extra collectives.
Optimizer states are sharded like their params (:func:`shard_like`), and may wait in host memory
(:class:`Offload`).
"""

from collections.abc import Callable
from typing import Any

import attrs
import torch
from torch import Tensor

from purerl.batch import Sequences
from purerl.executors.data_parallel import map_rows_data_parallel, sharded_value_and_grad
from purerl.executors.fsdp_modules import ShardedCausalLM, ShardedCritic, shard_causal_lm, shard_module
from purerl.models import CausalLM, Critic, Params
from purerl.models.families import computed_by
from purerl.models.sharding import Gathered, shard_params
from purerl.tree import tree_map

__all__ = [
    "Offload",
    "ShardedCausalLM",
    "ShardedCritic",
    "ShardedLeanCritic",
    "ShardedLeanLM",
    "full_params",
    "is_sharded",
    "map_rows_data_parallel",
    "moved",
    "shard_causal_lm",
    "shard_like",
    "sharded_critic",
    "sharded_model",
    "shard_module",
    "sharded_value_and_grad",
]


def is_sharded(x: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(x, DTensor)


@attrs.frozen
class Offload:
    """What waits in host memory between uses (verl's ``param_offload``/``optimizer_offload``):
    ``params``, FSDP2's sharded params and gradients (``CPUOffloadPolicy``: the optimizer then
    steps on the host); ``optimizer``, the optimizer state, moved to the params' device for each
    step and back after it (:func:`moved`). Both change where tensors live, never their values."""

    params: bool = False
    optimizer: bool = False


def moved(tree: Any, device: torch.device | str) -> Any:
    """``tree`` with every tensor on ``device`` (a sharded one keeps its mesh and placements; its
    local shard moves). Tensors already there are the same tensors, not copies."""
    from torch.distributed.tensor import DTensor

    # to the host blocking (a pageable host buffer must be complete before anyone reads it); to an
    # accelerator asynchronously, ordered on its stream before the step that reads it
    non_blocking = torch.device(device).type != "cpu"

    def move(x: Any) -> Any:
        if is_sharded(x):
            local = x.to_local()
            there = local.to(device, non_blocking=non_blocking)
            return x if there is local else DTensor.from_local(there, x.device_mesh, x.placements, run_check=False,
                                                               shape=x.shape, stride=x.stride())
        return x.to(device, non_blocking=non_blocking) if isinstance(x, Tensor) else x

    return tree_map(move, tree)


def shard_like(tree: Any, params: Params) -> Any:
    """``tree`` (e.g. an optimizer state) with every params-shaped subtree (a dict with the params'
    keys) distributed like the sharded ``params``, and other tensors moved to their device."""
    names = set(params)
    device = next(iter(params.values())).device

    def shard(sub: Any) -> Any:
        from torch.distributed.tensor import distribute_tensor

        if isinstance(sub, dict) and set(sub) == names:
            return {k: distribute_tensor(v.to(device), params[k].device_mesh, params[k].placements)
                    for k, v in sub.items()}
        return sub.to(device) if isinstance(sub, Tensor) else sub

    return tree_map(shard, tree, is_leaf=lambda x: isinstance(x, dict) and set(x) == names)


@attrs.frozen(eq=False)
class ShardedLeanLM(CausalLM):
    """A lean :class:`CausalLM` whose params tree (and a LoRA policy's frozen base) holds ``DTensor`` shards
    (:func:`purerl.models.sharding.shard_params`): its forwards are the lean family's, reading each weight
    gathered as a layer runs (:class:`~purerl.models.sharding.Gathered`); its row-wise forwards without
    gradients split the rows over the ranks (:meth:`map_rows`). Rows that share a prompt run it once, as in
    one process (the prompt's pass and the responses' each gather the layers' weights)."""

    @classmethod
    def of(cls, model: CausalLM, mesh: Any, params: Params, *, trainable: bool = True,
           offload: bool = False) -> tuple["ShardedLeanLM", Params]:
        """``model`` (lean) and ``params`` sharded over ``mesh``: the model (its frozen base sharded too) and the
        sharded params tree, trainable or frozen (``offload``: in host memory, :func:`shard_params`)."""
        if not model.lean:
            raise ValueError(f"ShardedLeanLM: {computed_by(model)}; shard its HF module (shard_causal_lm)")
        frozen = shard_params(model.frozen, mesh, trainable=False, offload=offload) if model.frozen else {}
        # eager: a compiled graph over the gathers is not what the harness checks
        return _as(cls, attrs.evolve(model, frozen=frozen, compiled=False)), shard_params(
            params, mesh, trainable=trainable, offload=offload)

    def computed(self, params: Params) -> Any:
        return Gathered(self.full(params), self.compute_dtype)

    def map_rows(self, fn: Callable[[Sequences], Tensor], seqs: Sequences) -> Tensor:
        return map_rows_data_parallel(fn, seqs)


def _as(cls: type, instance: Any) -> Any:
    """``instance`` (an attrs record) as its subclass ``cls``, every field the same."""
    return cls(**{f.name: getattr(instance, f.name) for f in attrs.fields(type(instance)) if f.init})


@attrs.frozen(eq=False)
class ShardedLeanCritic(Critic):
    """A lean :class:`Critic` whose params hold ``DTensor`` shards: its backbone a :class:`ShardedLeanLM`, its
    value head gathered too, its row-wise forwards split over the ranks."""

    @classmethod
    def of(cls, critic: Critic, mesh: Any, params: Params, *, trainable: bool = True,
           offload: bool = False) -> tuple["ShardedLeanCritic", Params]:
        if not critic.lean:
            raise ValueError("ShardedLeanCritic: no lean family computes this critic's backbone; shard its HF "
                             "module (shard_module)")
        return _as(cls, critic), shard_params(params, mesh, trainable=trainable, offload=offload)

    def backbone(self) -> CausalLM:
        return _as(ShardedLeanLM, Critic.backbone(self))  # (attrs slots classes lose super()'s cell)

    def head(self, params: Params) -> tuple[Tensor, Tensor]:
        gathered = Gathered(params, self.compute_dtype)
        return gathered["value_head.weight"], gathered["value_head.bias"]

    def map_rows(self, fn: Callable[[Sequences], Tensor], seqs: Sequences) -> Tensor:
        return map_rows_data_parallel(fn, seqs)


def sharded_model(model: CausalLM, mesh: Any, params: Params, *, trainable: bool = True,
                  offload: bool = False) -> tuple[CausalLM, Params]:
    """``params`` sharded over ``mesh`` and the model that computes with them: the lean family's forward
    over the shards (:class:`ShardedLeanLM`), or, for a model no family computes, its FSDP2-sharded HF module
    (:class:`ShardedCausalLM`)."""
    if model.lean:
        return ShardedLeanLM.of(model, mesh, params, trainable=trainable, offload=offload)
    module, sharded = shard_causal_lm(model, params, mesh=mesh, trainable=trainable, offload=offload)
    return ShardedCausalLM.of(model, [(module, sharded)]), sharded


def sharded_critic(critic: Critic, mesh: Any, params: Params, *, offload: bool = False) -> tuple[Critic, Params]:
    """``params`` sharded over ``mesh`` and the critic that computes with them (:class:`ShardedLeanCritic`, or
    the FSDP2-sharded HF module's :class:`ShardedCritic`)."""
    if critic.lean:
        return ShardedLeanCritic.of(critic, mesh, params, offload=offload)
    module, sharded = shard_module(critic.module, params, mesh=mesh, buffers=critic.buffers, offload=offload,
                                   compute_dtype=critic.compute_dtype)
    return ShardedCritic.of(critic, [(module, sharded)]), sharded


def full_params(params: Params) -> dict[str, Tensor]:
    """Every leaf gathered to a full plain tensor (a collective: all ranks must call it)."""
    return {name: (p.full_tensor() if is_sharded(p) else p).detach() for name, p in params.items()}


