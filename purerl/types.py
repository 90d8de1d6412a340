"""Shape-typed aliases used across purerl (jaxtyping over torch tensors).

Dimension letters are the same everywhere: ``b`` sequences (rows), ``t`` response tokens,
``s`` full sequence (prompt + response), ``g`` group size, ``v`` vocabulary.
Annotations are checked at run time under pytest (``--jaxtyping-packages=purerl,...``) and cost
nothing in production; public entry points also run the explicit checks of :mod:`purerl.checks`.
"""

from jaxtyping import Bool, Float, Int, Shaped
from torch import Tensor

__all__ = [
    "Tensor",
    "Scalar",
    "TokenFloat",
    "TokenMask",
    "TokenIds",
    "SeqFloat",
    "SeqMask",
    "GroupIds",
    "Logits",
    "SeqIds",
    "SeqAttention",
]

Scalar = Float[Tensor, ""]
"""A 0-d floating tensor."""
TokenFloat = Float[Tensor, "b t"]
"""One float per response token (rewards, log-probs, values, advantages)."""
TokenMask = Bool[Tensor, "b t"]
"""True where a response token counts (not padding, not an observation token)."""
TokenIds = Int[Tensor, "b t"]
"""Response token ids."""
SeqFloat = Float[Tensor, " b"]
"""One float per sequence (scores, baselines)."""
SeqMask = Bool[Tensor, " b"]
GroupIds = Int[Tensor, " b"]
"""Group index per row: the n samples of one prompt share it (verl's ``uid``)."""
Logits = Float[Tensor, "b t v"]
SeqIds = Int[Tensor, "b s"]
SeqAttention = Shaped[Tensor, "b s"]
