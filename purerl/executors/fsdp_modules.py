"""The HF module under FSDP2, for an architecture no lean family computes: FSDP2 (``fully_shard``) owns the
module's parameters, and ``torch.func.functional_call``'s swapped params would be ignored by its hooks, so
:func:`shard_causal_lm` builds and shards a real module whose own sharded parameters become the params tree,
and :class:`ShardedCausalLM` (:class:`ShardedCritic`) runs the module that owns a tree, refusing any other."""

import contextlib
import copy
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import torch
from torch import Tensor, nn

from purerl.batch import Sequences
from purerl.executors.data_parallel import map_rows_data_parallel
from purerl.models import CausalLM, Critic, LayerCheckpoint, Params
from purerl.models.families import computed_by
from purerl.models.lora import adapters_off

__all__ = ["ShardedCausalLM", "ShardedCritic", "shard_causal_lm", "shard_module"]


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


def _owners(modules: list[tuple[nn.Module, Params]]) -> dict[int, nn.Module]:
    return {id(next(iter(params.values()))): module for module, params in modules}


def _owner(owners: dict[int, nn.Module], params: Params) -> nn.Module:
    module = owners.get(id(next(iter(params.values()))))
    if module is None:
        raise ValueError("sharded model: these params are not a sharded module's own parameters "
                         "(FSDP2 would silently ignore them); pass the state's sharded params tree")
    return module


@attrs.frozen(eq=False)
class ShardedCausalLM(CausalLM):
    """A :class:`CausalLM` whose params are FSDP's: ``owners`` maps the id of each sharded module's
    first parameter to the module. ``module``, ``buffers`` and ``aliases`` keep the skeleton's."""

    owners: dict[int, nn.Module] = attrs.field(factory=dict)

    @classmethod
    def of(cls, model: CausalLM, modules: list[tuple[nn.Module, Params]]) -> "ShardedCausalLM":
        """``modules``: the policy's ``(module, params)`` first (with LoRA, the params ``{}``, the
        reference, run it with its adapters off). ``model`` runs its HF module (a lean one is sharded as
        :class:`ShardedLeanLM`)."""
        if model.lean:
            raise ValueError(f"ShardedCausalLM: {computed_by(model)}: shard its params (ShardedLeanLM)")
        return cls(model.module, model.buffers, model.aliases, model.config, model.checkpointed, model.family,
                   model.lean, lora=model.lora, packed=model.packed, owners=_owners(modules))

    def owner(self, params: Params) -> nn.Module:
        """The sharded module that owns ``params``."""
        return _owner(self.owners, params)

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
        if critic.lean:
            raise ValueError("ShardedCritic: a lean family computes this critic's backbone: shard its params "
                             "(ShardedLeanCritic)")
        return cls(critic.module, critic.buffers, critic.packed, critic.compute_dtype, critic.family, critic.lean,
                   owners=_owners(modules))

    def __call__(self, params: Params, *args: Any) -> Tensor:
        return _owner(self.owners, params)(*args)

    def map_rows(self, fn: Callable[[Sequences], Tensor], seqs: Sequences) -> Tensor:
        return map_rows_data_parallel(fn, seqs)
