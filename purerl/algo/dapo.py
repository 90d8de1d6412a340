"""DAPO's reward shaping and group filter (Yu et al. 2025; verl's ``overlong_buffer`` and
``filter_groups``).

- :func:`overlong_penalty`: responses that run into the last ``buffer`` tokens of the length
  budget lose reward linearly, up to ``factor`` at the budget itself.
- :func:`varied_groups`: which groups' scores are not all equal. A group whose samples all score
  alike has GRPO advantages of exactly 0 and teaches nothing; dynamic sampling drops it and
  samples more prompts instead.
"""

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

__all__ = ["overlong_penalty", "varied_groups"]


def overlong_penalty(lengths: Int[Tensor, " b"], max_new_tokens: int, buffer: int,
                     factor: float = 1.0) -> Float[Tensor, " b"]:
    """``min(0, −(L − (max_new_tokens − buffer)) / buffer · factor)`` per response of length ``L``
    (verl's DAPO reward manager): 0 up to ``max_new_tokens − buffer`` tokens, ``−factor`` at
    ``max_new_tokens``. ``buffer`` must be in ``[1, max_new_tokens]``."""
    if not 1 <= buffer <= max_new_tokens:
        raise ValueError(f"overlong_penalty: buffer must be in [1, max_new_tokens={max_new_tokens}], got {buffer}")
    excess = lengths.to(torch.float32) - (max_new_tokens - buffer)
    return torch.clamp(-excess / buffer * factor, max=0.0)


def varied_groups(scores: Float[Tensor, " b"], group: Int[Tensor, " b"]) -> Bool[Tensor, " b"]:
    """True for the rows of groups whose scores are not all equal (exact comparison; NaN scores
    count as different from everything, so a group holding one is kept and fails loudly later)."""
    _, inverse = torch.unique(group, return_inverse=True)
    groups = int(inverse.max()) + 1 if len(inverse) else 0
    high = torch.full((groups,), -torch.inf, dtype=scores.dtype, device=scores.device)
    low = torch.full((groups,), torch.inf, dtype=scores.dtype, device=scores.device)
    high = high.scatter_reduce(0, inverse, scores, "amax")
    low = low.scatter_reduce(0, inverse, scores, "amin")
    varied = ~(high == low)
    return varied[inverse]
