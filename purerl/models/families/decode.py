"""Sampling from every lean family with a preallocated (static) KV cache: the embedded engine's decoding.

Decoding through the HF module costs per token: a growing ``DynamicCache``, mask construction and
module dispatch, which dominate for small models and on GPUs. Here a decoding step is the shared
decoder stack (:func:`purerl.models.families.decoder.decoder_stack`, as the model's variant) with
attention over a cache written in place (:mod:`.kv_cache`); its logits equal the module's (fp32: to
~1e-6; ``tests/test_llama_decode.py``, ``tests/test_family_exactness.py``). A sliding layer masks
the slots further back than its window (:func:`.kv_cache.window_slots`). :func:`decoding` is every
lean family's decoder for the embedded engine (:mod:`purerl.models.families`); a fixed-shape step
(:func:`decode_and_sample`) is what CUDA graphs replay (:mod:`.decode_graph`).

Shapes: ``b`` rows, ``s`` new positions, ``t`` cache capacity (prompt width + max new tokens),
``H`` query heads, ``K`` key/value heads, ``D`` head size.
"""

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from jaxtyping import Bool, Float, Int
from torch import Tensor

from purerl.models.families.decode_graph import (
    EXACT,
    BucketedDecoder,
    GraphPolicy,
    RowSampler,
    capture_for,
    run_eagerly,
    sampled,
)
from purerl.models.families.decoder import attention_mask, decoder_stack, logits_of
from purerl.models.families.kv_cache import (
    StaticCache,
    one_query_attention,
    shared_prefix_attention,
    window_slots,
    window_slots_of_last,
)
from purerl.models.families.moe import Routing
from purerl.models.families.onednn import OneDNNLinear, onednn_runs
from purerl.models.families.rotary import RotaryTable, inv_freqs, ropes_at
from purerl.models.families.weights import FusedWeights, Layout, fused_weights, layout_of

__all__ = ["Rotary", "decode_and_sample", "decode_step_static", "decoder_weights", "decoding", "forward_last"]

Rotary = RotaryTable | tuple[RotaryTable, ...]
"""The rotary table of every layer, or one per layer kind (:func:`.rotary.ropes_at`), built once
for a call's capacity."""


def forward_last(
    weights: FusedWeights,
    rotary: Rotary,
    layout: Layout,
    ids: Int[Tensor, "b s"],
    attend: Bool[Tensor, "b s"] | None,
    positions: Int[Tensor, "b s"],
    cache: StaticCache,
    record: Callable[[Tensor], None] | None = None,
) -> Float[Tensor, "b v"]:
    """Run ``ids`` (new tokens at ``positions``; ``attend`` False for padding, None when every new
    position is a real token) through the model, appending their keys and values to ``cache``, and
    return the logits at the last position. ``record``: given a sparse model's routing of ``ids``,
    ``[b, s, layers, k]`` (:class:`.moe.Routing`'s record).

    Each new position attends to the valid cached positions and the valid new positions up to
    itself (:func:`purerl.models.families.decoder.attention_mask`), within its window on a sliding
    layer.
    """
    b, s = ids.shape
    start, stop = cache.length, cache.length + s
    cache.length = stop
    if s == 1 and attend is None:  # a decoding step: the new token sees every valid slot
        cache.valid[:, start] = True
        mask = cache.valid[:, None, None, :stop]
    else:
        cache.valid[:, start:stop] = True if attend is None else attend
        mask = attention_mask(cache.valid[:, :stop], start)
    if any(layout.sliding):
        masks = (mask, mask & window_slots(cache.valid[:, :stop], start, layout.window))
    else:
        masks = (mask,)
    scale, gqa = layout.scale, layout.heads != layout.kv_heads

    def attention(i: int, q: Tensor, k: Tensor, v: Tensor, queries: slice | None) -> Tensor:
        cache.keys[i][:, :, start:stop] = k
        cache.values[i][:, :, start:stop] = v
        keys, values = cache.keys[i][:, :, :stop], cache.values[i][:, :, :stop]
        mask = masks[layout.sliding[i]]
        if s == 1 and q.device.type == "cpu":
            if cache.shared is not None:
                return shared_prefix_attention(q, cache.shared, i, keys, values, mask, scale)
            return one_query_attention(q, keys, values, mask, scale)
        m = mask if queries is None else mask[:, :, queries]
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=m, scale=scale, enable_gqa=gqa)

    routing = None if record is None else Routing(record=torch.full(
        (b, s, layout.layers, layout.experts_per_token), -1, dtype=torch.int16, device=ids.device))
    hidden = decoder_stack(weights, ropes_at(rotary, positions), layout, ids, attention,
                           None if s == 1 else slice(s - 1, s), routing)
    if record is not None:
        record(routing.record)
    return logits_of(weights, layout, hidden[:, -1])


def decode_step_static(
    weights: FusedWeights,
    rotary: Rotary,
    layout: Layout,
    token: Int[Tensor, "b 1"],
    position: Int[Tensor, "b 1"],
    index: Int[Tensor, " 1"],
    cache: StaticCache,
) -> Float[Tensor, "b v"]:
    """One decoding step with every shape fixed (so that a CUDA graph can replay it): the token
    goes to cache slot ``index`` (a device tensor) and attention runs over the whole capacity,
    unwritten slots masked (a sliding layer's window counted back from the last attended slot, the
    new token's). Same result as :func:`forward_last` with ``s = 1``; ``cache.length`` is not used
    or changed. (``cache.shared`` is not read: a CPU runs the sliced step, where it pays, unless
    the step is compiled.)"""
    cache.valid.index_fill_(1, index, True)
    mask = cache.valid[:, None, None, :]  # [b, 1, 1, t]
    masks = (mask, mask & window_slots_of_last(cache.valid, layout.window)) if any(layout.sliding) else (mask,)
    scale, gqa = layout.scale, layout.heads != layout.kv_heads

    def attention(i: int, q: Tensor, k: Tensor, v: Tensor, queries: slice | None) -> Tensor:
        cache.keys[i].index_copy_(2, index, k)
        cache.values[i].index_copy_(2, index, v)
        mask = masks[layout.sliding[i]]
        if q.device.type == "cpu":
            return one_query_attention(q, cache.keys[i], cache.values[i], mask, scale)
        return F.scaled_dot_product_attention(q, cache.keys[i], cache.values[i], attn_mask=mask, scale=scale,
                                              enable_gqa=gqa)

    hidden = decoder_stack(weights, ropes_at(rotary, position), layout, token, attention)
    return logits_of(weights, layout, hidden[:, -1])


def decoder_weights(model: Any, params: dict[str, Tensor], *, onednn: bool = True) -> FusedWeights | dict[str, Tensor]:
    """What :func:`decoding` should read for ``params`` over many calls: on a CPU with oneDNN
    (``onednn``), the fused weights with every projection and the LM head prepacked
    (:class:`~purerl.models.families.onednn.OneDNNLinear`: a copy of the matrices, made once per
    weights version); else ``params`` themselves (each call fuses what it needs, and holds no
    second copy: on a GPU the trainer's memory is the engine's)."""
    some = next(iter(params.values()))
    if not onednn or some.device.type != "cpu" or not onednn_runs(some.dtype):
        return params
    w = fused_weights(params, layout_of(model.config), lazy=True)  # a layer's fused copy lives until it is packed
    layers = [x._replace(qkv=OneDNNLinear.of(x.qkv), out=OneDNNLinear.of(x.out),
                         **({} if x.experts is not None else
                            {"gate_up": OneDNNLinear.of(x.gate_up), "down": OneDNNLinear.of(x.down)}))
              for x in w.layers]
    return w._replace(layers=layers, head=OneDNNLinear.of(w.head))


def decode_and_sample(weights: FusedWeights, rotary: Rotary, layout: Layout,
                      sample: Callable[..., tuple[Tensor, Tensor]] | None, token: Int[Tensor, "B 1"],
                      position: Int[Tensor, "B 1"], index: Int[Tensor, " 1"], step: Int[Tensor, " 1"],
                      keys: Int[Tensor, " B"] | None, cache: StaticCache) -> tuple[Tensor, ...]:
    """:func:`decode_step_static`, then ``sample(logits, keys, step)``'s ``(token [B], log-prob
    [B])`` (:class:`purerl.rollout.sampling.TokenSampler`); without ``sample``, ``(logits,)``.
    Every shape fixed and no host read: the step a CUDA graph captures, one token per replay
    (:class:`~purerl.models.families.decode_graph.BucketedDecoder`)."""
    logits = decode_step_static(weights, rotary, layout, token, position, index, cache)
    return (logits,) if sample is None else sample(logits, keys, step)


@functools.cache
def _compiled_step() -> Callable[..., tuple[Tensor, ...]]:
    """:func:`decode_and_sample` compiled by ``torch.compile`` (inductor fuses the norms, rotary,
    the gated MLP, the cache writes and the sampler's elementwise work; built on first use, shapes
    dynamic after a second batch size or capacity)."""
    return torch.compile(decode_and_sample)


def _prepare(model: Any, params: dict[str, Tensor] | FusedWeights, capacity: int,
             device: torch.device) -> tuple[FusedWeights, Rotary, Layout]:
    """What the steps read: the fused weights (``params``, or what :func:`decoder_weights` made of
    them), each layer kind's rotary table for ``capacity`` positions, the layout."""
    layout = layout_of(model.config)
    weights = params if isinstance(params, FusedWeights) else fused_weights(params, layout)
    dtype = weights.embed.dtype
    return weights, tuple(RotaryTable.build(f, capacity, dtype=dtype, device=device) for f in inv_freqs(model)), layout


@contextlib.contextmanager
def decoding(model: Any, params: dict[str, Tensor] | Any, ids: Int[Tensor, "g P"], mask: Bool[Tensor, "g P"],
             positions: Int[Tensor, "g P"], n: int, capacity: int, *, cuda_graphs: bool = True,
             sampler: RowSampler | None = None, compile: bool = False, graphs: GraphPolicy = GraphPolicy(),
             past: StaticCache | None = None, keep_cache: Callable[[StaticCache], None] | None = None,
             routes: Callable[[Tensor], None] | None = None) -> Iterator[Any]:
    """Decode ``n`` samples of each left-padded prompt with a static cache of ``capacity`` positions
    (see :data:`purerl.models.families.Decoding`). Each prompt is prefilled once and its cache repeated
    ``n`` times.

    ``sampler``: each step's draw (:class:`~purerl.models.families.decode_graph.RowSampler`); the
    context then yields :data:`~purerl.models.families.decode_graph.SampledDecoding` (tokens and
    log-probs) instead of logits. On CUDA with ``cuda_graphs`` the decoding step, the sampler
    inside it, is captured as a CUDA graph for the batch's bucket of rows (``graphs``; eager
    where it says so) and replayed per token. ``compile``: the fixed-shape step (and sampler)
    compiled by ``torch.compile``, inside the graph on CUDA, run eagerly elsewhere. Otherwise each
    step runs :func:`forward_last` (on a CPU: attention over the written slots only, the prompt's
    keys read once per group).

    ``past``: an earlier call's cache (one row per prompt) that ``ids`` continue: only they are
    prefilled, at ``positions``, after its written slots (``capacity`` counts those too).
    ``keep_cache`` receives the cache of the batch's rows when decoding ends (for the next turn).
    ``params``: the params tree, or what :func:`decoder_weights` made of it. ``routes`` (a sparse
    model): given each forward's routing, the prefill's ``[g, P, layers, k]`` first, then each
    step's ``[rows, 1, layers, k]`` (eager steps only)."""
    device = ids.device
    weights, rotary, layout = _prepare(model, params, capacity, device)
    if any(layer.experts is not None for layer in weights.layers) or routes is not None:
        cuda_graphs = compile = False  # each step reads its experts' token counts on the host: eager steps
    recorded = {} if routes is None else {"record": routes}
    if past is None:
        cache = StaticCache.empty(layout, ids.shape[0], capacity, dtype=weights.embed.dtype, device=device)
    else:
        cache = past.grown(capacity)
    first = forward_last(weights, rotary, layout, ids, mask, positions, cache, **recorded)
    if n > 1:
        cache, first = cache.repeat_rows(n), first.repeat_interleave(n, 0)
    rows, steps = cache.valid.shape[0], capacity - cache.length
    capture = capture_for(device) if cuda_graphs else None
    bucket = None if capture is None else graphs.start(rows, steps)
    if bucket is None and compile:
        capture, graphs, bucket = run_eagerly, EXACT, rows
    if capture is not None and bucket is not None:
        sample = None if sampler is None else sampler.sample
        fused = functools.partial(_compiled_step() if compile else decode_and_sample, weights, rotary, layout, sample)
        decoder = BucketedDecoder(fused, cache, None if sampler is None else sampler.keys,
                                  step=0 if sampler is None else sampler.start + 1, steps=steps, policy=graphs,
                                  capture=capture, bucket=bucket)
        keep = decoder.keep if graphs.can_shrink(steps) else None
        if sampler is None:
            yield first, lambda token, position: decoder.advance(token, position)[0], keep
        else:
            yield sampler.sample(first, sampler.keys, sampler.start), decoder.advance, keep
        if keep_cache is not None:
            keep_cache(decoder.kept_cache())
        return

    def advance(token: Tensor, position: Tensor) -> Tensor:
        return forward_last(weights, rotary, layout, token[:, None], None, position, cache, **recorded)

    def keep(rows: Tensor) -> None:
        nonlocal cache
        cache = cache.select_rows(rows)

    @contextlib.contextmanager
    def steps_of_logits() -> Iterator[Any]:
        yield first, advance, keep

    with steps_of_logits() if sampler is None else sampled(steps_of_logits(), sampler) as decoding:
        yield decoding
    if keep_cache is not None:
        keep_cache(cache)
