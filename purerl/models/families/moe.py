"""The sparse MLP of Qwen3-MoE, as a plain function of its weights: a top-k softmax router and
experts computed as one matrix product per expert over the tokens routed to it (no loop over
tokens), for :func:`purerl.models.families.decoder.decoder_stack`.

It computes what ``Qwen3MoeSparseMoeBlock`` computes, op for op: the router's logits, a float32
softmax, the top ``k`` experts (``torch.topk``, so ties break as the module's do), their
probabilities renormalised where ``norm_topk_prob`` is set, then each expert's SwiGLU on its tokens,
weighted, and added into the output in expert order (as the module's ``index_add_``).

Routing replay: a forward given the experts another forward chose (the engine's, recorded as
:class:`Routing`) sends each token there instead of where its own router would, and takes the gate
weights from its own router, renormalised over those experts where ``norm_topk_prob`` is set.

Shapes: ``N`` tokens, ``E`` experts, ``k`` experts per token, ``I`` an expert's hidden size.
"""

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor

__all__ = ["Experts", "Routing", "disagreement", "experts_of", "has_experts", "routing_mismatch", "sparse_mlp"]


def has_experts(config: Any) -> bool:
    """Whether a model's HF ``config`` routes tokens to experts (Qwen3-MoE's ``num_experts``,
    Mixtral's ``num_local_experts``, DeepSeek's ``n_routed_experts``)."""
    keys = ("num_experts", "num_local_experts", "n_routed_experts")
    return any(int(getattr(config, key, 0) or 0) > 0 for key in keys)


class Routing(NamedTuple):
    """Routing replay and recording for a forward over ``ids`` ``[b, s]``, one entry per position and
    decoder layer (a dense layer's entries are unused):

    - ``replay`` ``[b, s, layers, k]``: the experts each token goes to (``-1``: its router's own choice);
    - ``record`` ``[b, s, layers, k]`` (an integer tensor, filled with ``-1`` by the caller): each
      sparse layer writes there the experts its router chose, replayed or not (the positions it
      computes only): without replay, where its tokens went; with it, where they would have gone."""

    replay: Tensor | None = None
    record: Tensor | None = None


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


def disagreement(a: Int[Tensor, "... k"], b: Int[Tensor, "... k"]) -> tuple[Tensor, Tensor]:
    """Two recordings compared entry by entry (``[...]`` bool each): where their sets of experts
    differ, and where both recorded one (``≥ 0``); ``differ`` implies ``both``."""
    both = (a >= 0).all(-1) & (b >= 0).all(-1)
    return (a.sort(-1).values != b.sort(-1).values).any(-1) & both, both


def routing_mismatch(a: Int[Tensor, "... k"], b: Int[Tensor, "... k"]) -> Tensor:
    """The share of the tokens (over the entries both recorded, ``≥ 0``) whose sets of experts differ
    between two recordings: a float scalar, 0 where none was recorded by both."""
    differ, both = disagreement(a, b)
    return differ.sum() / both.sum().clamp_min(1)


def sparse_mlp(x: Float[Tensor, "N hidden"], w: Experts, k: int, normalise: bool,
               forced: Int[Tensor, "N k"] | None = None) -> tuple[Float[Tensor, "N hidden"], Int[Tensor, "N k"]]:
    """The sparse MLP's output for ``x`` (already normalised), each token sent to its router's top
    ``k`` experts, or to ``forced``'s where a row of it is ``≥ 0`` (routing replay); and the router's
    own top ``k``. ``normalise``: the config's ``norm_topk_prob``."""
    logits = torch.mm(x, w.router)
    probs = F.softmax(logits, dim=-1, dtype=torch.float)
    own = chosen = torch.topk(probs, k, dim=-1).indices
    if forced is not None:
        chosen = torch.where(forced >= 0, forced.to(chosen), chosen)
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
    return torch.zeros_like(x).index_add(0, rows, weighted.to(x.dtype)), own
