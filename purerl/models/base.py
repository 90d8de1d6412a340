"""Hugging Face causal LMs and critics as pure functions of a params tree.

A :class:`CausalLM` is a *resource*, not state: an HF module skeleton on the ``meta`` device (so
it holds no weights of its own), its buffers, and the map from tied alias names to the one
canonical name kept in the params tree (:mod:`purerl.models.hf` makes one from an HF model). The
params (``dict[str, Tensor]``, canonical names only) live in the train state and are swapped in for
each call through ``torch.func.functional_call``.

Pure entry points:
- :func:`response_logits` over :class:`~purerl.batch.Sequences` (the scores read off them:
  :mod:`purerl.models.scores`);
- :func:`response_values` for a :class:`Critic` (HF backbone + scalar value head);
- :func:`value_and_grad` turns ``loss_fn(params, ...) -> (SumCount, aux)`` into a function
  returning ``(loss, aux, grads)`` through ``torch.autograd.grad`` (measured faster and lighter than
  ``torch.func.grad`` on LLMs, and compatible with activation checkpointing).
"""

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import torch
import torch.nn.functional as F
from jaxtyping import Float
from torch import Tensor, nn
from torch.nn.utils import stateless

from purerl.algo.aggregation import SumCount
from purerl.batch import Sequences
from purerl.models import lora
from purerl.models.checkpointing import LayerCheckpoint
from purerl.models.families import Family, family_of
from purerl.models.lora import LoraSpec
from purerl.models.rows import PackedStream, check_rows_kept_apart, packed_stream, shared_prompts
from purerl.tree import tree_flatten, tree_leaves, tree_map, tree_unflatten

__all__ = [
    "Params",
    "cast_floating",
    "CausalLM",
    "Critic",
    "ValueModel",
    "PackedStream",
    "packed_stream",
    "shared_prompts",
    "response_logits",
    "response_values",
    "value_and_grad",
    "full_state_dict",
]

Params = dict[str, Tensor]


def cast_floating(params: Params, dtype: torch.dtype | None) -> Params:
    """``params`` with every floating tensor in ``dtype`` (those already in it, and all of them for
    None, are the same tensors; a cast is differentiable: its gradient arrives in the source dtype)."""
    if dtype is None:
        return params
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in params.items()}


def _checkpointed(model: "CausalLM") -> bool:
    return any(isinstance(m.__dict__.get("forward"), LayerCheckpoint) for m in model.module.modules())


def _cache_keyword(model: "CausalLM") -> str:
    """The name under which the module's ``forward`` takes a KV cache: ``cache`` from transformers
    5.24 on, ``past_key_values`` before (still accepted there, with a deprecation warning)."""
    return "cache" if "cache" in inspect.signature(type(model.module).forward).parameters else "past_key_values"


@attrs.frozen(eq=False)
class CausalLM:
    """An HF causal LM skeleton (meta device), its buffers and its tie map.

    ``aliases`` maps each tied name that is not in the params tree (``lm_head.weight``) to its
    canonical name (``model.embed_tokens.weight``). ``checkpointed``: the module recomputes its
    layers' activations in the backward (:class:`LayerCheckpoint`). ``family``: the lean
    implementation that supports this model (:func:`purerl.models.families.family_of`), if any. ``lean``:
    :func:`response_logits` runs the family's forward instead of the HF module (checkpointing its own
    layers where ``checkpointed``); ``attrs.evolve(model, lean=False)`` forces the module. ``packed``: the training and
    scoring forwards run the rows packed into one stream of their valid tokens, with no compute
    on padding (``actor.packed_forwards``; see :func:`response_logits`). ``cache_keyword``: the
    ``forward`` keyword of a KV cache in the installed transformers (:meth:`cache_arguments`).

    A LoRA policy (:func:`purerl.models.lora.apply_lora`) has ``lora`` set and its frozen base
    weights in ``frozen``: its params trees hold the adapters only, and ``{}`` is the base (the
    reference policy). Every forward reads :meth:`computed` params.

    ``compute_dtype`` (mixed precision, ``model.dtype=bfloat16``): the forwards and backwards run
    in it, on a cast of the params made per forward, while the params tree the state holds (the
    master weights the optimizer updates) keeps its own dtype (float32); gradients arrive in the
    masters' dtype. None: the params' own dtype.

    ``compiled`` (``actor.compile``): a lean family's padded training and scoring forward, the cast
    to ``compute_dtype`` included, runs as one graph compiled by ``torch.compile``, and the log-probs
    through compiled kernels (:func:`purerl.algo.logprobs.logprobs_from_logits`); the same values to
    float rounding. The packed forward and the HF module run eagerly. ``routing_replay``
    (``actor.routing_replay``): a lean family with experts replays :attr:`~purerl.batch.Sequences.routing`.
    ``fused_head``: a lean family's scores (log-probs, entropy, Σπ², top-k) come from its hidden states through
    the fused LM head, which never holds a ``[b, t, v]`` logits tensor (:mod:`purerl.models.scores`); off, from
    the whole logits (the unfused path, kept for comparisons; the HF module's path always).
    """

    module: nn.Module
    buffers: dict[str, Tensor]
    aliases: dict[str, str]
    config: Any
    checkpointed: bool = attrs.field(default=attrs.Factory(_checkpointed, takes_self=True))
    family: Family | None = attrs.field(default=attrs.Factory(family_of, takes_self=True))
    lean: bool = attrs.field(default=attrs.Factory(lambda self: self.family is not None, takes_self=True))
    cache_keyword: str = attrs.field(default=attrs.Factory(_cache_keyword, takes_self=True))
    lora: LoraSpec | None = None
    frozen: Params = attrs.field(factory=dict)
    packed: bool = False
    compute_dtype: torch.dtype | None = None
    compiled: bool = False
    routing_replay: bool = False
    fused_head: bool = True

    def full(self, params: Params) -> Params:
        """The frozen base weights (a LoRA policy's) overlaid with ``params``."""
        return {**self.frozen, **params} if self.frozen else params

    def computed(self, params: Params) -> Params:
        """:meth:`full` params as the forwards compute with them: in ``compute_dtype``."""
        return cast_floating(self.full(params), self.compute_dtype)

    def merged(self, params: Params) -> Params:
        """A plain params tree computing what ``params`` computes: a LoRA policy's adapters folded
        into its base weights (new tensors), any other model's ``params`` themselves."""
        return params if self.lora is None else lora.merged(self.frozen, params, self.lora.scale)

    def bound(self, params: Params) -> dict[str, Tensor]:
        """The name → tensor map functional_call needs: params, tied aliases, buffers (and, for a
        LoRA policy called without adapters, rank-0 ones: its base layers alone)."""
        named = dict(self.computed(params))
        if self.lora is not None and not any(lora.is_adapter(name) for name in params):
            off = torch.empty(0)
            for name in lora.adapted_layers(self.module, self.lora.targets):
                named[f"{name}.lora_A.weight"] = named[f"{name}.lora_B.weight"] = off
        for alias, canonical in self.aliases.items():
            named[alias] = named[canonical]
        named.update(self.buffers)
        return named

    def __call__(self, params: Params, **kwargs: Any) -> Any:
        return torch.func.functional_call(self.module, self.bound(params), (), kwargs, strict=True)

    def cache_arguments(self, cache: Any) -> dict[str, Any]:
        """The keywords that make the module read and extend the KV cache ``cache``."""
        return {self.cache_keyword: cache, "use_cache": True}

    @contextlib.contextmanager
    def bind(self, params: Params) -> Iterator[nn.Module]:
        """Within the block, the skeleton computes with ``params`` (for loops of many calls,
        such as KV-cache decoding, where one swap is cheaper than one per call)."""
        with stateless._reparametrize_module(self.module, self.bound(params)):
            yield self.module

    def map_rows(self, fn: Callable[[Sequences], Tensor], seqs: Sequences) -> Tensor:
        """``fn(seqs)``, a row-wise function (row ``i`` of the result depends on row ``i`` only).
        Executors whose model spans data-parallel ranks override it to split the rows."""
        return fn(seqs)

    @property
    def shares_prompts(self) -> bool:
        """Whether :func:`response_logits` may run a prompt shared by several rows once, through
        the KV cache (not when checkpointed: the recomputation would run the prompt again)."""
        return not self.checkpointed


class ValueModel(nn.Module):
    """An HF backbone (no LM head) and a linear head giving one value per position."""

    def __init__(self, backbone: nn.Module, hidden_size: int) -> None:
        super().__init__()
        self.backbone = backbone
        self.value_head = nn.Linear(hidden_size, 1)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None, position_ids: Tensor,
                keep: int | Tensor) -> Tensor:
        """Values ``[b, keep]`` at the last ``keep`` positions, or at the positions ``keep`` (a 1-d
        index tensor, as HF's ``logits_to_keep``: a packed stream's predicting cells)."""
        hidden = self.backbone(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        ).last_hidden_state
        hidden = hidden[:, -keep:] if isinstance(keep, int) else hidden[:, keep]
        # a copy, not a view: FSDP2 warns of (and cannot hook) an in-place op on a view it returns
        return self.value_head(hidden).squeeze(-1).clone()


class _Backbone(nn.Module):
    """A critic's backbone where a causal LM keeps its own (``model``): what a family reads of a module."""

    def __init__(self, backbone: nn.Module) -> None:
        super().__init__()
        self.model = backbone


def _backbone_buffers(critic: "Critic") -> dict[str, Tensor]:
    """A critic's backbone buffers, named as a causal LM's (``model.*``)."""
    return {f"model.{k.removeprefix('backbone.')}": v for k, v in critic.buffers.items() if k.startswith("backbone.")}


def _backbone_family(critic: "Critic") -> Family | None:
    return family_of(CausalLM(_Backbone(critic.module.backbone), _backbone_buffers(critic), {},
                              critic.module.backbone.config, family=None))


@attrs.frozen(eq=False)
class Critic:
    """A value model: HF backbone + scalar head, as a skeleton like :class:`CausalLM`. ``packed``:
    its forwards run the rows packed (:func:`response_values`); ``compute_dtype``: as
    :class:`CausalLM`'s (the values come out in float32). ``family``: the lean family that computes its
    backbone, if any; ``lean``: its values come from that family's forward (:meth:`backbone`), a value
    head on its hidden states, not from the HF module. ``checkpointed``: its layers' activations are
    recomputed in the backward (the lean forward's own; an HF module's wrapped layers)."""

    module: nn.Module
    buffers: dict[str, Tensor]
    packed: bool = False
    compute_dtype: torch.dtype | None = None
    family: Family | None = attrs.field(default=attrs.Factory(_backbone_family, takes_self=True))
    lean: bool = attrs.field(default=attrs.Factory(lambda self: self.family is not None, takes_self=True))
    checkpointed: bool = attrs.field(default=attrs.Factory(_checkpointed, takes_self=True))

    def __call__(self, params: Params, *args: Any) -> Tensor:
        named = {**cast_floating(params, self.compute_dtype), **self.buffers}
        return torch.func.functional_call(self.module, named, args, strict=True)

    def backbone(self) -> "CausalLM":
        """The backbone as a causal LM a lean family computes (its params are :func:`backbone_params`): its
        buffers, packing, compute dtype and activation checkpointing the critic's."""
        return CausalLM(_Backbone(self.module.backbone), _backbone_buffers(self), {}, self.module.backbone.config,
                        self.checkpointed, self.family, self.lean, packed=self.packed, compute_dtype=self.compute_dtype)

    def head(self, params: Params) -> tuple[Tensor, Tensor]:
        """The value head's weight ``[1, hidden]`` and bias ``[1]``, in the compute dtype."""
        head = cast_floating({k: params[k] for k in ("value_head.weight", "value_head.bias")}, self.compute_dtype)
        return head["value_head.weight"], head["value_head.bias"]

    def map_rows(self, fn: Callable[[Sequences], Tensor], seqs: Sequences) -> Tensor:
        """``fn(seqs)`` for a row-wise ``fn`` (see :meth:`CausalLM.map_rows`)."""
        return fn(seqs)


def response_logits(model: CausalLM, params: Params, seqs: Sequences) -> Float[Tensor, "b t v"]:
    """Logits predicting each response token: positions ``s-t-1 … s-2`` (only those are projected).

    Rows that share a prompt (GRPO's ``n`` samples of one prompt) run it once when that saves
    enough (:func:`shared_prompts`): one forward over the distinct prompts fills a KV cache, which
    is indexed out to every row, and a second forward runs the responses against it. The values
    are the single forward's (to float rounding), and so are the gradients: autograd adds the
    gradients of a shared prompt's keys and values over its rows. Models of a lean family run its
    forward (:attr:`CausalLM.lean`), the others the HF module.

    A :attr:`CausalLM.packed` model runs no position of padding. The lean forward keeps the
    prompt sharing and attends within each row (:func:`purerl.models.families.packed.packed_response_logits`);
    through the HF module the rows run as one packed stream instead (:func:`packed_stream`), and
    its masks keep attention inside each row (transformers reads the row boundaries off the
    positions). Cells whose input is padding get logits 0 there (every loss masks them out).
    """
    if model.lean:
        shared = shared_prompts(seqs) if model.shares_prompts else None
        return model.family.response_logits(model, params, seqs, shared)
    if model.packed:
        check_rows_kept_apart(model.module, lambda ids, at: model(params, input_ids=ids, position_ids=at,
                                                                   use_cache=False).logits[0], seqs)
        stream = packed_stream(seqs)
        out = model(params, input_ids=stream.ids, position_ids=stream.positions, use_cache=False,
                    logits_to_keep=stream.predicting)
        return stream.unpacked(out.logits[0])
    shared = shared_prompts(seqs) if model.shares_prompts else None
    t, positions, mask = seqs.response_length, seqs.position_ids(), seqs.attention_mask.long()
    if shared is None:
        out = model(params, input_ids=seqs.input_ids, attention_mask=mask, position_ids=positions,
                    use_cache=False, logits_to_keep=t + 1)
        return out.logits[:, :-1]
    from transformers import DynamicCache

    first, inverse = shared
    p = seqs.input_ids.shape[1] - t
    cache = DynamicCache(config=model.config)
    prompt = model(params, input_ids=seqs.input_ids[first, :p], attention_mask=mask[first, :p],
                   position_ids=positions[first, :p], logits_to_keep=1, **model.cache_arguments(cache))
    cache.batch_select_indices(inverse)  # one copy of each prompt's keys and values per row
    response = model(params, input_ids=seqs.input_ids[:, p:], attention_mask=mask, position_ids=positions[:, p:],
                     logits_to_keep=t, **model.cache_arguments(cache))
    return torch.cat([prompt.logits.index_select(0, inverse), response.logits[:, :-1]], 1)


def backbone_params(params: Params) -> Params:
    """A critic's params as its backbone's (:meth:`Critic.backbone`): ``backbone.*`` named ``model.*``, the
    value head left out."""
    return {f"model.{k.removeprefix('backbone.')}": v for k, v in params.items() if k.startswith("backbone.")}


def response_values(critic: Critic, params: Params, seqs: Sequences) -> Float[Tensor, "b t"]:
    """``V(prefix before y_t)`` for every response position (verl's critic convention). A lean critic
    runs its backbone's family forward and the value head on its normed hidden states; the others their HF
    module. A :attr:`Critic.packed` critic runs the rows packed (:func:`packed_stream`; 0 where the input is
    padding)."""
    t = seqs.response_length
    if critic.lean:
        hidden, _ = critic.family.response_hidden(critic.backbone(), backbone_params(params), seqs, None)
        weight, bias = critic.head(params)
        return F.linear(hidden, weight, bias).squeeze(-1).float()
    if critic.packed:
        check_rows_kept_apart(critic.module, lambda ids, at: critic(params, ids, None, at, torch.arange(
            ids.shape[1], device=ids.device))[0], seqs)
        stream = packed_stream(seqs)
        return stream.unpacked(critic(params, stream.ids, None, stream.positions, stream.predicting)[0]).float()
    values = critic(params, seqs.input_ids, seqs.attention_mask.long(), seqs.position_ids(), t + 1)
    return values[:, :-1].float()


def value_and_grad(
    loss_fn: Callable[..., tuple[SumCount, Any]],
) -> Callable[..., tuple[SumCount, Any, Any]]:
    """Differentiate ``loss_fn(params, *args, **kwargs) -> (SumCount, aux)`` w.r.t. ``params``.

    The returned function has the signature ``(params, *args, denominator=None, into=None, **kwargs)
    -> (loss, aux, grads)``: ``grads`` (same tree as ``params``, each with its param's strides) are the
    gradients of ``loss.total / denominator`` (``loss.count`` when None). Pass the whole mini-batch's count as
    ``denominator`` when accumulating micro-batches, so the sum of micro-batch gradients is the mini-batch
    gradient exactly; pass the gradients so far as ``into`` (donated: each leaf's gradient is added to them in
    place as soon as it is ready, and they come back), so no micro-batch holds a second copy of the model's
    gradients. Leaves that do not influence the loss get zero gradients. ``loss`` and ``aux`` come back
    detached. Nothing else is mutated: the params are re-wrapped as fresh leaves that share storage and
    require grad.
    """

    @functools.wraps(loss_fn)
    def wrapped(params: Any, *args: Any, denominator: Tensor | float | None = None, into: Any = None,
                **kwargs: Any):
        leaves, treedef = tree_flatten(params)
        diff = [x.detach().requires_grad_() for x in leaves]
        if into is not None:  # autograd adds each gradient into .grad in place (no grad mode in the backward)
            for leaf, so_far in zip(diff, tree_leaves(into)):
                leaf.grad = so_far
        with torch.enable_grad():
            loss, aux = loss_fn(tree_unflatten(diff, treedef), *args, **kwargs)
            scale = loss.count if denominator is None else denominator
            torch.autograd.backward(loss.total / scale, inputs=diff)
        grads = [torch.zeros_like(x) if d.grad is None else d.grad for x, d in zip(leaves, diff)]
        detached = tree_map(lambda x: x.detach() if isinstance(x, Tensor) else x, aux)
        return loss.detach(), detached, tree_unflatten(grads, treedef)

    return wrapped


def full_state_dict(model: CausalLM, params: Params) -> dict[str, Tensor]:
    """Params (a LoRA policy's merged into its base) plus persistent buffers (tied aliases left
    out): what ``save_pretrained`` wants."""
    persistent = set(model.module.state_dict())  # the meta skeleton knows which buffers persist
    return {**model.merged(params), **{name: b for name, b in model.buffers.items() if name in persistent}}
