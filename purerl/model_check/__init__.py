"""``python3 -m purerl.model_check PATH``: what computes a model, and whether purerl's lean forward
and decoder compute what its HF module does.

For a local HF folder or a GGUF file (read through :mod:`purerl.models.gguf_cache`), one line per fact:

- ``computed by``: the lean family that computes it, or its HF module and why
  (:func:`purerl.models.families.computed_by`);
- ``logits``: the largest ``|lean − HF|`` over the response logits of :data:`~.comparisons.SEQUENCES` random
  sequences (a fixed seed, left-padded prompts, ragged responses), against the tolerance
  :func:`~.comparisons.logit_tolerance` (relative in float32; in bfloat16, from the HF module's own rounding);
- ``greedy``: whether the embedded engine's greedy tokens (:class:`~purerl.rollout.backends.torch.TorchEngine`)
  are HF ``generate``'s, token for token, for :data:`~.comparisons.PROMPTS` random prompts; a row that parts
  where HF's logits of the two tokens are within the logit tolerance parted at a near tie (rounding
  picks either), not a mismatch;
- ``speed``: the lean forward's speed over the HF module's on the same batch (median of
  :data:`~.comparisons.REPEATS`), and the decoding rates of the greedy runs;
- ``params``: the parameter count and an estimate of the memory that training it takes
  (:func:`~.comparisons.training_bytes`).

A model that no family computes prints the ``computed by`` and ``params`` lines and skips the
lean-vs-HF ones. Exit status: 0 when the lean path computes the module's values (or there is
none), 1 on a mismatch, 2 (one line on stderr) for a path that is not a model it can load.
"""

from purerl.model_check.command import check, main, parser
from purerl.model_check.comparisons import logit_tolerance, training_bytes

__all__ = ["check", "logit_tolerance", "main", "parser", "training_bytes"]
