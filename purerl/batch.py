"""Token sequences as the trainer sees them, and the rollouts engines return.

Row ``i`` of a :class:`Sequences` is ``P`` prompt positions (padding first) followed by ``T``
response positions (padding last), ``s = P + T``. The response tokens are the last ``T`` columns;
``response_mask`` says which of them count in losses (it may also hide observation tokens in
multi-turn rollouts, which still attend). A :class:`Rollout` is what every rollout engine
(:mod:`purerl.rollout.engine`) returns: sequences, the log-probs they were sampled with, why each
row ended, which prompt it answers and the weights version that produced it.
"""

from collections.abc import Sequence

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from purerl.checks import check_bool, check_rank
from purerl.tree import pytree

__all__ = ["FINISH_EOS", "FINISH_INTERRUPTED", "FINISH_LENGTH", "FINISH_STOP", "Rewards", "Rollout", "Sequences",
           "left_pad", "rollout_of"]

FINISH_EOS, FINISH_LENGTH, FINISH_STOP, FINISH_INTERRUPTED = 0, 1, 2, 3
"""Why a response ended: an EOS token, the length limit, a stop string; or it did not end yet: its
engine was interrupted for newer weights and the row is to be continued (never in a trained batch)."""


@pytree
class Sequences:
    """Prompt + response token ids with their masks.

    Invariants: ``input_ids`` and ``attention_mask`` are ``[b, s]``; ``response_mask`` is
    ``[b, t]`` with ``t ≤ s``; response positions where ``response_mask`` is True attend.

    ``routing`` (a mixture-of-experts model's rollouts): the experts the engine sent each position to,
    per decoder layer and slot, ``[b, s, layers, k]`` (int16, ``-1`` where it recorded none: a dense
    layer, padding, the last response token); the trainer's forwards replay it under
    ``actor.routing_replay`` (:class:`purerl.models.families.moe.Routing`).
    """

    input_ids: Int[Tensor, "b s"]
    attention_mask: Bool[Tensor, "b s"]
    response_mask: Bool[Tensor, "b t"]
    routing: Int[Tensor, "b s l k"] | None = None

    def __attrs_post_init__(self) -> None:
        check_rank("Sequences", 2, input_ids=self.input_ids, attention_mask=self.attention_mask,
                   response_mask=self.response_mask)
        check_bool("Sequences", attention_mask=self.attention_mask, response_mask=self.response_mask)
        if self.attention_mask.shape != self.input_ids.shape:
            raise ValueError(
                f"Sequences: attention_mask has shape {tuple(self.attention_mask.shape)} "
                f"but input_ids has shape {tuple(self.input_ids.shape)}"
            )
        b, t = self.response_mask.shape
        if b != self.input_ids.shape[0] or t > self.input_ids.shape[1]:
            raise ValueError(
                f"Sequences: response_mask has shape {(b, t)}, which does not fit input_ids "
                f"{tuple(self.input_ids.shape)}"
            )
        if self.routing is not None and (self.routing.dim() != 4 or self.routing.shape[:2] != self.input_ids.shape):
            raise ValueError(f"Sequences: routing has shape {tuple(self.routing.shape)}, expected "
                             f"{tuple(self.input_ids.shape)} + (layers, k)")

    @property
    def response_length(self) -> int:
        return self.response_mask.shape[1]

    def responses(self) -> Int[Tensor, "b t"]:
        """The response token ids, ``input_ids[:, -t:]``."""
        return self.input_ids[:, -self.response_length :]

    def position_ids(self) -> Int[Tensor, "b s"]:
        """Positions counted over attended tokens only, so left padding does not shift them."""
        return (self.attention_mask.long().cumsum(-1) - 1).clamp_min(0)

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def rows(self, index: Tensor | slice) -> "Sequences":
        """The sub-batch of the given rows (a view for slices)."""
        return Sequences(self.input_ids[index], self.attention_mask[index], self.response_mask[index],
                         None if self.routing is None else self.routing[index])


@pytree
class Rollout:
    """Sampled responses. Rows are prompt-major: the ``n`` samples of prompt ``i`` are rows
    ``i*n … i*n+n-1`` and share ``group[row] = i``.

    ``behaviour_logprobs`` are the log-probs of the sampled tokens under the sampling distribution
    (0 at masked positions); ``finish_reasons`` holds FINISH_EOS / FINISH_LENGTH / FINISH_STOP;
    ``version`` is the weights version that sampled them. ``temperature`` is the temperature of the
    sampling distribution (1 for greedy decoding, whose log-probs are the untempered model's): the
    trainer scores the responses at it, so a step cannot score them at another
    (:attr:`~purerl.rollout.sampling.SamplingParams.logprob_temperature`).
    """

    sequences: Sequences
    behaviour_logprobs: Float[Tensor, "b t"]
    finish_reasons: Int[Tensor, " b"]
    group: Int[Tensor, " b"]
    version: int
    temperature: float

    def rows(self, index: Tensor) -> "Rollout":
        """The rollout of the given rows (group ids unchanged)."""
        return Rollout(self.sequences.rows(index), self.behaviour_logprobs[index], self.finish_reasons[index],
                       self.group[index], self.version, self.temperature)


@pytree
class Rewards:
    """What scoring a rollout gives the step: ``scores`` (one per row), and what some estimators
    also read: ``baselines`` (ReMax: the score of the prompt's greedy response, per row) and
    ``components`` (GDPO: each reward's score, one column per reward, e.g. rule and model).
    ``token_rewards`` (multi-turn episodes with per-turn rewards, ``env.per_turn_rewards``) places
    them on response tokens, each row summing to its score; without it the score sits on the
    row's last response token. A step function accepts a bare ``scores`` tensor too (:meth:`of`)."""

    scores: Float[Tensor, " b"]
    baselines: Float[Tensor, " b"] | None = None
    components: Float[Tensor, "b k"] | None = None
    token_rewards: Float[Tensor, "b t"] | None = None

    @staticmethod
    def of(scores: "Tensor | Rewards") -> "Rewards":
        return scores if isinstance(scores, Rewards) else Rewards(scores)

    def rows(self, index: Tensor) -> "Rewards":
        return Rewards(*(None if x is None else x[index] for x in (self.scores, self.baselines, self.components,
                                                                   self.token_rewards)))


def left_pad(prompts: Sequence[Sequence[int]], pad_token_id: int) -> tuple[Tensor, Tensor]:
    """``[b, P]`` ids and bool attention mask with every prompt right-aligned."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("left_pad: every prompt needs at least one token")
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.bool)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.as_tensor(list(p), dtype=torch.long)
        mask[i, width - len(p):] = True
    return ids, mask


def rollout_of(prompt_ids: Int[Tensor, "g p"], prompt_mask: Bool[Tensor, "g p"], responses: Int[Tensor, "b t"],
               logprobs: Float[Tensor, "b t"], alive: Bool[Tensor, "b t"], finish_reasons: Int[Tensor, " b"],
               n: int, version: int, temperature: float,
               routing: tuple[Tensor, Tensor] | None = None) -> Rollout:
    """The :class:`Rollout` of ``n`` responses per left-padded prompt (``b = g·n``, prompt-major):
    each prompt row repeated ``n`` times ahead of its responses, ``alive`` the response mask,
    ``logprobs`` at ``temperature``; ``routing``: the prompts' ``[g, p, l, k]`` and the responses'
    ``[b, t, l, k]`` experts (:attr:`Sequences.routing`)."""
    routes = None if routing is None else torch.cat([routing[0].repeat_interleave(n, 0), routing[1]], 1)
    sequences = Sequences(torch.cat([prompt_ids.repeat_interleave(n, 0), responses], 1),
                          torch.cat([prompt_mask.repeat_interleave(n, 0), alive], 1), alive, routes)
    group = torch.arange(len(prompt_ids), device=responses.device).repeat_interleave(n)
    return Rollout(sequences, logprobs, finish_reasons, group, version, temperature)
