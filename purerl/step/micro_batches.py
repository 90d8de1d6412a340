"""How a batch splits into the micro-batches each forward (and backward) runs on: a fixed number
of rows, or a token budget.

With a token budget (``actor.max_tokens_per_micro_batch``) the rows are ordered by length and
cut greedily so that every micro-batch, once its own padding is trimmed (:func:`trimmed`), holds
at most ``budget`` positions (a row longer than the budget runs alone). Short rows then share a
forward instead of each being padded to the batch's longest, and a forward's memory is bounded
by the budget rather than by rows × the longest row. The gradient is the fixed-row one: each
micro-batch's loss is divided by the whole mini-batch's denominator, so the micro-batch gradients
add up to the mini-batch's whatever the split (up to float summation order).

Trimming drops the prompt columns no row of the micro-batch attends to and the response columns
after the last one any row attends to or trains on. Positions are counted over attended tokens
(:meth:`~purerl.batch.Sequences.position_ids`) and attention is causal, so the kept positions'
logits are unchanged (up to float summation order).
"""

import torch
from torch import Tensor

from purerl.batch import Sequences
from purerl.tree import replace, tree_map

__all__ = ["chunks", "micro_batch_rows", "token_budget_rows", "trimmed", "trimmed_sequences"]


def _widths(seqs: Sequences) -> tuple[Tensor, Tensor]:
    """Per row: the attended prompt length and the response span (up to its last attended or
    trained position), ``[b]`` each."""
    t = seqs.response_length
    p = seqs.input_ids.shape[1] - t
    prompt = seqs.attention_mask[:, :p].sum(-1)
    used = seqs.attention_mask[:, p:] | seqs.response_mask
    cols = torch.arange(1, t + 1, device=used.device)
    response = torch.where(used, cols, 0).amax(-1) if t else torch.zeros_like(prompt)
    return prompt, response


def trimmed_sequences(seqs: Sequences) -> tuple[Sequences, int]:
    """``(seqs', t')``: ``seqs`` without the leading columns no row attends to and the trailing
    response columns no row uses; ``t'`` (≥ 1) response columns are kept."""
    prompt, response = _widths(seqs)
    t = seqs.response_length
    p = seqs.input_ids.shape[1] - t
    keep_t = max(1, int(response.max())) if len(seqs) else t
    start = p - int(prompt.max()) if len(seqs) else 0
    stop = p + keep_t
    routing = None if seqs.routing is None else seqs.routing[:, start:stop]
    return Sequences(seqs.input_ids[:, start:stop], seqs.attention_mask[:, start:stop],
                     seqs.response_mask[:, :keep_t], routing), keep_t


def trimmed(batch):
    """A :class:`~purerl.step.shaping.TrainBatch` with its padding columns trimmed: the sequences
    by :func:`trimmed_sequences`, every per-token field (``[b, t]``, and a teacher's ``[b, t, k]``) to
    the kept response columns."""
    seqs, keep_t = trimmed_sequences(batch.sequences)
    fields = {name: getattr(batch, name)[:, :keep_t] for name in ("old_logprobs", "ref_logprobs", "advantages",
                                                                  "returns", "values", "is_weights",
                                                                  "behaviour_logprobs")
              if getattr(batch, name, None) is not None}
    if getattr(batch, "teacher", None) is not None:  # a teacher's scores: [b, t] and [b, t, k]
        fields["teacher"] = tree_map(lambda x: x[:, :keep_t] if isinstance(x, Tensor) else x, batch.teacher)
    return replace(batch, sequences=seqs, **fields)


def token_budget_rows(seqs: Sequences, budget: int) -> list[Tensor]:
    """Row index sets (on the rows' device) covering every row of ``seqs`` once, longest rows
    first, each set as large as fits ``budget`` positions after trimming: ``rows × (longest
    attended prompt + longest response span)`` of the set."""
    prompt, response = _widths(seqs)
    order = torch.argsort((prompt + response).cpu(), descending=True, stable=True).tolist()
    prompt, response = prompt.tolist(), response.tolist()
    parts, current, widest_prompt, widest_response = [], [], 0, 0
    for row in order:
        p, r = max(widest_prompt, prompt[row]), max(widest_response, response[row])
        if current and (len(current) + 1) * (p + r) > budget:
            parts.append(current)
            current, p, r = [], prompt[row], response[row]
        current.append(row)
        widest_prompt, widest_response = p, r
    if current:
        parts.append(current)
    device = seqs.input_ids.device
    return [torch.tensor(part, device=device) for part in parts]


def chunks(n: int, size: int) -> list[slice]:
    """``range(n)`` in consecutive slices of at most ``size``."""
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


def micro_batch_rows(seqs: Sequences, rows: int, max_tokens: int | None) -> list[Tensor | slice]:
    """The micro-batches of ``seqs``: consecutive slices of ``rows`` rows, or index sets that fit
    ``max_tokens`` positions each (:func:`token_budget_rows`) when it is given."""
    if max_tokens is None:
        return chunks(len(seqs), rows)
    return token_budget_rows(seqs, max_tokens)
