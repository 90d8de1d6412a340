"""Training ranks under FSDP2: the state's params *are* FSDP's sharded parameters; gradients are an effect.

FSDP2 (``fully_shard``) and ``functional_call`` do not compose: swapped-in params are silently
ignored and gradients arrive only through ``.backward()`` into sharded ``.grad``. So on a training
rank:

- :func:`shard_causal_lm` builds a real module from a :class:`~purerl.models.CausalLM` skeleton and
  a full params tree, shards it, and returns its own sharded parameters (``DTensor``) as the params
  tree. Donated optimizer updates modify those very tensors in place, so FSDP keeps seeing them.
- :class:`ShardedCausalLM` stands in for the skeleton in the pure stages: called with a params
  tree, it runs the sharded module that *owns* those tensors (the policy's or the reference's) and
  refuses any other tree, instead of silently computing with the wrong weights.
- :func:`sharded_value_and_grad` is the data-parallel ``value_and_grad``: every rank holds the
  whole micro-batch, differentiates the loss of its own rows (``rank::world``) with ``.backward()``
  (FSDP reduce-scatters the mean over ranks), and all-reduces the loss and aux ``SumCount``s so
  every rank sees the exact global values. Gradients come back as the sharded ``.grad`` tensors.

Forwards without gradients (old and reference log-probs) go through
:meth:`ShardedCausalLM.map_rows`: each rank computes its rows and all-gathers the result.
Everything else in a step (advantages, KL control, metrics, the rejection decision) runs on the
whole batch on every rank, so the ranks stay identical without extra collectives.
"""

import contextlib
import copy
import functools
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import torch
import torch.distributed as dist
from torch import Tensor, nn

from purerl.algo.aggregation import SumCount
from purerl.batch import Sequences
from purerl.models import CausalLM, Critic, LayerCheckpoint, Params
from purerl.models.lora import adapters_off
from purerl.tree import tree_flatten, tree_map, tree_unflatten

__all__ = [
    "Offload",
    "ShardedCausalLM",
    "ShardedCritic",
    "full_params",
    "is_sharded",
    "map_rows_data_parallel",
    "moved",
    "shard_causal_lm",
    "shard_like",
    "shard_module",
    "sharded_value_and_grad",
]


def is_sharded(x: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(x, DTensor)


def _decoder_layers(module: nn.Module) -> list[nn.Module]:
    """The transformer blocks (the first ``….layers`` ModuleList), each its own FSDP unit."""
    for name, child in module.named_modules():
        if name.rpartition(".")[2] == "layers" and isinstance(child, nn.ModuleList):
            return list(child)
    return []


def _materialise(skeleton: nn.Module, params: Params, buffers: dict[str, Tensor], aliases: dict[str, str],
                 device: torch.device) -> nn.Module:
    """A real copy of a meta skeleton holding ``params`` and ``buffers`` (ties kept), each
    parameter in its tensor's dtype (a frozen bfloat16 reference or LoRA base stays narrow)."""
    module = copy.deepcopy(skeleton).to_empty(device=device)
    for alias, canonical in aliases.items():  # to_empty unties; tie again
        parent, _, leaf = alias.rpartition(".")
        setattr(module.get_submodule(parent), leaf, module.get_parameter(canonical))
    with torch.no_grad():
        for name, tensor in params.items():
            param = module.get_parameter(name)
            if param.dtype != tensor.dtype:
                param.data = param.data.to(tensor.dtype)
            param.copy_(tensor)
        for name, tensor in buffers.items():
            module.get_buffer(name).copy_(tensor)
    for p in module.parameters():
        p.requires_grad_(True)
    for sub in module.modules():
        # activation checkpointing: FSDP's own hooks re-gather the params when a layer recomputes,
        # so the skeleton's re-binding (which would reuse freed unsharded storage) goes
        if isinstance(sub.__dict__.get("forward"), LayerCheckpoint):
            sub.forward = LayerCheckpoint(sub, rebind=False)
    return module


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


def shard_module(skeleton: nn.Module, params: Params, *, mesh: Any, buffers: dict[str, Tensor] | None = None,
                 aliases: dict[str, str] | None = None, trainable: bool = True,
                 offload: bool = False, compute_dtype: torch.dtype | None = None) -> tuple[nn.Module, Params]:
    """Materialise ``params`` in a copy of ``skeleton`` and ``fully_shard`` it over ``mesh`` (each
    decoder layer, then the root). Returns the module and its sharded params tree, keyed by the
    same names as ``params``. ``offload``: the shards live in host memory (``CPUOffloadPolicy``).
    ``compute_dtype`` (mixed precision): the shards stay the params' dtype (float32 masters), the
    all-gathered weights the forwards compute with are cast to it, gradients are reduced in float32
    (``MixedPrecisionPolicy``)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    module = _materialise(skeleton, params, buffers or {}, aliases or {}, torch.device(mesh.device_type))
    policy = {"offload_policy": CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda")} if offload else {}
    if compute_dtype is not None:
        policy["mp_policy"] = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    for layer in _decoder_layers(module):
        fully_shard(layer, mesh=mesh, **policy)
    fully_shard(module, mesh=mesh, **policy)
    if not trainable:
        for p in module.parameters():
            p.requires_grad_(False)
    sharded = dict(module.named_parameters())
    if set(sharded) != set(params):
        raise ValueError(f"shard_module: sharded names differ from the params tree: "
                         f"{sorted(set(sharded) ^ set(params))[:5]}")
    return module, {name: sharded[name] for name in params}


def shard_causal_lm(model: CausalLM, params: Params, *, mesh: Any, trainable: bool = True,
                    offload: bool = False) -> tuple[nn.Module, Params]:
    """:func:`shard_module` for a causal LM skeleton (its buffers and tied aliases). A LoRA policy's
    module shards its frozen base beside the adapters; only the adapters are returned (and
    trainable): the base gets no gradient."""
    module, sharded = shard_module(model.module, model.full(params), mesh=mesh, buffers=model.buffers,
                                   aliases=model.aliases, trainable=trainable, offload=offload,
                                   compute_dtype=model.compute_dtype)
    if model.lora is None:
        return module, sharded
    for name, p in sharded.items():
        if name not in params:
            p.requires_grad_(False)
    return module, {name: sharded[name] for name in params}


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


def _owners(modules: list[tuple[nn.Module, Params]]) -> dict[int, nn.Module]:
    return {id(next(iter(params.values()))): module for module, params in modules}


def _owner(owners: dict[int, nn.Module], params: Params) -> nn.Module:
    module = owners.get(id(next(iter(params.values()))))
    if module is None:
        raise ValueError("sharded model: these params are not a sharded module's own parameters "
                         "(FSDP2 would silently ignore them); pass the state's sharded params tree")
    return module


def map_rows_data_parallel(fn: Callable[[Sequences], Tensor], seqs: Sequences) -> Tensor:
    """``fn`` on this rank's rows (``rank::world``), all-gathered: every rank gets all rows.
    Every rank runs ``fn`` once (a rank without rows runs row 0 and drops it), so the
    collectives inside a sharded forward stay matched."""
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = torch.arange(rank, len(seqs), world, device=seqs.input_ids.device)
    out = fn(seqs.rows(rows if len(rows) else slice(0, 1)))[: len(rows)]
    per_rank = -(-len(seqs) // world)
    padded = out.new_zeros((per_rank, *out.shape[1:]))
    padded[: len(out)] = out
    gathered = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(gathered, padded)
    result = out.new_empty((len(seqs), *out.shape[1:]))
    for r, part in enumerate(gathered):
        result[r::world] = part[: len(range(r, len(seqs), world))]
    return result


@attrs.frozen(eq=False)
class ShardedCausalLM(CausalLM):
    """A :class:`CausalLM` whose params are FSDP's: ``owners`` maps the id of each sharded module's
    first parameter to the module. ``module``, ``buffers`` and ``aliases`` keep the skeleton's."""

    owners: dict[int, nn.Module] = attrs.field(factory=dict)

    @classmethod
    def of(cls, model: CausalLM, modules: list[tuple[nn.Module, Params]]) -> "ShardedCausalLM":
        """``modules``: the policy's ``(module, params)`` first (with LoRA, the params ``{}``, the
        reference, run it with its adapters off)."""
        return cls(model.module, model.buffers, model.aliases, model.config, model.checkpointed,
                   lean=False, lora=model.lora, packed=model.packed,
                   owners=_owners(modules))  # lean: FSDP's modules gather the shards

    @contextlib.contextmanager
    def bind(self, params: Params) -> Iterator[nn.Module]:
        if self.lora is not None and not params:
            with adapters_off():
                yield next(iter(self.owners.values()))
        else:
            yield _owner(self.owners, params)

    def __call__(self, params: Params, **kwargs: Any) -> Any:
        with self.bind(params) as module:
            return module(**kwargs)

    def map_rows(self, fn: Callable[[Sequences], Tensor], seqs: Sequences) -> Tensor:
        return map_rows_data_parallel(fn, seqs)

    @property
    def shares_prompts(self) -> bool:
        return False  # one FSDP forward per micro-batch: a second one before backward is untested


@attrs.frozen(eq=False)
class ShardedCritic(Critic):
    """A :class:`Critic` whose params are FSDP's (see :class:`ShardedCausalLM`)."""

    owners: dict[int, nn.Module] = attrs.field(factory=dict)

    @classmethod
    def of(cls, critic: Critic, modules: list[tuple[nn.Module, Params]]) -> "ShardedCritic":
        return cls(critic.module, critic.buffers, packed=critic.packed, owners=_owners(modules))

    def __call__(self, params: Params, *args: Any) -> Tensor:
        return _owner(self.owners, params)(*args)

    def map_rows(self, fn: Callable[[Sequences], Tensor], seqs: Sequences) -> Tensor:
        return map_rows_data_parallel(fn, seqs)


def full_params(params: Params) -> dict[str, Tensor]:
    """Every leaf gathered to a full plain tensor (a collective: all ranks must call it)."""
    return {name: (p.full_tensor() if is_sharded(p) else p).detach() for name, p in params.items()}


def _all_reduce_sums(tree: Any) -> Any:
    """Sum every tensor leaf over ranks (one collective for the whole tree)."""
    leaves, treedef = tree_flatten(tree)
    flat = torch.stack([x.detach().to(torch.float64).reshape(()) for x in leaves])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    return tree_unflatten([v.to(x.dtype) for v, x in zip(flat.unbind(0), leaves)], treedef)


def sharded_value_and_grad(rank: int, world: int) -> Callable:
    """The data-parallel ``value_and_grad`` for :func:`purerl.step.actor_update` / ``critic_update``.

    ``wrapped(params, batch, *, denominator)``: ``batch`` (a pytree with ``rows``) is the whole
    micro-batch, the same on every rank; ``denominator`` is the whole mini-batch's loss count.
    This rank backpropagates ``world · total(own rows) / denominator``; FSDP's reduce-scatter
    averages over ranks, so the sharded gradients are those of ``total(all rows) / denominator``,
    exactly what the single-process ``value_and_grad`` gives. A rank with no rows (a micro-batch
    smaller than the world) runs row 0 with weight 0, so every rank joins every collective.
    """

    def value_and_grad(loss_fn: Callable[..., tuple[SumCount, Any]]) -> Callable[..., tuple[SumCount, Any, Any]]:
        @functools.wraps(loss_fn)
        def wrapped(params: Params, batch: Any, *args: Any, denominator: Tensor | float | None = None,
                    **kwargs: Any) -> tuple[SumCount, Any, Params]:
            rows = torch.arange(rank, len(batch.sequences), world, device=batch.sequences.input_ids.device)
            weight = 1.0 if len(rows) else 0.0
            mine = batch.rows(rows if len(rows) else slice(0, 1))
            with torch.enable_grad():
                loss, aux = loss_fn(params, mine, *args, **kwargs)
                if denominator is None:
                    denominator = _all_reduce_sums(loss.count.detach() * weight)
                (loss.total * (weight * world / denominator)).backward()
            grads = {}
            for name, p in params.items():
                grads[name] = p.grad if p.grad is not None else torch.zeros_like(p)
                p.grad = None
            local = tree_map(lambda x: x.detach() * weight, (loss, aux))
            loss, aux = _all_reduce_sums(local)
            return loss, aux, grads

        return wrapped

    return value_and_grad
