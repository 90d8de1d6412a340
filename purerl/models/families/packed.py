"""The shared decoder's training forward with no compute on padding (``actor.packed_forwards``): a
micro-batch's valid tokens run as one packed stream, attention kept inside each row (a sliding
layer's also inside its window). The same logits as
:func:`purerl.models.families.decoder.response_logits`, to float rounding."""

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from jaxtyping import Bool, Float, Int
from torch import Tensor

from purerl.models.families.decoder import (
    Attention,
    Layout,
    LMHead,
    decoder_stack,
    final_norm,
    fused_weights,
    lazy_layers,
    lm_head,
    logits_of,
)
from purerl.models.families.moe import Routing
from purerl.models.families.rotary import ropes_of

__all__ = ["packed_logits", "packed_response_logits", "segments_attention"]


def segments_attention(lengths: list[int], scale: float, gqa: bool,
                       prefixes: list[list[tuple[Tensor, Tensor]]] | None = None,
                       kept: list[list[tuple[Tensor, Tensor]]] | None = None,
                       window: Callable[[int], int | None] | None = None) -> Attention:
    """Attention over one packed stream of segments of ``lengths`` tokens: each segment attends
    causally to itself (and, with ``prefixes[layer][segment]``, first to those keys and values),
    never to another segment. ``kept``, when given, receives each layer's per-segment keys and
    values (for a later stream to continue from). ``window(layer)``: a sliding layer's window (a
    query sees the keys less than that many positions back; None: every earlier key)."""

    def attention(i: int, q: Tensor, k: Tensor, v: Tensor, queries: slice | None) -> Tensor:
        outs, layer = [], []
        for j, (qs, ks, vs) in enumerate(zip(q.split(lengths, 2), k.split(lengths, 2), v.split(lengths, 2))):
            layer.append((ks, vs))
            if prefixes is not None:
                pk, pv = prefixes[i][j]
                ks, vs = torch.cat((pk, ks), 2), torch.cat((pv, vs), 2)
            if qs.shape[2] == 0:
                outs.append(qs)
                continue
            sliding = None if window is None else window(i)
            if ks.shape[2] == qs.shape[2] and sliding is None:
                outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=gqa))
            else:  # queries are the last of the keys: each sees the prefix and the segment up to itself
                n, m = qs.shape[2], ks.shape[2]
                mask = torch.ones((n, m), dtype=torch.bool, device=qs.device).tril(m - n)
                if sliding is not None:
                    mask = mask & ~torch.ones_like(mask).tril(m - n - sliding)
                outs.append(F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=gqa))
        if kept is not None:
            kept.append(layer)
        return torch.cat(outs, 2)

    return attention


def packed_response_logits(
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
    """:func:`~purerl.models.families.decoder.response_logits` with no compute on padding: the rows' valid
    tokens run as one packed stream (``[1, T]``, each row a segment at its own positions), attention
    stays inside a segment (one causal attention per segment; a sliding layer's within its window),
    and the LM head runs only where a valid token predicts a response token. Where the input at a
    predicting position is padding, the logits are 0 (the padded forward gives numbers there that
    every loss masks out); elsewhere they are the padded forward's, to float rounding.

    ``shared``: the distinct prompts run once, packed, and each row's response segment attends to
    its prompt's keys and values first (the prompt reuse of the padded forward, kept). ``routing``:
    a sparse model's replay and record, over ``input_ids`` (:class:`.moe.Routing`). ``checkpointed`` and
    ``head`` as the padded forward's."""
    weights = fused_weights(params, layout, lora_scale, lazy=lazy_layers(params, checkpointed))
    gqa = layout.heads != layout.kv_heads
    window = (lambda i: layout.window if layout.sliding[i] else None) if any(layout.sliding) else None

    def run(ids: Tensor, at: Tensor, mask: Tensor, prefixes: list | None = None, kept: list | None = None,
            routes: Routing | None = None) -> Tensor:
        """The decoder on the valid tokens of ``ids`` (``mask``) packed row after row; hidden ``[T, h]``."""
        lengths = mask.sum(1).tolist()
        flat = mask.reshape(-1)
        ropes = ropes_of(inv_freq, at.reshape(-1)[flat][None], weights.embed.dtype)
        attention = segments_attention(lengths, layout.scale, gqa, prefixes, kept, window)
        stream = ids.reshape(-1)[flat][None]
        packed = None if routes is None else Routing(*(None if x is None else x.flatten(0, 1)[flat][None]
                                                       for x in routes))  # a mask's indexing copies
        hidden = decoder_stack(weights, ropes, layout, stream, attention, routing=packed, checkpointed=checkpointed)[0]
        if routes is not None and routes.record is not None:  # packed_logits' own contiguous copy: a view
            routes.record.flatten(0, 1)[flat] = packed.record[0]
        return hidden

    if head:
        return packed_logits(run, lambda hidden: logits_of(weights, layout, hidden), input_ids, valid, positions,
                             response_length, shared, routing)
    hidden = packed_logits(run, lambda hidden: final_norm(weights, layout, hidden), input_ids, valid, positions,
                           response_length, shared, routing)
    return hidden, lm_head(weights, layout)


def packed_logits(run: Callable[..., Tensor], head: Callable[[Tensor], Tensor], input_ids: Int[Tensor, "b s"],
                  valid: Bool[Tensor, "b s"], positions: Int[Tensor, "b s"], response_length: int,
                  shared: tuple[Int[Tensor, " g"], Int[Tensor, " b"]] | None = None,
                  routing: Routing | None = None) -> Float[Tensor, "b t v"]:
    """The packing around the decoder: ``run(ids, at, mask, prefixes=None, kept=None)`` runs
    it on ``mask``'s valid tokens as one stream (hidden ``[T, h]``; ``prefixes``/``kept`` as
    :func:`segments_attention`), ``head`` turns hidden states into logits. Returns the logits
    predicting the last ``response_length`` tokens (0 where the predicting input is padding), shared
    prompts run once (``shared``, as :func:`packed_response_logits`). ``routing`` (a sparse model's,
    over ``input_ids``) goes to ``run`` as ``routes``, cut as the ids are."""
    b, s = input_ids.shape
    t = response_length
    p = s - t

    def slots(mask: Tensor) -> Tensor:
        """Each cell's index in the packed stream of ``mask``'s valid cells (meaningless where invalid)."""
        return (mask.reshape(-1).cumsum(0) - 1).view(mask.shape)

    cells = valid[:, p - 1:s - 1]  # the positions predicting a response token, where the input is a token

    def routes(rows: Any, cols: slice) -> dict[str, Routing]:
        if routing is None:
            return {}
        replay, record = (None if x is None else x[rows, cols] for x in routing)
        return {"routes": Routing(replay, None if record is None else record.clone())}

    if shared is None:
        where = routes(slice(None), slice(None))
        picked = run(input_ids, positions, valid, **where)[slots(valid)[:, p - 1:s - 1][cells]]
    else:
        first, inverse = shared
        prompt_mask, kept = valid[first, :p], []
        where = routes(first, slice(0, p)), routes(slice(None), slice(p, s))
        prompt_hidden = run(input_ids[first, :p], positions[first, :p], prompt_mask, kept=kept, **where[0])
        prefixes = [[layer[g] for g in inverse.tolist()] for layer in kept]
        response_mask = valid[:, p:]
        response_hidden = run(input_ids[:, p:], positions[:, p:], response_mask, prefixes, **where[1])
        last = prompt_hidden[slots(prompt_mask)[:, -1]].index_select(0, inverse)  # each row's prompt's last token
        grid = last.new_zeros((b, t, last.shape[-1]))  # hidden states in the cells' layout
        grid[:, 0] = last
        grid[:, 1:][cells[:, 1:]] = response_hidden[slots(response_mask)[:, :t - 1][cells[:, 1:]]]
        picked = grid[cells]
    if routing is not None and routing.record is not None:  # each row's prompt record is its prompt's
        if shared is None:
            routing.record.copy_(where["routes"].record)
        else:
            routing.record[:, :p] = where[0]["routes"].record.index_select(0, shared[1])
            routing.record[:, p:] = where[1]["routes"].record
    logits = head(picked)
    rows, cols = cells.nonzero(as_tuple=True)
    return logits.new_zeros((b, t, logits.shape[-1])).index_put((rows, cols), logits)
