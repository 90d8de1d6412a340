"""A lean forward for Gemma 3 text models (``Gemma3ForCausalLM``, model_type ``gemma3_text``), as
plain functions of the params tree.

What Gemma 3 changes in Llama's block (``transformers/models/gemma3/modeling_gemma3.py``):

- RMSNorm scales by ``1 + w`` (weights stored around 0), in float32, cast back after the scale;
- four norms a layer: before and after attention (the latter on the attention output, before the
  residual), before and after the MLP; q and k RMS-normalised per head before the rotation;
- the MLP is GELU-tanh gated; embeddings are multiplied by ``√hidden`` rounded to their dtype;
- attention is scaled by ``query_pre_attn_scalar ** -0.5``;
- ``layer_types`` makes some layers sliding-window layers: a query at position ``p`` sees keys at
  positions ``> p - sliding_window`` only, and those layers rotate with their own base
  (``rope_local_base_freq``: the ``sliding_attention`` inv_freq buffer);
- logits are soft-capped, ``c · tanh(x / c)``, where ``final_logit_softcapping`` is set.

Llama's pieces are reused where the maths is the same: the fused q/k/v and gate/up projections
and their LoRA updates (:func:`~purerl.models.families.llama.fused_weights`,
:func:`~purerl.models.families.llama.project`), the rotary tables, the attention masks. Windows
are counted in positions, which equal slot distances where a row's tokens are contiguous (what
the HF module counts).

Users: :func:`response_logits` (padded), :func:`packed_response_logits` (no compute on padding)
and :mod:`purerl.models.families.gemma_decode` (KV-cache decoding).

Shapes: ``b`` rows, ``s`` positions, ``H`` query heads, ``K`` key/value heads, ``D`` head size.
"""

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from jaxtyping import Bool, Float, Int
from torch import Tensor

from purerl.models.families.llama import (
    Attention,
    FusedWeights,
    LlamaLayout,
    RotaryTable,
    attention_mask,
    fused_weights,
    project,
    rotate,
)
from purerl.models.families.llama_packed import packed_logits, segments_attention

__all__ = ["GemmaLayout", "GemmaWeights", "supports", "unsupported", "layout_of", "gemma_weights", "decoder_stack",
           "logits_of", "window_mask", "response_logits", "packed_response_logits"]

MODEL_TYPES = ("gemma3_text",)
_ROPE_TYPES = ("default", "linear")  # inv_freq changes, attention is not rescaled
_GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh")  # the names HF maps to GELU's tanh approximation
_KINDS = ("sliding_attention", "full_attention")


def unsupported(model: Any) -> str | None:
    """Why this module would not compute what ``model`` (a Gemma 3 text model) computes: the first
    setting it does not implement (a phrase for the log); None where it would, and for a model of
    another architecture."""
    config = model.config
    if getattr(config, "model_type", None) not in MODEL_TYPES:
        return None
    rotary = getattr(getattr(model.module, "model", None), "rotary_emb", None)
    kinds = tuple(getattr(config, "layer_types", None) or ())
    if getattr(config, "hidden_activation", None) not in _GELU_TANH:
        return f"hidden_activation {getattr(config, 'hidden_activation', None)!r} (it runs GELU-tanh)"
    if len(kinds) != config.num_hidden_layers or any(kind not in _KINDS for kind in kinds):
        return f"layer_types {kinds!r} (it implements {', '.join(_KINDS)})"
    for kind in set(kinds):
        rope_type = getattr(rotary, "rope_type", {}).get(kind)
        if f"model.rotary_emb.{kind}_inv_freq" not in model.buffers:
            return f"no {kind} rotary embedding with an inv_freq buffer"
        if rope_type not in _ROPE_TYPES:
            return f"rope_type {rope_type!r} (it implements {', '.join(_ROPE_TYPES)})"
        if float(getattr(rotary, f"{kind}_attention_scaling", 1.0)) != 1.0:
            return f"rope attention_scaling {float(getattr(rotary, f'{kind}_attention_scaling'))} (it implements 1)"
    if getattr(config, "use_bidirectional_attention", False):
        return "bidirectional attention"
    # transformers' Gemma3Attention (5.x) never passes this to its attention functions; refused all the same,
    # so that a module that honours it is never silently computed without it
    if getattr(config, "attn_logit_softcapping", None) is not None:
        return "attn_logit_softcapping (it implements none)"
    if "sliding_attention" in kinds and not getattr(config, "sliding_window", None):
        return "sliding layers without a sliding_window"
    return None


def supports(model: Any) -> bool:
    """Whether this module computes exactly what ``model`` (a CausalLM skeleton) does."""
    return getattr(model.config, "model_type", None) in MODEL_TYPES and unsupported(model) is None


class GemmaLayout(NamedTuple):
    """Sizes and settings of a Gemma 3 model (from its HF config). ``sliding[i]``: layer ``i`` is a
    sliding-window layer, seeing the last ``window`` positions (itself included)."""

    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    padding_idx: int | None
    sliding: tuple[bool, ...]
    window: int
    scale: float  # attention: query_pre_attn_scalar ** -0.5
    embed_scale: float  # √hidden
    softcap: float | None  # final_logit_softcapping

    @property
    def llama(self) -> LlamaLayout:
        return LlamaLayout(self.layers, self.heads, self.kv_heads, self.head_dim, self.eps, self.padding_idx)


def layout_of(config: Any) -> GemmaLayout:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    pad = getattr(config, "pad_token_id", None)
    softcap = getattr(config, "final_logit_softcapping", None)
    return GemmaLayout(config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads, head_dim,
                       float(config.rms_norm_eps), pad if isinstance(pad, int) else None,
                       tuple(kind == "sliding_attention" for kind in config.layer_types),
                       int(config.sliding_window or 0), float(config.query_pre_attn_scalar) ** -0.5,
                       config.hidden_size ** 0.5, None if softcap is None else float(softcap))


class GemmaWeights(NamedTuple):
    """What the lean forward reads: Llama's fused layers (``input_norm``, ``post_norm``: the
    post-attention norm, ``qk_norm``: each q head's then each k head's), every norm weight held as
    ``1 + w`` in float32; ``ffn_norms[i]``: layer ``i``'s pre- and post-feedforward norms, likewise."""

    base: FusedWeights
    ffn_norms: list[tuple[Tensor, Tensor]]


def _plus_one(w: Tensor) -> Tensor:
    return 1.0 + w.float()


def gemma_weights(params: dict[str, Tensor], layout: GemmaLayout, lora_scale: float | None = None) -> GemmaWeights:
    """The params tree rearranged for the lean forward (:func:`~purerl.models.families.llama.fused_weights`,
    differentiable; LoRA adapters as there)."""
    base = fused_weights(params, layout.llama, lora_scale)
    layers = [w._replace(input_norm=_plus_one(w.input_norm), post_norm=_plus_one(w.post_norm),
                         qk_norm=_plus_one(w.qk_norm)) for w in base.layers]
    ffn = [(_plus_one(params[f"model.layers.{i}.pre_feedforward_layernorm.weight"]),
            _plus_one(params[f"model.layers.{i}.post_feedforward_layernorm.weight"])) for i in range(layout.layers)]
    return GemmaWeights(base._replace(layers=layers, norm=_plus_one(base.norm)), ffn)


def rms_norm(x: Tensor, weight: Float[Tensor, "*shape"], eps: float) -> Tensor:
    """``Gemma3RMSNorm`` with its ``1 + w`` given (float32): normalise and scale in float32, then
    cast back. ``weight``'s shape may cover more than the last dim (one per head: it broadcasts)."""
    if x.dtype == torch.float32 and weight.dim() == 1:
        return torch.rms_norm(x, (x.shape[-1],), weight, eps)
    return (torch.rms_norm(x.float(), (x.shape[-1],), None, eps) * weight).to(x.dtype)


def decoder_stack(weights: GemmaWeights, ropes: tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]],
                  layout: GemmaLayout, ids: Int[Tensor, "b s"], attention: Attention, keep: slice | None = None,
                  ) -> Float[Tensor, "b n hidden"]:
    """The decoder layers on ``ids``: as :func:`purerl.models.families.llama.decoder_stack`
    (``keep``, ``attention``), with ``ropes[sliding]`` the ``(cos, sin)`` ``[b, 1, s, D]`` of a
    full (``ropes[0]``) or sliding (``ropes[1]``) layer; ``attention`` picks each layer's mask."""
    b, s = ids.shape
    heads, kv_heads, head_dim = layout.heads, layout.kv_heads, layout.head_dim
    qk_heads, last, base = heads + kv_heads, layout.layers - 1, weights.base
    h = F.embedding(ids.reshape(-1), base.embed, padding_idx=layout.padding_idx)
    h = h * float(torch.tensor(layout.embed_scale).to(h.dtype))  # √hidden rounded to the embedding's dtype, as HF
    n = s
    for i, (w, (pre_ffn, post_ffn)) in enumerate(zip(base.layers, weights.ffn_norms)):
        cos, sin = ropes[layout.sliding[i]]
        qkv = project(rms_norm(h, w.input_norm, layout.eps), w.qkv, w.qkv_bias, lora=w.qkv_lora)
        qkv = qkv.view(b, s, qk_heads + kv_heads, head_dim)
        qk = rotate(rms_norm(qkv[:, :, :qk_heads], w.qk_norm, layout.eps).transpose(1, 2), cos, sin)
        q, queries = qk[:, :heads], None
        if i == last and keep is not None:
            q, queries = q[:, :, keep], keep
            h = h.view(b, s, -1)[:, keep].reshape(-1, h.shape[-1])
            n = q.shape[2]
        attn = attention(i, q, qk[:, heads:], qkv[:, :, qk_heads:].transpose(1, 2), queries)
        attn = project(attn.transpose(1, 2).reshape(b * n, -1), w.out, w.out_bias, lora=w.out_lora)
        h = h + rms_norm(attn, w.post_norm, layout.eps)
        gate, up = project(rms_norm(h, pre_ffn, layout.eps), w.gate_up, lora=w.gate_up_lora).chunk(2, dim=-1)
        h = h + rms_norm(project(F.gelu(gate, approximate="tanh") * up, w.down, lora=w.down_lora), post_ffn,
                         layout.eps)
    return h.view(b, n, -1)


def logits_of(weights: GemmaWeights, layout: GemmaLayout,
              hidden: Float[Tensor, "... hidden"]) -> Float[Tensor, "... v"]:
    """The final norm, the LM head and the soft-cap (where the config sets one)."""
    shape, base = hidden.shape[:-1], weights.base
    logits = project(rms_norm(hidden.reshape(-1, hidden.shape[-1]), base.norm, layout.eps), base.head,
                     base.head_bias)
    if layout.softcap is not None:
        logits = torch.tanh(logits / layout.softcap) * layout.softcap
    return logits.view(*shape, -1)


def ropes_of(inv_freq: tuple[Tensor, Tensor], positions: Tensor, dtype: torch.dtype,
             ) -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]:
    """The full and sliding layers' ``(cos, sin)`` at ``positions`` ``[b, s]``, ``[b, 1, s, D]`` each."""
    tables = [RotaryTable.of(f, positions, dtype=dtype) for f in inv_freq]
    return tuple((t.cos[:, None], t.sin[:, None]) for t in tables)  # type: ignore[return-value]


def inv_freqs(model: Any) -> tuple[Tensor, Tensor]:
    """The full and sliding layers' inv_freq buffers (one stands in for the other where a model has
    layers of one kind only)."""
    full = model.buffers.get("model.rotary_emb.full_attention_inv_freq")
    sliding = model.buffers.get("model.rotary_emb.sliding_attention_inv_freq")
    return (full if full is not None else sliding, sliding if sliding is not None else full)


def window_mask(query_positions: Int[Tensor, "b n"], key_positions: Int[Tensor, "b m"], window: int,
                ) -> Bool[Tensor, "b 1 n m"]:
    """Keys at most ``window - 1`` positions before the query (and any after it: the causal mask
    removes those)."""
    return ((query_positions[:, :, None] - key_positions[:, None, :]) < window)[:, None]


def response_logits(
    params: dict[str, Tensor],
    inv_freq: tuple[Tensor, Tensor],
    layout: GemmaLayout,
    input_ids: Int[Tensor, "b s"],
    valid: Bool[Tensor, "b s"],
    positions: Int[Tensor, "b s"],
    response_length: int,
    shared: tuple[Int[Tensor, " g"], Int[Tensor, " b"]] | None = None,
    lora_scale: float | None = None,
) -> Float[Tensor, "b t v"]:
    """:func:`purerl.models.families.llama.response_logits` for Gemma 3 (``inv_freq``: the full and
    sliding layers' buffers, :func:`inv_freqs`): logits predicting the last ``t`` tokens,
    differentiable in ``params``, shared prompts run once."""
    weights = gemma_weights(params, layout, lora_scale)
    gqa = layout.heads != layout.kv_heads

    def run(ids: Tensor, at: Tensor, mask: Tensor, key_positions: Tensor, keep: slice,
            past: list[tuple[Tensor, Tensor]] | None = None) -> tuple[Tensor, list[tuple[Tensor, Tensor]]]:
        kv: list[tuple[Tensor, Tensor]] = []
        masks = (mask, mask & window_mask(at, key_positions, layout.window))

        def attention(i: int, q: Tensor, k: Tensor, v: Tensor, queries: slice | None) -> Tensor:
            if past is not None:
                k, v = torch.cat((past[i][0], k), 2), torch.cat((past[i][1], v), 2)
            kv.append((k, v))
            m = masks[layout.sliding[i]]
            m = m if queries is None else m[:, :, queries]
            return F.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=layout.scale, enable_gqa=gqa)

        return decoder_stack(weights, ropes_of(inv_freq, at, weights.base.embed.dtype), layout, ids, attention,
                             keep), kv

    s, t = input_ids.shape[1], response_length
    if shared is None:
        hidden, _ = run(input_ids, positions, attention_mask(valid, 0), positions, slice(s - t - 1, s - 1))
        return logits_of(weights, layout, hidden)
    first, inverse = shared
    p = s - t
    prompt, kv = run(input_ids[first, :p], positions[first, :p], attention_mask(valid[first, :p], 0),
                     positions[first, :p], slice(p - 1, p))
    past = [(k.index_select(0, inverse), v.index_select(0, inverse)) for k, v in kv]  # see llama.response_logits
    response, _ = run(input_ids[:, p:], positions[:, p:], attention_mask(valid, p), positions, slice(0, t - 1), past)
    return logits_of(weights, layout, torch.cat((prompt.index_select(0, inverse), response), 1))


def packed_response_logits(
    params: dict[str, Tensor],
    inv_freq: tuple[Tensor, Tensor],
    layout: GemmaLayout,
    input_ids: Int[Tensor, "b s"],
    valid: Bool[Tensor, "b s"],
    positions: Int[Tensor, "b s"],
    response_length: int,
    shared: tuple[Int[Tensor, " g"], Int[Tensor, " b"]] | None = None,
    lora_scale: float | None = None,
) -> Float[Tensor, "b t v"]:
    """:func:`response_logits` with no compute on padding, as
    :func:`purerl.models.families.llama_packed.packed_response_logits` (logits 0 where the input at
    a predicting position is padding)."""
    weights = gemma_weights(params, layout, lora_scale)

    def run(ids: Tensor, at: Tensor, mask: Tensor, prefixes: list | None = None, kept: list | None = None) -> Tensor:
        lengths = mask.sum(1).tolist()
        flat = mask.reshape(-1)
        ropes = ropes_of(inv_freq, at.reshape(-1)[flat][None], weights.base.embed.dtype)
        attention = segments_attention(lengths, layout.scale, layout.heads != layout.kv_heads, prefixes, kept,
                                       lambda i: layout.window if layout.sliding[i] else None)
        return decoder_stack(weights, ropes, layout, ids.reshape(-1)[flat][None], attention)[0]

    return packed_logits(run, lambda hidden: logits_of(weights, layout, hidden), input_ids, valid, positions,
                         response_length, shared)
