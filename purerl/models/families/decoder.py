"""The shared decoder of every lean family, as plain functions of the params tree: the layer loop
(:func:`decoder_stack`), the final norm and LM head (:func:`logits_of`) and the training and scoring
forward (:func:`response_logits`).

Running the HF module costs, per call, module dispatch, mask construction, output objects and one
kernel per projection; for small models and short sequences that overhead is most of the time.
Here the decoder stack is a plain function: RMSNorm, rotary embeddings (:mod:`.rotary`),
grouped-query attention through ``scaled_dot_product_attention``, a gated MLP, with q/k/v and
gate/up each fused into one matrix product (fewer, larger kernels; in a training forward autograd
splits the gradient of a fused matrix back onto its parts; :mod:`.weights`). What a family changes
in Llama's block is its :class:`~.variant.Variant`, read through the :class:`~.weights.Layout`
(Qwen3's q/k norms, Qwen3-MoE's sparse MLPs (:mod:`.moe`), Gemma 3's ``1 + w`` norms before and
after attention and MLP, GELU-tanh, scaled embeddings, sliding windows, soft-capped logits); it
computes what each family's HF module computes, op for op (``tests/test_family_exactness.py``).

Users: :func:`response_logits` (through :func:`purerl.models.response_logits`),
:mod:`purerl.models.families.packed` (the same forward with no compute on padding) and
:mod:`purerl.models.families.decode` (KV-cache decoding), each with its own ``attention``.

Shapes: ``b`` rows, ``s`` positions, ``H`` query heads, ``K`` key/value heads, ``D`` head size.
"""

import functools
from collections.abc import Callable, Mapping
from typing import NamedTuple

import torch
import torch.nn.functional as F
from jaxtyping import Bool, Float, Int
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from purerl.models.families.moe import Routing, sparse_mlp
from purerl.models.families.onednn import OneDNNLinear
from purerl.models.families.rotary import Ropes, RotaryTable, ropes_of, rotate
from purerl.models.families.weights import FusedWeights, Layout, Lora, fused_weights, layout_of

__all__ = [
    "Attention",
    "FusedWeights",
    "Layout",
    "Lora",
    "RotaryTable",
    "attention_mask",
    "decoder_stack",
    "LMHead",
    "final_norm",
    "fused_weights",
    "layout_of",
    "lazy_layers",
    "lm_head",
    "logits_of",
    "project",
    "response_logits",
    "rms_norm",
    "window_mask",
]

Attention = Callable[[int, Tensor, Tensor, Tensor, slice | None], Tensor]
"""``attention(layer, q [b, H, n, D], k [b, K, s, D], v [b, K, s, D], queries) -> [b, H, n, D]``:
``queries`` is the slice of the ``s`` positions ``q`` holds (None: all of them, ``n = s``)."""


def _gelu_tanh(x: Tensor) -> Tensor:
    return F.gelu(x, approximate="tanh")


_ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {"silu": F.silu, "gelu_tanh": _gelu_tanh}


def rms_norm(x: Tensor, weight: Float[Tensor, "*shape"], eps: float, float32_scale: bool = False) -> Tensor:
    """RMSNorm over the last dim, bit-identical to the modules': ``LlamaRMSNorm`` (and Qwen3's head
    norms) normalises in float32, casts back, then scales; with ``float32_scale``, ``Gemma3RMSNorm``
    (``weight``: its ``1 + w``, float32) normalises and scales in float32, then casts back.
    ``weight``'s shape may cover more than the last dim (one per head: it broadcasts).
    (``torch.rms_norm`` is what ``F.rms_norm`` calls, without its Python checks: this runs several
    times per layer and decoded token.)"""
    if x.dtype == torch.float32:
        if weight.dim() == 1:
            return torch.rms_norm(x, (x.shape[-1],), weight, eps)
        return torch.rms_norm(x, (x.shape[-1],), None, eps) * weight
    normed = torch.rms_norm(x.float(), (x.shape[-1],), None, eps)
    return (normed * weight).to(x.dtype) if float32_scale else weight * normed.to(x.dtype)


def decoder_stack(weights: FusedWeights, ropes: Ropes, layout: Layout, ids: Int[Tensor, "b s"],
                  attention: Attention, keep: slice | None = None, routing: Routing | None = None, *,
                  checkpointed: bool = False) -> Float[Tensor, "b n hidden"]:
    """The decoder layers on ``ids`` at the positions ``ropes`` were taken at (layer ``i`` rotates
    with ``ropes[layout.sliding[i]]``); ``attention`` stores keys and values where it needs to,
    masks each layer's keys (a sliding layer's window) and returns the attention output. Hidden
    states after the last layer, before the final norm, at the positions ``keep`` (a slice of the
    ``s``; None: all): the last layer computes its queries' attention, output projection and MLP
    only there, as no later layer reads the others (every position's keys and values are still
    computed). The hidden state stays ``[b·s, hidden]`` so every projection is one matrix product,
    with the residual added inside it (``addmm``) where no norm follows the projection. A sparse
    layer sends its tokens to its router's experts, or to ``routing``'s (replay), and records its
    router's choice in ``routing`` (:class:`.moe.Routing`). Each layer reads its weights from
    ``weights.layers`` as it runs (:class:`~.weights.LazyLayers` builds them then). ``checkpointed``
    (activation checkpointing): each layer keeps only its input for the backward, which runs it again,
    its weights read again with it (``torch.utils.checkpoint``, non-reentrant); the same values. A tied
    embedding (:attr:`~.weights.FusedWeights.tied`) passes back the rows it looked up, as a sparse gradient."""
    b, s = ids.shape
    # as the module's nn.Embedding: the padding row's lookups pass no gradient back, even where that
    # token was sampled and is attended (its LM-head use, when tied, still does)
    h = F.embedding(ids.reshape(-1), weights.embed, padding_idx=layout.padding_idx, sparse=weights.tied)
    if layout.embed_scale is not None:  # rounded to the embedding's dtype, as HF
        h = h * float(torch.tensor(layout.embed_scale).to(h.dtype))
    last = layout.layers - 1
    for i in range(layout.layers):
        layer = functools.partial(_layer, weights, ropes, layout, attention, b, s, i, keep if i == last else None,
                                  routing)
        h = checkpoint(layer, h, use_reentrant=False, preserve_rng_state=False) if checkpointed else layer(h)
    return h.view(b, h.shape[0] // b, -1)


def _layer(weights: FusedWeights, ropes: Ropes, layout: Layout, attention: Attention, b: int, s: int, i: int,
           keep: slice | None, routing: Routing | None, h: Float[Tensor, "bs hidden"]) -> Float[Tensor, "bn hidden"]:
    """Decoder layer ``i`` on the hidden states ``h`` of ``b`` rows of ``s`` positions (see
    :func:`decoder_stack`); ``keep``: the positions whose outputs are wanted (the last layer's)."""
    heads, kv_heads, head_dim, eps = layout.heads, layout.kv_heads, layout.head_dim, layout.eps
    qk_heads, plus_one = heads + kv_heads, layout.norm_plus_one
    w = weights.layers[i]
    cos, sin = ropes[layout.sliding[i]]
    qkv = project(rms_norm(h, w.input_norm, eps, plus_one), w.qkv, w.qkv_bias, lora=w.qkv_lora)
    qkv = qkv.view(b, s, qk_heads + kv_heads, head_dim)
    # q and k are adjacent heads of the fused product: one norm (where the family has one) and one rotation
    qk = qkv[:, :, :qk_heads] if w.qk_norm is None else rms_norm(qkv[:, :, :qk_heads], w.qk_norm, eps, plus_one)
    qk = rotate(qk.transpose(1, 2), cos, sin)
    q, queries, n = qk[:, :heads], None, s
    if keep is not None:
        q, queries = q[:, :, keep], keep
        h = h.view(b, s, -1)[:, keep].reshape(-1, h.shape[-1])
        n = q.shape[2]
    attn = attention(i, q, qk[:, heads:], qkv[:, :, qk_heads:].transpose(1, 2), queries)
    attn = attn.transpose(1, 2).reshape(b * n, -1)
    if w.attention_out_norm is None:
        h = project(attn, w.out, w.out_bias, residual=h, lora=w.out_lora)
    else:
        h = h + rms_norm(project(attn, w.out, w.out_bias, lora=w.out_lora), w.attention_out_norm, eps, plus_one)
    x = rms_norm(h, w.mlp_norm, eps, plus_one)
    if w.experts is not None:
        top, cols = layout.experts_per_token, slice(None) if queries is None else queries
        forced = None if routing is None or routing.replay is None else routing.replay[:, cols, i]
        out, own = sparse_mlp(x, w.experts, top, layout.norm_topk_prob,
                              None if forced is None else forced.reshape(-1, top))
        if routing is not None and routing.record is not None:
            routing.record[:, cols, i] = own.view(b, n, top).to(routing.record.dtype)
        return h + out
    gate, up = project(x, w.gate_up, lora=w.gate_up_lora).chunk(2, dim=-1)
    if w.mlp_out_norm is None:
        return project(_ACTIVATIONS[layout.activation](gate) * up, w.down, residual=h, lora=w.down_lora)
    return h + rms_norm(project(_ACTIVATIONS[layout.activation](gate) * up, w.down, lora=w.down_lora), w.mlp_out_norm,
                        eps, plus_one)


def lazy_layers(params: Mapping[str, Tensor], checkpointed: bool) -> bool:
    """Whether a forward reads each layer's weights as it runs (:class:`~.weights.LazyLayers`): where the
    backward builds them again (``checkpointed``: a layer's fused copies, and gathered shards, live while it
    runs). Otherwise every layer's are built at the start, once for a shared prompt's pass and the responses'
    (the backward keeps them either way)."""
    del params
    return checkpointed


class LMHead(NamedTuple):
    """The LM head as a fused head reads it (:func:`purerl.algo.fused_head.head_outputs`): its ``weight``
    ``[v, hidden]`` (a tied head's: the embedding itself), its ``bias`` and the logits' ``softcap``."""

    weight: Float[Tensor, "v hidden"]
    bias: Float[Tensor, " v"] | None
    softcap: float | None


def lm_head(weights: FusedWeights, layout: Layout) -> LMHead:
    """The model's :class:`LMHead`."""
    return LMHead(weights.head.t(), weights.head_bias, layout.softcap)


def final_norm(weights: FusedWeights, layout: Layout, hidden: Float[Tensor, "... hidden"]) -> Float[Tensor, "n hidden"]:
    """The final norm on hidden states from :func:`decoder_stack`, flattened to ``[n, hidden]``: what the LM head
    (:func:`logits_of`) and a critic's value head read."""
    return rms_norm(hidden.reshape(-1, hidden.shape[-1]), weights.norm, layout.eps, layout.norm_plus_one)


def logits_of(weights: FusedWeights, layout: Layout, hidden: Float[Tensor, "... hidden"]) -> Float[Tensor, "... v"]:
    """The final norm and LM head on hidden states from :func:`decoder_stack`, then the soft-cap
    where the layout has one."""
    shape = hidden.shape[:-1]
    logits = project(final_norm(weights, layout, hidden), weights.head, weights.head_bias)
    if layout.softcap is not None:
        logits = torch.tanh(logits / layout.softcap) * layout.softcap
    return logits.view(*shape, -1)


def project(x: Tensor, weight: Tensor | OneDNNLinear, bias: Tensor | None = None, *, residual: Tensor | None = None,
            lora: Lora | None = None) -> Tensor:
    """``residual + x @ weight + bias`` for 2-d ``x`` and a transposed ``weight`` ``[in, out]``
    (what ``F.linear`` computes, one kernel), plus ``lora``'s low-rank update when given
    (:class:`~purerl.models.lora.LoraLinear`'s order: the base output, then the update added).
    A prepacked ``weight`` (:class:`~purerl.models.families.onednn.OneDNNLinear`, inference)
    computes the product itself."""
    if isinstance(weight, OneDNNLinear):
        return weight.project(x, bias, residual)
    if residual is None:
        out = torch.mm(x, weight) if bias is None else torch.addmm(bias, x, weight)
    else:
        out = torch.addmm(residual, x, weight)
        out = out if bias is None else out + bias
    if lora is not None:
        out = out + lora.scale * torch.mm(torch.mm(x, lora.a), lora.b)
    return out


def attention_mask(valid: Bool[Tensor, "b stop"], start: int) -> Bool[Tensor, "b 1 s stop"]:
    """Which keys each query attends to, for queries at key slots ``start … stop-1``: the valid
    (attended, not padding) keys up to its own slot. A padding query attends only to itself: its
    output is never used, and this keeps it finite (a NaN would leak into gradients and caches)."""
    s, stop = valid.shape[1] - start, valid.shape[1]
    causal = torch.ones((s, stop), dtype=torch.bool, device=valid.device).tril(start)
    eye = F.pad(torch.eye(s, dtype=torch.bool, device=valid.device), (start, 0))
    return ((valid[:, None, :] & causal[None]) | eye[None])[:, None]


def window_mask(query_positions: Int[Tensor, "b n"], key_positions: Int[Tensor, "b m"], window: int,
                ) -> Bool[Tensor, "b 1 n m"]:
    """Keys at most ``window - 1`` positions before the query (and any after it: the causal mask
    removes those)."""
    return ((query_positions[:, :, None] - key_positions[:, None, :]) < window)[:, None]


def response_logits(
    params: Mapping[str, Tensor],
    inv_freq: Tensor | tuple[Tensor, ...],
    layout: Layout,
    input_ids: Int[Tensor, "b s"],
    valid: Bool[Tensor, "b s"],
    positions: Int[Tensor, "b s"],
    response_length: int,
    shared: tuple[Int[Tensor, " g"], Int[Tensor, " b"]] | None = None,
    lora_scale: float | None = None,
    routing: Routing | None = None,
    *,
    checkpointed: bool = False,
    head: bool = True,
) -> Float[Tensor, "b t v"] | tuple[Float[Tensor, "b t hidden"], "LMHead"]:
    """Logits predicting the last ``t = response_length`` tokens: positions ``s-t-1 … s-2``.
    Differentiable in ``params``; ``valid`` is the attention mask (False on padding); ``inv_freq``:
    the model's rotary buffer, or one per layer kind (:func:`.rotary.inv_freqs`).

    ``shared = (first, inverse)`` (see :func:`purerl.models.shared_prompts`): row ``i``'s prompt
    (its first ``s - t`` columns) is row ``first[inverse[i]]``'s, so the distinct prompts run
    once, their keys and values are indexed out to every row and the responses run against them.
    Same values (to float rounding), and the same gradients: autograd adds those of a shared
    prompt's keys and values over its rows. ``lora_scale``: the scale of the LoRA adapters in
    ``params`` (see :func:`~.weights.fused_weights`). ``routing``: a sparse model's routing replay
    and record over ``input_ids`` (:class:`.moe.Routing`). ``checkpointed``: activation checkpointing
    (:func:`decoder_stack`); then a layer's fused weights are built as it runs (:func:`lazy_layers`).
    ``head``: False, the hidden states after the final norm (``[b, t, hidden]``, what a value head and a fused
    head read) and the :class:`LMHead`, in place of the logits.
    """
    weights = fused_weights(params, layout, lora_scale, lazy=lazy_layers(params, checkpointed))
    gqa, windowed = layout.heads != layout.kv_heads, any(layout.sliding)

    def run(ids: Tensor, at: Tensor, mask: Tensor, keys_at: Tensor, keep: slice,
            past: list[tuple[Tensor, Tensor]] | None = None,
            routes: Routing | None = routing) -> tuple[Tensor, list[tuple[Tensor, Tensor]]]:
        kv: list[tuple[Tensor, Tensor]] = []
        masks = (mask, mask & window_mask(at, keys_at, layout.window)) if windowed else (mask,)

        def attention(i: int, q: Tensor, k: Tensor, v: Tensor, queries: slice | None) -> Tensor:
            if past is not None:
                k, v = torch.cat((past[i][0], k), 2), torch.cat((past[i][1], v), 2)
            kv.append((k, v))
            m = masks[layout.sliding[i]]
            m = m if queries is None else m[:, :, queries]
            return F.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=layout.scale, enable_gqa=gqa)

        ropes = ropes_of(inv_freq, at, weights.embed.dtype)
        return decoder_stack(weights, ropes, layout, ids, attention, keep, routes, checkpointed=checkpointed), kv

    def out(hidden: Tensor) -> Tensor | tuple[Tensor, LMHead]:
        if head:
            return logits_of(weights, layout, hidden)
        return final_norm(weights, layout, hidden).view(hidden.shape), lm_head(weights, layout)

    s, t = input_ids.shape[1], response_length
    if shared is None:
        hidden, _ = run(input_ids, positions, attention_mask(valid, 0), positions, slice(s - t - 1, s - 1))
        return out(hidden)
    first, inverse = shared
    p = s - t
    # a shared prompt runs once, as row first[j]: it replays that row's routing, and its record is every row's
    prompt_routes = response_routes = None
    if routing is not None:
        prompt_routes = Routing(None if routing.replay is None else routing.replay[first, :p],
                                None if routing.record is None else routing.record[first, :p])  # a copy
        response_routes = Routing(None if routing.replay is None else routing.replay[:, p:],
                                  None if routing.record is None else routing.record[:, p:])
    prompt, kv = run(input_ids[first, :p], positions[first, :p], attention_mask(valid[first, :p], 0),
                     positions[first, :p], slice(p - 1, p), routes=prompt_routes)
    if routing is not None and routing.record is not None:
        routing.record[:, :p] = prompt_routes.record.index_select(0, inverse)
    # one copy of each prompt's keys and values per row; index_select, not x[inverse]: its backward adds
    # the rows' gradients in row order, where indexing's (index_put_ accumulating) adds them with atomics
    # on a CPU's threads, in an order that changes from process to process
    past = [(k.index_select(0, inverse), v.index_select(0, inverse)) for k, v in kv]
    # the responses' keys follow their prompt's: a window reaches back over every position of the row
    response, _ = run(input_ids[:, p:], positions[:, p:], attention_mask(valid, p), positions, slice(0, t - 1), past,
                      response_routes)
    return out(torch.cat((prompt.index_select(0, inverse), response), 1))
