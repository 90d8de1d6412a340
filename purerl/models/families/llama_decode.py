"""Sampling from Llama-family models with a preallocated (static) KV cache.

Decoding through the HF module costs per token: a growing ``DynamicCache`` (one ``torch.cat`` per
layer and token, so O(T²) copying), mask construction and module dispatch, which dominate for
small models and on GPUs. Here a decoding step is :mod:`purerl.models.families.llama`'s lean decoder stack with
attention over a cache written in place; its logits equal the module's (fp32: to ~1e-6;
``tests/test_llama_decode.py``). :func:`decoding` is the ``llama`` family's decoder for the
embedded engine (:mod:`purerl.models.families`); models :func:`purerl.models.families.llama.supports` does not cover go
through the HF module.

Shapes: ``b`` rows, ``s`` new positions, ``t`` cache capacity (prompt width + max new tokens),
``H`` query heads, ``K`` key/value heads, ``D`` head size.
"""

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple, Protocol, runtime_checkable

import attrs
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
from purerl.models.families.llama import (
    FusedWeights,
    LlamaLayout,
    RotaryTable,
    attention_mask,
    decoder_stack,
    fused_weights,
    layout_of,
    logits_of,
)
from purerl.models.families.moe import Routing
from purerl.models.families.onednn import OneDNNLinear, onednn_runs

__all__ = ["StaticCache", "SharedPrefix", "CacheShape", "DecodeMaths", "LLAMA_MATHS", "decoder_weights", "decoding",
           "forward_last", "decode_step_static", "decode_and_sample", "one_query_attention", "shared_prefix_attention"]


@runtime_checkable
class CacheShape(Protocol):
    """The sizes a cache is made of (a :class:`~purerl.models.families.llama.LlamaLayout`, or
    another family's layout)."""

    layers: int
    kv_heads: int
    head_dim: int


@attrs.frozen
class SharedPrefix:
    """The keys and values of the ``P`` slots that each group of ``n`` consecutive rows shares (a
    prompt and its samples), once per group: ``[g, K, P, D]`` per layer. A decoding step reads
    them once per group instead of once per row (:func:`shared_prefix_attention`)."""

    keys: list[Tensor]
    values: list[Tensor]
    n: int

    @property
    def length(self) -> int:
        return self.keys[0].shape[2]


@attrs.define
class StaticCache:
    """Keys and values of every layer, ``[b, K, t, D]`` each, filled in place; ``valid[b, t]`` marks
    the positions that are real tokens (left padding and unwritten slots are not). ``shared``:
    the first slots' keys and values once per group of rows, when the rows repeat them (set by
    :meth:`repeat_rows`; any other copy drops it)."""

    keys: list[Tensor]
    values: list[Tensor]
    valid: Bool[Tensor, "b t"]
    length: int = 0
    shared: SharedPrefix | None = None

    @classmethod
    def empty(cls, layout: CacheShape, rows: int, capacity: int, *, dtype: torch.dtype,
              device: torch.device) -> "StaticCache":
        shape = (rows, layout.kv_heads, capacity, layout.head_dim)
        # zeros, not empty: masked slots still enter the products (and NaN · 0 is NaN)
        return cls([torch.zeros(shape, dtype=dtype, device=device) for _ in range(layout.layers)],
                   [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layout.layers)],
                   torch.zeros((rows, capacity), dtype=torch.bool, device=device))

    def repeat_rows(self, n: int) -> "StaticCache":
        """Every row ``n`` times in a row (``repeat_interleave``): one prefilled prompt per sample;
        the written slots also kept once per prompt (``shared``)."""
        # copies of the written slots only: the prompt rows' whole capacity need not stay alive
        shared = SharedPrefix([k[:, :, :self.length].clone() for k in self.keys],
                              [v[:, :, :self.length].clone() for v in self.values], n)
        return StaticCache([k.repeat_interleave(n, 0) for k in self.keys],
                           [v.repeat_interleave(n, 0) for v in self.values],
                           self.valid.repeat_interleave(n, 0), self.length, shared)

    def select_rows(self, rows: Int[Tensor, " r"]) -> "StaticCache":
        """Only ``rows``, copied (the batch without its finished rows)."""
        return StaticCache([k[rows] for k in self.keys], [v[rows] for v in self.values], self.valid[rows], self.length)

    def grown(self, capacity: int) -> "StaticCache":
        """A copy with room for ``capacity`` slots (the written ones kept): an earlier turn's cache,
        continued by the next."""
        def grow(x: Tensor) -> Tensor:  # [b, K, t, D] keys/values or [b, t] validity: slots on dim 2 or 1
            dim = 2 if x.dim() == 4 else 1
            out = x.new_zeros((*x.shape[:dim], capacity, *x.shape[dim + 1:]))
            out.narrow(dim, 0, self.length).copy_(x.narrow(dim, 0, self.length))
            return out

        return StaticCache([grow(k) for k in self.keys], [grow(v) for v in self.values], grow(self.valid), self.length)


def one_query_attention(q: Float[Tensor, "b h 1 d"], keys: Float[Tensor, "b k t d"], values: Float[Tensor, "b k t d"],
                        mask: Bool[Tensor, "b 1 1 t"], scale: float) -> Float[Tensor, "b h 1 d"]:
    """Attention of one new token per row over its cache, as two batched products with the query
    heads grouped by the key-value head they share (query head ``h`` reads key-value head
    ``h // (h_q / h_kv)``, as grouped-query attention repeats them), the softmax in float32 (or
    the inputs' wider dtype).
    What ``scaled_dot_product_attention`` computes; on a CPU its kernel for one query costs up to
    12× this (bfloat16) and is never faster."""
    b, heads, _, dim = q.shape
    kv_heads = keys.shape[1]
    grouped = q.reshape(b, kv_heads, heads // kv_heads, dim)
    weights = _attention_weights(torch.matmul(grouped, keys.transpose(-1, -2)), mask, scale, values.dtype)
    return torch.matmul(weights, values).reshape(b, heads, 1, dim)


def _attention_weights(scores: Tensor, mask: Tensor, scale: float, dtype: torch.dtype) -> Tensor:
    """Softmax of the scaled, masked scores, in float32 (or the scores' wider dtype), cast to ``dtype``."""
    scores = scores.to(torch.promote_types(scores.dtype, torch.float32)) * scale
    return torch.softmax(scores.masked_fill(~mask, float("-inf")), -1).to(dtype)


def shared_prefix_attention(q: Float[Tensor, "b h 1 d"], prefix: SharedPrefix, i: int, keys: Float[Tensor, "b k t d"],
                            values: Float[Tensor, "b k t d"], mask: Bool[Tensor, "b 1 1 t"],
                            scale: float) -> Float[Tensor, "b h 1 d"]:
    """:func:`one_query_attention` over a cache whose first ``P = prefix.length`` slots each group
    of ``prefix.n`` rows shares: those keys and values are read once per group (layer ``i`` of
    ``prefix``; the per-row copies in ``keys``/``values`` are not read), the rest per row, under
    one softmax. The same attention, products summed in another order."""
    b, heads, _, dim = q.shape
    n, p = prefix.n, prefix.length
    g, kv_heads = b // n, keys.shape[1]
    per = heads // kv_heads
    grouped = q.reshape(b, kv_heads, per, dim)
    # each group's rows' queries side by side against its shared keys: [g, K, n·G, P]
    by_group = grouped.reshape(g, n, kv_heads, per, dim).transpose(1, 2).reshape(g, kv_heads, n * per, dim)
    shared = torch.matmul(by_group, prefix.keys[i].transpose(-1, -2))
    shared = shared.reshape(g, kv_heads, n, per, p).transpose(1, 2).reshape(b, kv_heads, per, p)
    own = torch.matmul(grouped, keys[:, :, p:].transpose(-1, -2))
    weights = _attention_weights(torch.cat((shared, own), -1), mask, scale, values.dtype)
    on_shared = weights[..., :p].reshape(g, n, kv_heads, per, p).transpose(1, 2).reshape(g, kv_heads, n * per, p)
    out = torch.matmul(on_shared, prefix.values[i])
    out = out.reshape(g, kv_heads, n, per, dim).transpose(1, 2).reshape(b, kv_heads, per, dim)
    return (out + torch.matmul(weights[..., p:], values[:, :, p:])).reshape(b, heads, 1, dim)


def forward_last(
    weights: FusedWeights,
    rotary: RotaryTable,
    layout: LlamaLayout,
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
    itself (:func:`purerl.models.families.llama.attention_mask`).
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

    scale = layout.head_dim ** -0.5
    gqa = layout.heads != layout.kv_heads

    def attention(i: int, q: Tensor, k: Tensor, v: Tensor, queries: slice | None) -> Tensor:
        cache.keys[i][:, :, start:stop] = k
        cache.values[i][:, :, start:stop] = v
        keys, values = cache.keys[i][:, :, :stop], cache.values[i][:, :, :stop]
        if s == 1 and q.device.type == "cpu":
            if cache.shared is not None:
                return shared_prefix_attention(q, cache.shared, i, keys, values, mask, scale)
            return one_query_attention(q, keys, values, mask, scale)
        m = mask if queries is None else mask[:, :, queries]
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=m, scale=scale, enable_gqa=gqa)

    routing = None if record is None else Routing(record=torch.full(
        (b, s, layout.layers, layout.experts_per_token), -1, dtype=torch.int16, device=ids.device))
    hidden = decoder_stack(weights, rotary.at(positions), layout, ids, attention, None if s == 1 else slice(s - 1, s),
                           routing)
    if record is not None:
        record(routing.record)
    return logits_of(weights, layout, hidden[:, -1])


def decode_step_static(
    weights: FusedWeights,
    rotary: RotaryTable,
    layout: LlamaLayout,
    token: Int[Tensor, "b 1"],
    position: Int[Tensor, "b 1"],
    index: Int[Tensor, " 1"],
    cache: StaticCache,
) -> Float[Tensor, "b v"]:
    """One decoding step with every shape fixed (so that a CUDA graph can replay it): the token
    goes to cache slot ``index`` (a device tensor) and attention runs over the whole capacity,
    unwritten slots masked. Same result as :func:`forward_last` with ``s = 1``; ``cache.length``
    is not used or changed. (``cache.shared`` is not read: a CPU runs the sliced step, where it
    pays, unless the step is compiled.)"""
    cache.valid.index_fill_(1, index, True)
    mask = cache.valid[:, None, None, :]  # [b, 1, 1, t]
    scale = layout.head_dim ** -0.5
    gqa = layout.heads != layout.kv_heads

    def attention(i: int, q: Tensor, k: Tensor, v: Tensor, queries: slice | None) -> Tensor:
        cache.keys[i].index_copy_(2, index, k)
        cache.values[i].index_copy_(2, index, v)
        if q.device.type == "cpu":
            return one_query_attention(q, cache.keys[i], cache.values[i], mask, scale)
        return F.scaled_dot_product_attention(q, cache.keys[i], cache.values[i], attn_mask=mask, scale=scale,
                                              enable_gqa=gqa)

    hidden = decoder_stack(weights, rotary.at(position), layout, token, attention)
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
    w = fused_weights(params, layout_of(model.config))
    layers = [x._replace(qkv=OneDNNLinear.of(x.qkv), out=OneDNNLinear.of(x.out),
                      **({} if x.experts is not None else
                         {"gate_up": OneDNNLinear.of(x.gate_up), "down": OneDNNLinear.of(x.down)})) for x in w.layers]
    return w._replace(layers=layers, head=OneDNNLinear.of(w.head))


def decode_and_sample(weights: FusedWeights, rotary: RotaryTable, layout: LlamaLayout,
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
    SwiGLU, the cache writes and the sampler's elementwise work; built on first use, shapes
    dynamic after a second batch size or capacity)."""
    return torch.compile(decode_and_sample)


class DecodeMaths(NamedTuple):
    """What :func:`decoding` computes a family's model with (Llama's: :data:`LLAMA_MATHS`).

    - ``prepare(model, params, capacity, device) -> (weights, rotary, layout)``: what the steps read
      (``params``: the tree, or what the family's ``decoder_weights`` made of it);
    - ``dtype_of(weights)``: the cache's dtype;
    - ``forward_last(weights, rotary, layout, ids, attend, positions, cache) -> logits [b, v]``
      (:func:`forward_last`);
    - ``step``: :func:`decode_and_sample`'s signature and result, every shape fixed;
      ``compiled_step()``: it compiled.
    """

    prepare: Callable[[Any, Any, int, torch.device], tuple[Any, Any, Any]]
    dtype_of: Callable[[Any], torch.dtype]
    forward_last: Callable[..., Tensor]
    step: Callable[..., tuple[Tensor, ...]]
    compiled_step: Callable[[], Callable[..., tuple[Tensor, ...]]]


def _prepare(model: Any, params: dict[str, Tensor] | FusedWeights, capacity: int,
             device: torch.device) -> tuple[FusedWeights, RotaryTable, LlamaLayout]:
    layout = layout_of(model.config)
    weights = params if isinstance(params, FusedWeights) else fused_weights(params, layout)
    rotary = RotaryTable.build(model.buffers["model.rotary_emb.inv_freq"], capacity, dtype=weights.embed.dtype,
                               device=device)
    return weights, rotary, layout


LLAMA_MATHS = DecodeMaths(_prepare, lambda weights: weights.embed.dtype, forward_last, decode_and_sample,
                          _compiled_step)


@contextlib.contextmanager
def decoding(model: Any, params: dict[str, Tensor] | Any, ids: Int[Tensor, "g P"], mask: Bool[Tensor, "g P"],
             positions: Int[Tensor, "g P"], n: int, capacity: int, *, cuda_graphs: bool = True,
             sampler: RowSampler | None = None, compile: bool = False, graphs: GraphPolicy = GraphPolicy(),
             past: StaticCache | None = None, keep_cache: Callable[[StaticCache], None] | None = None,
             maths: DecodeMaths = LLAMA_MATHS, routes: Callable[[Tensor], None] | None = None) -> Iterator[Any]:
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
    ``params``: the params tree, or what the family's ``decoder_weights`` (Llama's:
    :func:`decoder_weights`) made of it. ``maths``: the family's maths (default Llama's). ``routes``
    (a sparse model): given each forward's routing, the prefill's ``[g, P, layers, k]`` first, then
    each step's ``[rows, 1, layers, k]`` (eager steps only)."""
    device = ids.device
    weights, rotary, layout = maths.prepare(model, params, capacity, device)
    sparse = any(getattr(layer, "experts", None) is not None for layer in getattr(weights, "layers", ()))
    if sparse or routes is not None:
        cuda_graphs = compile = False  # each step reads its experts' token counts on the host: eager steps
    recorded = {} if routes is None else {"record": routes}
    dtype = maths.dtype_of(weights)
    if past is None:
        cache = StaticCache.empty(layout, ids.shape[0], capacity, dtype=dtype, device=device)
    else:
        cache = past.grown(capacity)
    first = maths.forward_last(weights, rotary, layout, ids, mask, positions, cache, **recorded)
    if n > 1:
        cache, first = cache.repeat_rows(n), first.repeat_interleave(n, 0)
    rows, steps = cache.valid.shape[0], capacity - cache.length
    capture = capture_for(device) if cuda_graphs else None
    bucket = None if capture is None else graphs.start(rows, steps)
    if bucket is None and compile:
        capture, graphs, bucket = run_eagerly, EXACT, rows
    if capture is not None and bucket is not None:
        sample = None if sampler is None else sampler.sample
        fused = functools.partial(maths.compiled_step() if compile else maths.step, weights, rotary, layout, sample)
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
        return maths.forward_last(weights, rotary, layout, token[:, None], None, position, cache, **recorded)

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
