"""Sampling from Gemma 3 text models with :mod:`.llama_decode`'s static KV cache.

The cache, the prefill-once-per-prompt, the one-query attention kernels, CUDA graphs and
compilation are Llama's (:func:`purerl.models.families.llama_decode.decoding`, given
:data:`MATHS`); what differs is the layer (:func:`purerl.models.families.gemma.decoder_stack`)
and the mask of sliding layers. Every layer keeps its whole cache: a sliding layer masks the
slots further back than its window instead of dropping them. The window is counted in attended
slots (a row's tokens are at consecutive positions, as the engine places them), so it needs no
positions in the cache.

Shapes: ``b`` rows, ``s`` new positions, ``t`` cache capacity.
"""

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from jaxtyping import Bool, Float, Int
from torch import Tensor

from purerl.models.families.gemma import (
    GemmaLayout,
    GemmaWeights,
    decoder_stack,
    gemma_weights,
    inv_freqs,
    layout_of,
    logits_of,
)
from purerl.models.families.llama import RotaryTable, attention_mask
from purerl.models.families.llama_decode import (
    DecodeMaths,
    StaticCache,
    one_query_attention,
    shared_prefix_attention,
)
from purerl.models.families.onednn import OneDNNLinear, onednn_runs

__all__ = ["MATHS", "decoder_weights", "forward_last", "decode_step_static", "decode_and_sample"]

Rotary = tuple[RotaryTable, RotaryTable]
"""The full and the sliding layers' tables."""


def _ropes(rotary: Rotary, positions: Tensor) -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]:
    return rotary[0].at(positions), rotary[1].at(positions)


def _windowed(valid: Bool[Tensor, "b stop"], start: int, window: int) -> Bool[Tensor, "b 1 s stop"]:
    """Which of the ``stop`` slots are within ``window`` attended slots of each query slot
    ``start … stop-1`` (the query itself counts; later slots too, which the causal mask removes)."""
    counts = valid.long().cumsum(-1)
    return ((counts[:, start:, None] - counts[:, None, :]) < window)[:, None]


def forward_last(weights: GemmaWeights, rotary: Rotary, layout: GemmaLayout, ids: Int[Tensor, "b s"],
                 attend: Bool[Tensor, "b s"] | None, positions: Int[Tensor, "b s"], cache: StaticCache,
                 ) -> Float[Tensor, "b v"]:
    """:func:`purerl.models.families.llama_decode.forward_last` for Gemma 3: ``ids`` through the
    model, their keys and values appended to ``cache``, the logits at the last position."""
    b, s = ids.shape
    start, stop = cache.length, cache.length + s
    cache.length = stop
    if s == 1 and attend is None:
        cache.valid[:, start] = True
        full = cache.valid[:, None, None, :stop]
    else:
        cache.valid[:, start:stop] = True if attend is None else attend
        full = attention_mask(cache.valid[:, :stop], start)
    masks = (full, full & _windowed(cache.valid[:, :stop], start, layout.window)) if any(layout.sliding) else (full,)
    gqa = layout.heads != layout.kv_heads

    def attention(i: int, q: Tensor, k: Tensor, v: Tensor, queries: slice | None) -> Tensor:
        cache.keys[i][:, :, start:stop] = k
        cache.values[i][:, :, start:stop] = v
        keys, values = cache.keys[i][:, :, :stop], cache.values[i][:, :, :stop]
        mask = masks[layout.sliding[i]]
        if s == 1 and q.device.type == "cpu":
            if cache.shared is not None:
                return shared_prefix_attention(q, cache.shared, i, keys, values, mask, layout.scale)
            return one_query_attention(q, keys, values, mask, layout.scale)
        m = mask if queries is None else mask[:, :, queries]
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=m, scale=layout.scale, enable_gqa=gqa)

    hidden = decoder_stack(weights, _ropes(rotary, positions), layout, ids, attention,
                           None if s == 1 else slice(s - 1, s))
    return logits_of(weights, layout, hidden[:, -1])


def decode_step_static(weights: GemmaWeights, rotary: Rotary, layout: GemmaLayout, token: Int[Tensor, "b 1"],
                       position: Int[Tensor, "b 1"], index: Int[Tensor, " 1"], cache: StaticCache,
                       ) -> Float[Tensor, "b v"]:
    """:func:`purerl.models.families.llama_decode.decode_step_static` for Gemma 3 (every shape
    fixed; a sliding layer's window counted back from the last attended slot, the new token's)."""
    cache.valid.index_fill_(1, index, True)
    valid = cache.valid
    full = valid[:, None, None, :]
    # attended slots after each one: the new token is the last attended slot
    sliding = full & ((valid.sum(-1, keepdim=True) - valid.long().cumsum(-1)) < layout.window)[:, None, None]
    masks = (full, sliding)
    gqa = layout.heads != layout.kv_heads

    def attention(i: int, q: Tensor, k: Tensor, v: Tensor, queries: slice | None) -> Tensor:
        cache.keys[i].index_copy_(2, index, k)
        cache.values[i].index_copy_(2, index, v)
        mask = masks[layout.sliding[i]]
        if q.device.type == "cpu":
            return one_query_attention(q, cache.keys[i], cache.values[i], mask, layout.scale)
        return F.scaled_dot_product_attention(q, cache.keys[i], cache.values[i], attn_mask=mask, scale=layout.scale,
                                              enable_gqa=gqa)

    hidden = decoder_stack(weights, _ropes(rotary, position), layout, token, attention)
    return logits_of(weights, layout, hidden[:, -1])


def decode_and_sample(weights: GemmaWeights, rotary: Rotary, layout: GemmaLayout,
                      sample: Callable[..., tuple[Tensor, Tensor]] | None, token: Int[Tensor, "B 1"],
                      position: Int[Tensor, "B 1"], index: Int[Tensor, " 1"], step: Int[Tensor, " 1"],
                      keys: Int[Tensor, " B"] | None, cache: StaticCache) -> tuple[Tensor, ...]:
    """:func:`decode_step_static`, then the sampler (as
    :func:`purerl.models.families.llama_decode.decode_and_sample`)."""
    logits = decode_step_static(weights, rotary, layout, token, position, index, cache)
    return (logits,) if sample is None else sample(logits, keys, step)


@functools.cache
def _compiled_step() -> Callable[..., tuple[Tensor, ...]]:
    return torch.compile(decode_and_sample)


def decoder_weights(model: Any, params: dict[str, Tensor], *, onednn: bool = True) -> GemmaWeights | dict[str, Tensor]:
    """What decoding reads for ``params`` over many calls: as
    :func:`purerl.models.families.llama_decode.decoder_weights` (on a CPU with oneDNN, the weights
    fused once with every projection and the LM head prepacked; else ``params`` themselves)."""
    some = next(iter(params.values()))
    if not onednn or some.device.type != "cpu" or not onednn_runs(some.dtype):
        return params
    w = gemma_weights(params, layout_of(model.config))
    layers = [x._replace(qkv=OneDNNLinear.of(x.qkv), out=OneDNNLinear.of(x.out),
                         gate_up=OneDNNLinear.of(x.gate_up), down=OneDNNLinear.of(x.down)) for x in w.base.layers]
    return w._replace(base=w.base._replace(layers=layers, head=OneDNNLinear.of(w.base.head)))


def _prepare(model: Any, params: Any, capacity: int, device: torch.device) -> tuple[GemmaWeights, Rotary, GemmaLayout]:
    layout = layout_of(model.config)
    weights = params if isinstance(params, GemmaWeights) else gemma_weights(params, layout)
    dtype = weights.base.embed.dtype
    full, sliding = (RotaryTable.build(f, capacity, dtype=dtype, device=device) for f in inv_freqs(model))
    return weights, (full, sliding), layout


MATHS = DecodeMaths(_prepare, lambda weights: weights.base.embed.dtype, forward_last, decode_and_sample,
                    _compiled_step)
"""What :func:`purerl.models.families.llama_decode.decoding` computes a Gemma 3 model with."""
