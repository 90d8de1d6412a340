"""What the stages read off a policy's LM head at each response position: the log-probs of some ids (the
sampled tokens, a teacher's top ids, a Tinker datum's targets), the entropy, ``Σπ²``, and the top ``k`` log-probs.

A lean family's :func:`response_scores` never holds the ``[b, t, v]`` logits: the family's forward stops at the
hidden states after the final norm, and the fused head (:func:`purerl.algo.fused_head.head_outputs`) computes
the logits a block of positions at a time, reduces each block to these scores, and computes it again in the
backward (:attr:`~purerl.models.base.CausalLM.fused_head`). A model no family computes, or one with the fused
head off, reads them off its whole logits (:func:`~purerl.models.base.response_logits`): the same values to float
rounding. :func:`response_logprobs` and :func:`response_entropy` are the two a caller most often wants.
"""

import attrs
import torch
from jaxtyping import Float, Int
from torch import Tensor

from purerl.algo.fused_head import head_outputs
from purerl.algo.logprobs import entropy_from_logits, logprobs_from_logits, sum_pi_squared_from_logits
from purerl.batch import Sequences
from purerl.models.base import CausalLM, Params, response_logits
from purerl.models.rows import shared_prompts

__all__ = ["Scores", "response_entropy", "response_logprobs", "response_scores"]


@attrs.frozen(eq=False)
class Scores:
    """Scores at each response position, float32 (``[b, t, …]``): ``logprobs`` of the ``k`` ids asked for;
    ``entropy``, ``sum_pi_squared`` and the ``top_logprobs``/``top_ids`` where asked (else None). ``logprobs``
    and ``entropy`` carry gradients."""

    logprobs: Float[Tensor, "b t k"]
    entropy: Float[Tensor, "b t"] | None = None
    sum_pi_squared: Float[Tensor, "b t"] | None = None
    top_logprobs: Float[Tensor, "b t top"] | None = None
    top_ids: Int[Tensor, "b t top"] | None = None


def response_scores(model: CausalLM, params: Params, seqs: Sequences, *, temperature: float = 1.0,
                    ids: Int[Tensor, "b t k"] | None = None, entropy: bool = False, sum_pi_squared: bool = False,
                    top_k: int | None = None, vocab: int | None = None,
                    record: Tensor | None = None) -> Scores:
    """The scores of ``seqs``' response positions under ``params`` at ``temperature`` (module note): the
    log-probs of ``ids`` (default: the sampled tokens, ``k = 1``); ``entropy``; ``sum_pi_squared``; ``top_k``
    (0: every column); over the first ``vocab`` ids only, when given. ``record``: a sparse model's routing record
    over ``seqs`` (:class:`~purerl.models.families.moe.Routing`), filled by its forward."""
    ids = seqs.responses()[..., None] if ids is None else ids
    options = dict(entropy=entropy, sum_pi_squared=sum_pi_squared, top_k=top_k, vocab=vocab)
    if model.lean and model.fused_head:
        shared = shared_prompts(seqs) if model.shares_prompts else None
        hidden, head = model.family.response_hidden(model, params, seqs, shared, record)
        b, t, h = hidden.shape
        out = head_outputs(hidden.reshape(b * t, h), head.weight, head.bias, ids.reshape(b * t, -1),
                           temperature=temperature, softcap=head.softcap, **options)
        return Scores(*(None if x is None else x.view(b, t, *x.shape[1:]) for x in attrs.astuple(out, recurse=False)))
    if record is not None:
        logits = model.family.response_logits(model, params, seqs, shared_prompts(seqs) if model.shares_prompts
                                              else None, record)
    else:
        logits = response_logits(model, params, seqs)
    return scores_of_logits(logits, ids, temperature=temperature, compiled=model.compiled, **options)


def scores_of_logits(logits: Float[Tensor, "b t v"], ids: Int[Tensor, "b t k"], *, temperature: float = 1.0,
                     entropy: bool = False, sum_pi_squared: bool = False, top_k: int | None = None,
                     vocab: int | None = None, compiled: bool = False) -> Scores:
    """:func:`response_scores` read off whole ``logits`` (the unfused path)."""
    logits = logits if vocab is None else logits[..., :vocab]
    if ids.shape[-1] == 1:
        logprobs = logprobs_from_logits(logits, ids[..., 0], temperature=temperature, compiled=compiled)[..., None]
    else:
        logprobs = torch.log_softmax(logits.float() / temperature, -1).gather(-1, ids.long())
    top = None
    if top_k is not None:
        full = torch.log_softmax(logits.detach().float() / temperature, -1)
        top = full.topk(full.shape[-1] if top_k == 0 else min(top_k, full.shape[-1]), dim=-1)
    return Scores(logprobs, entropy_from_logits(logits, temperature=temperature) if entropy else None,
                  sum_pi_squared_from_logits(logits.detach(), temperature=temperature).to(torch.float32)
                  if sum_pi_squared else None,
                  None if top is None else top.values, None if top is None else top.indices)


def response_logprobs(
    model: CausalLM, params: Params, seqs: Sequences, *, temperature: float = 1.0
) -> Float[Tensor, "b t"]:
    """``log π(y_t | prefix)`` for every response position, float32 (masked positions included)."""
    return response_scores(model, params, seqs, temperature=temperature).logprobs[..., 0]


def response_entropy(
    model: CausalLM, params: Params, seqs: Sequences, *, temperature: float = 1.0
) -> Float[Tensor, "b t"]:
    """Entropy of the sampling distribution at every response position, float32."""
    return response_scores(model, params, seqs, temperature=temperature, entropy=True).entropy
