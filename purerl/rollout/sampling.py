"""The sampling distribution: temperature, top-k and top-p applied to next-token logits.

Pure functions over ``[b, v]`` logits. :func:`sampling_logprobs` returns the log-probabilities of
the distribution tokens are actually drawn from (truncated and renormalised), so the behaviour
log-probs a rollout reports are exact; with ``top_k = 0`` and ``top_p = 1`` they equal the
trainer's ``log_softmax(logits / temperature)``.
"""

from collections.abc import Callable

import attrs
import torch
from jaxtyping import Float, Int
from torch import Tensor

from purerl.checks import at_least, in_range

__all__ = ["SamplingParams", "sampling_logprobs", "sample_tokens", "stop_length"]


@attrs.frozen
class SamplingParams:
    """How responses are sampled (the defaults are the main job's). ``temperature == 0`` means
    greedy decoding.

    ``n`` samples are drawn per prompt; generation stops at an EOS token, at any of the ``stop``
    strings (the token completing it is kept), or after ``max_new_tokens``. ``top_k = 0`` keeps
    every token, ``top_p = 1`` the whole mass.
    """

    max_new_tokens: int = attrs.field(default=48, validator=at_least(1))
    temperature: float = attrs.field(default=0.7, validator=at_least(0))
    top_p: float = attrs.field(default=1.0, validator=in_range(0, 1, open_low=True))
    top_k: int = attrs.field(default=0, validator=at_least(0))
    n: int = attrs.field(default=4, validator=at_least(1))
    stop: tuple[str, ...] = ()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def sampling_logprobs(
    logits: Float[Tensor, "b v"], *, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0
) -> Float[Tensor, "b v"]:
    """``log p`` of the sampling distribution, float32; ``-inf`` on truncated tokens.

    ``p ∝ softmax(logits / T)`` restricted to the ``top_k`` most likely tokens (0 = all) and then
    to the smallest set whose mass reaches ``top_p`` (the most likely token always stays).
    Greedy (``T = 0``) uses ``T = 1`` here: the reported log-prob of a greedy token is its
    log-prob under the untempered model.
    """
    scaled = logits.float()
    if temperature > 0 and temperature != 1.0:
        scaled = scaled / temperature
    if top_k > 0 and top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, -1)
        mass_before = probs.cumsum(-1) - probs  # mass of strictly more likely tokens
        drop_sorted = mass_before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    return torch.log_softmax(scaled, -1)


def sample_tokens(logprobs: Float[Tensor, "b v"], uniform: Float[Tensor, " b"] | None) -> Int[Tensor, " b"]:
    """One token per row from ``exp(logprobs)``, by inverse CDF with the row's ``uniform`` draw in
    ``[0, 1)``; the argmax when ``uniform`` is None (greedy).

    The caller draws the uniforms, one per row, so a row's token does not depend on which other
    rows are in the batch. Tokens of probability 0 (truncated by top-k/top-p) are never drawn.
    Compared with ``torch.multinomial`` this draws ``b`` random numbers, and costs 6x less on CPU
    at a 49k vocabulary (4.4 ms vs 28 ms for 32 rows, measured); the float32 running sum moves
    each token's probability by at most about one rounding of the sum (~6e-8).
    """
    if uniform is None:
        return logprobs.argmax(-1)
    cdf = logprobs.exp().cumsum(-1)
    u = uniform.to(cdf.dtype)[:, None] * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp_max(cdf.shape[-1] - 1)


def stop_length(ids: list[int], stop: tuple[str, ...], decode: Callable[[list[int]], str]) -> int | None:
    """How many of ``ids`` a response keeps when generation stops at the ``stop`` strings: up to
    and including the token that completes the first of them; None when none occurs. For engines
    that sample past a stop string (vLLM without a tokenizer): the tokens after it are dropped,
    never trained on, so the kept ids are exactly what was sampled."""
    if not stop or not any(s in decode(ids) for s in stop):
        return None
    for k in range(1, len(ids) + 1):
        if any(s in decode(ids[:k]) for s in stop):
            return k
    return None
