"""Model families with a lean forward: the models purerl computes without the HF module.

A :class:`Family` says which models it covers and gives two functions of the params tree: the
training and scoring forward (``response_logits``) and KV-cache decoding for the embedded engine
(``decoding``). :func:`family_of` picks the first registered family that supports a model; a model
that none supports runs its HF module (same values, more overhead per call), and the log says so
and why (:func:`computed_by`).

Registered: ``llama`` (Llama, Qwen2, SmolLM2), ``qwen3`` (Qwen3 dense: Llama's block with q/k
norms per head), ``qwen3_moe`` (Qwen3's block with :mod:`.moe`'s sparse MLPs) and ``gemma3`` (Gemma 3
text), each a :class:`~.variant.Variant` of one shared decoder (:mod:`.llama`'s and :mod:`.gemma`'s
data): one layer loop and training forward (:mod:`.decoder`, over :mod:`.weights` and
:mod:`.rotary`), one packed forward (:mod:`.packed`) and one KV-cache decoding (:mod:`.decode`, over
:mod:`.kv_cache`; CUDA graphs: :mod:`.decode_graph`).
``tests/test_family_exactness.py`` runs every registered family through the same checks against its HF module.
A new family defines its :class:`~.variant.Variant` (listed in :data:`.weights.VARIANTS`) and registers a
:class:`Family` under its name: ``FAMILIES.register("name")(_lean(variant, description))``.
"""

import contextlib
import functools
import logging
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import attrs
import torch
from torch import Tensor

from purerl.models.families import decode, decoder, gemma, llama, packed
from purerl.models.families.moe import Routing
from purerl.models.families.rotary import inv_freqs
from purerl.models.families.saved_parts import parts_saved
from purerl.models.families.variant import Variant
from purerl.models.families.weights import layout_of
from purerl.registry import Registry

if TYPE_CHECKING:
    from purerl.batch import Sequences

CausalLM = Any
"""A :class:`purerl.models.base.CausalLM`: named, not imported (``base`` imports this package, so
the dependency runs one way)."""
Params = dict[str, Tensor]

__all__ = ["Decoding", "FAMILIES", "Family", "computed_by", "family_of"]

_log = logging.getLogger(__name__)

Decoding = tuple[Tensor, Callable[[Tensor, Tensor], Tensor], Callable[[Tensor], None] | None]
"""What a decoding context yields for ``g`` prompts and ``n`` samples each: the prompts' last-position
logits ``[g·n, v]`` (each prompt prefilled once); ``advance(token[b], position[b, 1])``, which
appends one token per row and returns the next logits ``[b, v]``; and ``keep(rows)``, which cuts the
batch down to ``rows`` (None where shapes are fixed, as in a CUDA graph)."""


@attrs.frozen
class Family:
    """A lean implementation of one family of architectures.

    - ``supports(model) -> bool``: whether it computes exactly what ``model``'s HF module does.
    - ``response_logits(model, params, seqs, shared, record=None) -> [b, t, v]``: as
      :func:`purerl.models.response_logits` (``shared``: its ``(first, inverse)`` rows sharing a prompt);
      a family with experts replays ``seqs.routing`` where ``model.routing_replay`` says and writes
      its routers' choices into ``record`` (:class:`.moe.Routing`).
    - ``response_hidden(model, params, seqs, shared, record=None) -> ([b, t, hidden], LMHead)``: the hidden
      states after the final norm at the same positions (what a critic's value head and a fused LM head read),
      and the model's LM head (:class:`.decoder.LMHead`).
    - ``decoding(model, params, ids, mask, positions, n, capacity, cuda_graphs=…, sampler=…)``: a
      context manager yielding :data:`Decoding` for ``[g, P]`` left-padded prompts on their device,
      ``capacity`` positions per row; with a ``sampler`` (a
      :class:`~purerl.models.families.decode_graph.RowSampler`) each step also draws the next token,
      and ``advance`` returns the sampled tokens and their log-probs in place of logits.
    - ``decoder_weights(model, params, onednn=…)``: what ``decoding`` reads in place of
      ``params`` over the calls of one weights version (prepared once by the engine's ``sync``;
      default: the params themselves).
    - ``unsupported(model) -> str | None``: for a model of the family's architectures that
      ``supports`` refuses, why (a phrase for the log); None otherwise.
    - ``description``: what it covers, for the reference (default: its module's first paragraph).
    """

    supports: Callable[[CausalLM], bool]
    response_logits: Callable[[CausalLM, Params, "Sequences", tuple[Tensor, Tensor] | None], Tensor]
    response_hidden: Callable[[CausalLM, Params, "Sequences", tuple[Tensor, Tensor] | None], Tensor]
    decoding: Callable[..., AbstractContextManager[Decoding]]
    decoder_weights: Callable[..., Any] = lambda model, params, **options: params
    unsupported: Callable[[CausalLM], str | None] = lambda model: None
    description: str = ""


FAMILIES: Registry[Family] = Registry("model family")


def family_of(model: CausalLM) -> Family | None:
    """The first registered family that supports ``model``; None (and a log line) when none does."""
    for name in FAMILIES.names():
        if FAMILIES[name].supports(model):
            return FAMILIES[name]
    _log.info("%s", computed_by(model))
    return None


def computed_by(model: CausalLM) -> str:
    """One line saying what computes ``model``'s forwards: the lean family that supports it, or
    its HF module and why (each family of its architecture says what it does not implement)."""
    kind = f"{type(model.module).__name__} (model_type {getattr(model.config, 'model_type', None)!r})"
    for name in FAMILIES.names():
        if FAMILIES[name].supports(model):
            return f"{kind}: computed by the lean family {name!r}"
    reasons = "; ".join(f"{name}: {why}" for name in FAMILIES.names() if (why := FAMILIES[name].unsupported(model)))
    return f"{kind}: no lean family supports it{f' ({reasons})' if reasons else ''}; it runs through its HF module"


def _response_logits(model: CausalLM, params: Params, seqs: "Sequences", shared: tuple[Tensor, Tensor] | None,
                     record: Tensor | None = None, *, head: bool = True) -> Any:
    """:attr:`Family.response_logits` of every lean family: :mod:`.packed`'s forward where the model
    asks, else :mod:`.decoder`'s, compiled where it asks (eager where it routes by a record or records;
    there the backward keeps the fused matrices as their parts, :mod:`.saved_parts`). ``head``: False,
    :attr:`Family.response_hidden`."""
    replay = seqs.routing if model.routing_replay else None
    routing = None if replay is None and record is None else Routing(replay, record)
    compiled = model.compiled and not model.packed and routing is None
    if compiled:
        forward = _compiled_forward(head)
    else:
        forward = functools.partial(_forward, packed.packed_response_logits if model.packed else
                                    decoder.response_logits, head=head)
    with contextlib.nullcontext() if compiled else parts_saved():
        return forward(model, params, seqs.input_ids, seqs.attention_mask, seqs.position_ids(),
                       seqs.response_length, shared, **({} if routing is None else {"routing": routing}))


def _response_hidden(model: CausalLM, params: Params, seqs: "Sequences", shared: tuple[Tensor, Tensor] | None,
                     record: Tensor | None = None) -> tuple[Tensor, "decoder.LMHead"]:
    return _response_logits(model, params, seqs, shared, record, head=False)


def _forward(forward: Callable[..., Tensor], model: CausalLM, params: Params, ids: Tensor, valid: Tensor,
             positions: Tensor, response_length: int, shared: tuple[Tensor, Tensor] | None, *, head: bool = True,
             **routing: Any) -> Any:
    """``forward`` (the signature of :func:`.decoder.response_logits`) on what it reads from the model:
    its rotary buffers (:func:`.rotary.inv_freqs`) and its layout (:func:`.weights.layout_of`)."""
    return forward(model.computed(params), inv_freqs(model), layout_of(model.config), ids, valid, positions,
                   response_length, shared, None if model.lora is None else model.lora.scale, **routing,
                   checkpointed=model.checkpointed, head=head)


@functools.cache
def _compiled_forward(head: bool) -> Callable[..., Tensor]:
    """The padded lean forward, the cast to the compute dtype included, as one graph compiled by
    ``torch.compile`` (inductor fuses the norms, rotary, the MLP and the casts; built on first use;
    shapes go dynamic after the first recompile); ``head`` as :func:`.decoder.response_logits`'s."""
    return torch.compile(functools.partial(_forward, decoder.response_logits, head=head))


def _lean(variant: Variant, description: str) -> Family:
    """A family that the shared decoder computes as ``variant``."""
    return Family(variant.supports, _response_logits, _response_hidden, decode.decoding, decode.decoder_weights,
                  variant.unsupported, description)


_LEAN = ":mod:`purerl.models.families.llama`"
FAMILIES.register("llama")(_lean(llama.LLAMA, (
    f"Llama, Qwen2 and SmolLM2 ({_LEAN}): RMSNorm, rotary embeddings (default, linear and llama3 scaling), "
    "grouped-query attention with optional q/k/v/o biases, a SwiGLU MLP; q/k/v and gate/up each one fused "
    "matrix product.")))
FAMILIES.register("qwen3")(_lean(llama.QWEN3, (
    f"Qwen3 dense ({_LEAN}): Llama's block with q and k RMS-normalised per head before the rotation, and "
    "``head_dim`` apart from hidden/heads.")))
FAMILIES.register("qwen3_moe")(_lean(llama.QWEN3_MOE, (
    f"Qwen3-MoE ({_LEAN} with :mod:`purerl.models.families.moe`): Qwen3's block with sparse MLPs, a top-k "
    "softmax router (``norm_topk_prob``) and one matrix product per expert over its tokens, where "
    "``mlp_only_layers`` and ``decoder_sparse_step`` put them; dense MLPs elsewhere. Decoding runs eager "
    "steps (no CUDA graph).")))
FAMILIES.register("gemma3")(_lean(gemma.GEMMA3, (
    "Gemma 3 text (:mod:`purerl.models.families.gemma`): Llama's block with ``1 + w`` RMSNorms in float32 "
    "before and after attention and MLP, q/k norms per head, a GELU-tanh gated MLP, embeddings scaled by "
    "√hidden, attention scaled by ``query_pre_attn_scalar``, sliding-window layers with their own rotary base, "
    "and soft-capped logits.")))
