"""A lean forward for Llama-family models (Llama, Qwen2, SmolLM2, Qwen3), as plain functions of the params tree.

Running the HF module costs, per call, module dispatch, mask construction, output objects and one
kernel per projection; for small models and short sequences that overhead is most of the time.
Here the decoder stack is a plain function: RMSNorm, rotary embeddings, grouped-query attention
through ``scaled_dot_product_attention``, SwiGLU MLP, with q/k/v and gate/up each fused into one
matrix product (fewer, larger kernels; in a training forward autograd splits the gradient of a
fused matrix back onto its parts). It computes what ``LlamaForCausalLM`` computes, op for op:
logits equal the module's (fp32: bit for bit in training forwards, ~1e-6 when decoding;
``tests/test_llama.py``, ``tests/test_llama_decode.py``, ``tests/test_family_exactness.py``).
A :class:`Variant` names what a family built on it changes in Llama's block (Qwen3: q and k
RMS-normalised per head before the rotation). :func:`supports` says which models it covers;
the others (other architectures, rope variants that rescale attention, sliding windows) go
through the HF module, and :meth:`Variant.unsupported` says why.

Users: :func:`response_logits` (the training and scoring forward, through
:func:`purerl.models.response_logits`), :mod:`purerl.models.families.llama_packed` (the same forward
with no compute on padding) and :mod:`purerl.models.families.llama_decode` (KV-cache decoding).

Shapes: ``b`` rows, ``s`` positions, ``H`` query heads, ``K`` key/value heads, ``D`` head size.
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from jaxtyping import Bool, Float, Int
from torch import Tensor

from purerl.models.families.llama_weights import FusedWeights, LlamaLayout, Lora, fused_weights, layout_of
from purerl.models.families.moe import Routing, sparse_mlp
from purerl.models.families.onednn import OneDNNLinear

__all__ = [
    "LLAMA",
    "QWEN3",
    "QWEN3_MOE",
    "Variant",
    "LlamaLayout",
    "RotaryTable",
    "FusedWeights",
    "Lora",
    "supports",
    "layout_of",
    "fused_weights",
    "decoder_stack",
    "logits_of",
    "attention_mask",
    "response_logits",
]

_ROPE_TYPES = ("default", "linear", "llama3")  # inv_freq changes, attention is not rescaled

Attention = Callable[[int, Tensor, Tensor, Tensor, slice | None], Tensor]
"""``attention(layer, q [b, H, n, D], k [b, K, s, D], v [b, K, s, D], queries) -> [b, H, n, D]``:
``queries`` is the slice of the ``s`` positions ``q`` holds (None: all of them, ``n = s``)."""


class Variant(NamedTuple):
    """What a family computed by this forward changes in Llama's block: the HF model types it
    covers, and whether each attention layer RMS-normalises q and k per head before the rotation
    (``q_norm``/``k_norm``, one weight ``[D]`` each, shared by the heads)."""

    model_types: tuple[str, ...]
    qk_norm: bool = False

    def supports(self, model: Any) -> bool:
        """Whether this module computes exactly what ``model`` (a CausalLM skeleton) does."""
        return getattr(model.config, "model_type", None) in self.model_types and self.unsupported(model) is None

    def unsupported(self, model: Any) -> str | None:
        """Why this module would not compute what ``model``, of one of these architectures, computes
        (a phrase for the log: the first setting it does not implement); None where it would, and
        for a model of another architecture."""
        config = model.config
        if getattr(config, "model_type", None) not in self.model_types:
            return None
        rotary = getattr(getattr(model.module, "model", None), "rotary_emb", None)
        layers = getattr(getattr(model.module, "model", None), "layers", None) or [None]
        rope_type = getattr(rotary, "rope_type", None)
        if getattr(config, "hidden_act", None) != "silu":
            return f"hidden_act {getattr(config, 'hidden_act', None)!r} (it runs SiLU)"
        if rotary is None or "model.rotary_emb.inv_freq" not in model.buffers:
            return "no rotary embedding with an inv_freq buffer"
        if rope_type not in _ROPE_TYPES:
            return f"rope_type {rope_type!r} (it implements {', '.join(_ROPE_TYPES)})"
        if float(getattr(rotary, "attention_scaling", 1.0)) != 1.0:
            return f"rope attention_scaling {float(rotary.attention_scaling)} (it implements 1)"
        if getattr(config, "use_sliding_window", False) or any(
                kind != "full_attention" for kind in getattr(config, "layer_types", None) or ()):
            return "sliding-window attention layers"
        if getattr(config, "mlp_bias", False):
            return "MLP biases"
        if hasattr(getattr(layers[0], "self_attn", None), "q_norm") != self.qk_norm:
            return "no q/k norms per head" if self.qk_norm else "q/k norms per head (this family has none)"
        return None


LLAMA = Variant(("llama", "qwen2"))
QWEN3 = Variant(("qwen3",), qk_norm=True)
QWEN3_MOE = Variant(("qwen3_moe",), qk_norm=True)
"""Qwen3's block with sparse MLPs (:mod:`.moe`) where the params hold a router, dense ones elsewhere
(``mlp_only_layers``, ``decoder_sparse_step``)."""


def supports(model: Any, variant: Variant = LLAMA) -> bool:
    """Whether this module computes exactly what ``model`` (a CausalLM skeleton) does, as ``variant``."""
    return variant.supports(model)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``LlamaRMSNorm``: normalise in float32, cast back, then scale (bit-identical to the module).
    (``torch.rms_norm`` is what ``F.rms_norm`` calls, without its Python checks: this runs twice
    per layer and decoded token.)"""
    if x.dtype == torch.float32:
        return torch.rms_norm(x, (x.shape[-1],), weight, eps)
    return weight * torch.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)


def head_norm(x: Float[Tensor, "... heads D"], weight: Float[Tensor, "heads D"], eps: float) -> Tensor:
    """Qwen3's ``q_norm``/``k_norm``: RMSNorm over each head's ``D`` values, head ``j`` scaled by
    ``weight[j]`` (as :func:`rms_norm`: normalise in float32, cast back, then scale)."""
    if x.dtype == torch.float32:
        return torch.rms_norm(x, (x.shape[-1],), None, eps) * weight
    return weight * torch.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)


class RotaryTable(NamedTuple):
    """``cos`` and sign-folded ``sin`` of positions, ``[..., D]`` each. Rotating ``x`` at position
    ``p`` is ``x · cos[p] + roll(x, D/2) · sin[p]``, which equals HF's
    ``x · cos + rotate_half(x) · sin`` value for value (``roll`` moves the halves as
    ``rotate_half`` does; the minus sign that ``rotate_half`` puts on the second half sits in
    ``sin`` here)."""

    cos: Tensor
    sin: Tensor

    @classmethod
    def of(cls, inv_freq: Float[Tensor, " half"], positions: Tensor, *, dtype: torch.dtype) -> "RotaryTable":
        """The table at ``positions`` (any shape; the result has one more, trailing dim ``D``)."""
        freqs = positions.float()[..., None] * inv_freq.float().to(positions.device)
        return cls(torch.cat((freqs, freqs), -1).cos().to(dtype), torch.cat((-freqs.sin(), freqs.sin()), -1).to(dtype))

    @classmethod
    def build(cls, inv_freq: Float[Tensor, " half"], capacity: int, *, dtype: torch.dtype,
              device: torch.device) -> "RotaryTable":
        """The table of positions ``0 … capacity-1``, ``[capacity, D]``, to index with :meth:`at`."""
        return cls.of(inv_freq, torch.arange(capacity, device=device), dtype=dtype)

    def at(self, positions: Int[Tensor, "b s"]) -> tuple[Tensor, Tensor]:
        """``cos`` and ``sin`` at ``positions``, ``[b, 1, s, D]`` (broadcast over heads)."""
        return self.cos[positions][:, None], self.sin[positions][:, None]


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin


def decoder_stack(weights: FusedWeights, rope: tuple[Tensor, Tensor], layout: LlamaLayout,
                  ids: Int[Tensor, "b s"], attention: Attention, keep: slice | None = None,
                  routing: Routing | None = None) -> Float[Tensor, "b n hidden"]:
    """The decoder layers on ``ids`` at the positions ``rope`` was taken at (``cos``, ``sin``,
    ``[b, 1, s, D]``); ``attention`` stores keys and values where it needs to and returns the
    attention output. Hidden states after the last layer, before the final norm, at the
    positions ``keep`` (a slice of the ``s``; None: all): the last layer computes its queries'
    attention, output projection and MLP only there, as no later layer reads the others (every
    position's keys and values are still computed). The hidden state stays ``[b·s, hidden]`` so
    every projection is one matrix product, with the residual added inside it (``addmm``). A sparse
    layer sends its tokens to its router's experts, or to ``routing``'s (replay), and records its
    router's choice in ``routing`` (:class:`.moe.Routing`)."""
    b, s = ids.shape
    heads, kv_heads, head_dim = layout.heads, layout.kv_heads, layout.head_dim
    cos, sin = rope
    qk_heads, last = heads + kv_heads, layout.layers - 1
    # as the module's nn.Embedding: the padding row's lookups pass no gradient back, even where that
    # token was sampled and is attended (its LM-head use, when tied, still does)
    h = F.embedding(ids.reshape(-1), weights.embed, padding_idx=layout.padding_idx)
    n = s
    for i, w in enumerate(weights.layers):
        qkv = project(rms_norm(h, w.input_norm, layout.eps), w.qkv, w.qkv_bias, lora=w.qkv_lora)
        qkv = qkv.view(b, s, qk_heads + kv_heads, head_dim)
        # q and k are adjacent heads of the fused product: one norm (where the family has one) and one rotation
        qk = qkv[:, :, :qk_heads] if w.qk_norm is None else head_norm(qkv[:, :, :qk_heads], w.qk_norm, layout.eps)
        qk = rotate(qk.transpose(1, 2), cos, sin)
        q, queries = qk[:, :heads], None
        if i == last and keep is not None:
            q, queries = q[:, :, keep], keep
            h = h.view(b, s, -1)[:, keep].reshape(-1, h.shape[-1])
            n = q.shape[2]
        attn = attention(i, q, qk[:, heads:], qkv[:, :, qk_heads:].transpose(1, 2), queries)
        attn = attn.transpose(1, 2).reshape(b * n, -1)
        h = project(attn, w.out, w.out_bias, residual=h, lora=w.out_lora)
        if w.experts is not None:
            top, cols = layout.experts_per_token, slice(None) if queries is None else queries
            forced = None if routing is None or routing.replay is None else routing.replay[:, cols, i]
            out, own = sparse_mlp(rms_norm(h, w.post_norm, layout.eps), w.experts, top, layout.norm_topk_prob,
                                  None if forced is None else forced.reshape(-1, top))
            if routing is not None and routing.record is not None:
                routing.record[:, cols, i] = own.view(b, n, top).to(routing.record.dtype)
            h = h + out
            continue
        gate, up = project(rms_norm(h, w.post_norm, layout.eps), w.gate_up, lora=w.gate_up_lora).chunk(2, dim=-1)
        h = project(F.silu(gate) * up, w.down, residual=h, lora=w.down_lora)
    return h.view(b, n, -1)


def logits_of(
    weights: FusedWeights, layout: LlamaLayout, hidden: Float[Tensor, "... hidden"]
) -> Float[Tensor, "... v"]:
    """The final norm and LM head on hidden states from :func:`decoder_stack`."""
    shape = hidden.shape[:-1]
    flat = rms_norm(hidden.reshape(-1, hidden.shape[-1]), weights.norm, layout.eps)
    return project(flat, weights.head, weights.head_bias).view(*shape, -1)


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


def response_logits(
    params: dict[str, Tensor],
    inv_freq: Float[Tensor, " half"],
    layout: LlamaLayout,
    input_ids: Int[Tensor, "b s"],
    valid: Bool[Tensor, "b s"],
    positions: Int[Tensor, "b s"],
    response_length: int,
    shared: tuple[Int[Tensor, " g"], Int[Tensor, " b"]] | None = None,
    lora_scale: float | None = None,
    routing: Routing | None = None,
) -> Float[Tensor, "b t v"]:
    """Logits predicting the last ``t = response_length`` tokens: positions ``s-t-1 … s-2``.
    Differentiable in ``params``; ``valid`` is the attention mask (False on padding).

    ``shared = (first, inverse)`` (see :func:`purerl.models.shared_prompts`): row ``i``'s prompt
    (its first ``s - t`` columns) is row ``first[inverse[i]]``'s, so the distinct prompts run
    once, their keys and values are indexed out to every row and the responses run against them.
    Same values (to float rounding), and the same gradients: autograd adds those of a shared
    prompt's keys and values over its rows. ``lora_scale``: the scale of the LoRA adapters in
    ``params`` (see :func:`fused_weights`). ``routing``: a sparse model's routing replay and record
    over ``input_ids`` (:class:`.moe.Routing`).
    """
    weights = fused_weights(params, layout, lora_scale)
    scale = layout.head_dim ** -0.5
    gqa = layout.heads != layout.kv_heads

    def run(ids: Tensor, at: Tensor, mask: Tensor, keep: slice, past: list[tuple[Tensor, Tensor]] | None = None,
            routes: Routing | None = routing) -> tuple[Tensor, list[tuple[Tensor, Tensor]]]:
        kv: list[tuple[Tensor, Tensor]] = []

        def attention(i: int, q: Tensor, k: Tensor, v: Tensor, queries: slice | None) -> Tensor:
            if past is not None:
                k, v = torch.cat((past[i][0], k), 2), torch.cat((past[i][1], v), 2)
            kv.append((k, v))
            m = mask if queries is None else mask[:, :, queries]
            return F.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=scale, enable_gqa=gqa)

        rope = RotaryTable.of(inv_freq, at, dtype=weights.embed.dtype)
        return decoder_stack(weights, (rope.cos[:, None], rope.sin[:, None]), layout, ids, attention, keep,
                             routes), kv

    s, t = input_ids.shape[1], response_length
    if shared is None:
        hidden, _ = run(input_ids, positions, attention_mask(valid, 0), slice(s - t - 1, s - 1))
        return logits_of(weights, layout, hidden)
    first, inverse = shared
    p = s - t
    # a shared prompt runs once, as row first[j]: it replays that row's routing, and its record is every row's
    prompt_routes = response_routes = None
    if routing is not None:
        prompt_routes = Routing(None if routing.replay is None else routing.replay[first, :p],
                                None if routing.record is None else routing.record[first, :p])  # a copy
        response_routes = Routing(None if routing.replay is None else routing.replay[:, p:],
                                  None if routing.record is None else routing.record[:, p:])
    prompt, kv = run(input_ids[first, :p], positions[first, :p], attention_mask(valid[first, :p], 0), slice(p - 1, p),
                     routes=prompt_routes)
    if routing is not None and routing.record is not None:
        routing.record[:, :p] = prompt_routes.record.index_select(0, inverse)
    # one copy of each prompt's keys and values per row; index_select, not x[inverse]: its backward adds
    # the rows' gradients in row order, where indexing's (index_put_ accumulating) adds them with atomics
    # on a CPU's threads, in an order that changes from process to process
    past = [(k.index_select(0, inverse), v.index_select(0, inverse)) for k, v in kv]
    response, _ = run(input_ids[:, p:], positions[:, p:], attention_mask(valid, p), slice(0, t - 1), past,
                      response_routes)
    return logits_of(weights, layout, torch.cat((prompt.index_select(0, inverse), response), 1))
