"""The sparse MLP of Qwen3-MoE, as a plain function of its weights: a top-k softmax router and
experts computed as one matrix product per expert over the tokens routed to it (no loop over
tokens), for :func:`purerl.models.families.llama.decoder_stack`.

It computes what ``Qwen3MoeSparseMoeBlock`` computes, op for op: the router's logits, a float32
softmax, the top ``k`` experts (``torch.topk``, so ties break as the module's do), their
probabilities renormalised where ``norm_topk_prob`` is set, then each expert's SwiGLU on its tokens,
weighted, and added into the output in expert order (as the module's ``index_add_``).

Routing is a function (:data:`Route`): which ``k`` experts each token goes to, given the router's
probabilities. The default is the router's own choice (:func:`top_k`); routing replay hands the
forward a route that returns the experts the engine recorded instead (:func:`replayed`), and the
gate weights still come from this forward's router, renormalised over those experts.

Shapes: ``N`` tokens, ``E`` experts, ``k`` experts per token, ``I`` an expert's hidden size.
"""

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor

__all__ = ["Experts", "Route", "experts_of", "recording", "replayed", "sparse_mlp", "top_k"]

Route = Callable[[int, Tensor, int], Tensor]
"""``route(layer, probs [N, E] float32, k) -> experts [N, k]`` (int64): where layer ``layer``'s tokens go."""


class Experts(NamedTuple):
    """One sparse MLP's weights, transposed like the dense projections (``[in, out]``): the router
    ``[hidden, E]``, each expert's gate and up side by side ``[E, hidden, 2I]``, its down ``[E, I, hidden]``."""

    router: Tensor
    gate_up: Tensor
    down: Tensor


def experts_of(params: dict[str, Tensor], mlp: str) -> Experts | None:
    """The sparse MLP at ``mlp`` (``model.layers.{i}.mlp``) in the params tree; None for a dense one."""
    router = params.get(f"{mlp}.gate.weight")
    if router is None:
        return None
    return Experts(router.t(), params[f"{mlp}.experts.gate_up_proj"].transpose(1, 2),
                   params[f"{mlp}.experts.down_proj"].transpose(1, 2))


def top_k(layer: int, probs: Float[Tensor, "N E"], k: int) -> Int[Tensor, "N k"]:
    """The router's own choice: each token's ``k`` most probable experts."""
    return torch.topk(probs, k, dim=-1).indices


def replayed(experts: dict[int, Int[Tensor, "N k"]]) -> Route:
    """A route that sends each token to the experts recorded for it (``experts[layer]``, the rows of
    this forward's tokens); a row of ``-1`` (a token with no record) keeps the router's own choice."""

    def route(layer: int, probs: Tensor, k: int) -> Tensor:
        own = top_k(layer, probs, k)
        recorded = experts.get(layer)
        if recorded is None:
            return own
        recorded = recorded.to(own.device)
        return torch.where(recorded >= 0, recorded, own)

    return route


def recording(into: dict[int, list[Tensor]], route: Route = top_k) -> Route:
    """``route``, appending each layer's choice ``[N, k]`` to ``into[layer]`` (one entry per call)."""

    def record(layer: int, probs: Tensor, k: int) -> Tensor:
        chosen = route(layer, probs, k)
        into.setdefault(layer, []).append(chosen)
        return chosen

    return record


def sparse_mlp(x: Float[Tensor, "N hidden"], w: Experts, layer: int, k: int, normalise: bool,
               route: Route = top_k) -> Float[Tensor, "N hidden"]:
    """The sparse MLP's output for ``x`` (already normalised), with layer ``layer``'s tokens sent
    where ``route`` says; ``normalise``: the config's ``norm_topk_prob``."""
    logits = torch.mm(x, w.router)
    probs = F.softmax(logits, dim=-1, dtype=torch.float)
    chosen = route(layer, probs, k)
    gates = probs.gather(1, chosen)
    if normalise:
        gates = gates / gates.sum(dim=-1, keepdim=True)
    gates = gates.to(logits.dtype)
    flat = chosen.reshape(-1)
    order = flat.argsort(stable=True)  # by expert, then by token: the module's index_add_ order
    rows = order // k
    counts = torch.bincount(flat, minlength=w.gate_up.shape[0]).tolist()
    outs = []
    for e, part in enumerate(x.index_select(0, rows).split(counts)):
        if counts[e]:
            gate, up = torch.mm(part, w.gate_up[e]).chunk(2, dim=-1)
            outs.append(torch.mm(F.silu(gate) * up, w.down[e]))
    weighted = torch.cat(outs) * gates.reshape(-1)[order, None]
    return torch.zeros_like(x).index_add(0, rows, weighted.to(x.dtype))
