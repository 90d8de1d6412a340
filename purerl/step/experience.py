"""Experience: everything the updates need from a scored rollout, computed before any update and
without gradients: the old (proximal) log-probs, the reference log-probs, the critic's values, a
distillation teacher's scores and, for the optimal-token-baseline estimators, ``Σ_v π_old(v)²``.

Devices: the stages run where the rollout's tensors are (CPU or one GPU).
"""

import functools
from collections.abc import Callable
from typing import Protocol, runtime_checkable

import torch
from jaxtyping import Float, Int
from torch import Tensor

from purerl.batch import Rewards, Rollout, Sequences
from purerl.models import CausalLM, Critic, Params, response_values
from purerl.models.families.moe import disagreement
from purerl.models.scores import response_logprobs, response_scores
from purerl.state import TrainState
from purerl.step.micro_batches import chunks, token_budget_rows, trimmed_sequences
from purerl.step.settings import Batching, ExperienceSettings
from purerl.tree import pytree, static_field

__all__ = ["CriticValues", "Experience", "ReferenceLogprobs", "TeacherScores", "TeacherScoring", "critic_values",
           "make_experience", "reference_logprobs", "teacher_scores"]


@pytree
class TeacherScores:
    """A frozen teacher's view of the responses: ``logprobs`` of the sampled tokens and, when asked
    for, its ``k`` likeliest tokens per position (``top_ids``, ``top_logprobs``; None otherwise),
    all at the sampling temperature. Padding positions hold 0."""

    logprobs: Float[Tensor, "b t"]
    top_ids: Int[Tensor, "b t k"] | None = None
    top_logprobs: Float[Tensor, "b t k"] | None = None


@pytree
class Experience:
    """A scored rollout with everything the updates need, computed before any update.
    ``baselines``/``components``: see :class:`~purerl.batch.Rewards`; ``sum_pi_squared``:
    ``Σ_v π_old(v)²`` per response position, for the optimal-token-baseline estimators;
    ``token_rewards``: the scores placed on tokens (per-turn rewards), when the rewards give them;
    ``teacher``: a distillation teacher's scores (:class:`TeacherScores`), with a teacher.
    ``temperature``: the rollout's sampling temperature, which every log-prob here is at;
    ``on_policy``: the weights the update starts from sampled the rollout (its version is the
    state's step), so the engine's ``behaviour_logprobs`` can check the weight sync.
    ``routing_disagreement`` (a rollout with the engine's experts, :attr:`Sequences.routing`, of a lean
    policy): per response position, in how many sparse layers the trainer's router chose other experts
    than the engine's, and in how many both chose (``[b, t, 2]``)."""

    sequences: Sequences
    group: Int[Tensor, " b"]
    scores: Float[Tensor, " b"]
    old_logprobs: Float[Tensor, "b t"]
    behaviour_logprobs: Float[Tensor, "b t"]
    ref_logprobs: Float[Tensor, "b t"] | None
    values: Float[Tensor, "b t"] | None
    baselines: Float[Tensor, " b"] | None = None
    components: Float[Tensor, "b k"] | None = None
    sum_pi_squared: Float[Tensor, "b t"] | None = None
    token_rewards: Float[Tensor, "b t"] | None = None
    teacher: TeacherScores | None = None
    routing_disagreement: Float[Tensor, "b t 2"] | None = None
    temperature: float = static_field(kw_only=True)
    on_policy: bool = static_field(kw_only=True)


@torch.no_grad()
def _batched(model: CausalLM | Critic, fn: Callable[[Sequences], Tensor], seqs: Sequences, rows: int,
             max_tokens: int | None = None) -> Tensor:
    """``fn`` (row-wise, ``[b, t, …]`` out) over ``seqs`` without gradients: in chunks of ``rows``,
    or in micro-batches of at most ``max_tokens`` positions with their padding trimmed (the
    trimmed response columns, which no row uses, come back 0)."""
    if max_tokens is None:
        return torch.cat([model.map_rows(fn, seqs.rows(sl)) for sl in chunks(len(seqs), rows)])
    out = None
    for index in token_budget_rows(seqs, max_tokens):
        part, kept = trimmed_sequences(seqs.rows(index))
        values = model.map_rows(fn, part)
        if out is None:
            out = values.new_zeros((len(seqs), seqs.response_length, *values.shape[2:]))
        out[index, :kept] = values
    return out


def _logprobs_fn(model: CausalLM, params: Params, temperature: float) -> Callable[[Sequences], Tensor]:
    def logprobs(part: Sequences) -> Tensor:
        return response_logprobs(model, params, part, temperature=temperature)

    return logprobs


def _logprobs_and_sum_pi_squared_fn(model: CausalLM, params: Params,
                                    temperature: float) -> Callable[[Sequences], Tensor]:
    """Log-probs and ``Σ_v π(v)²`` per response position, stacked on the last axis, from one forward."""
    def both(part: Sequences) -> Tensor:
        scores = response_scores(model, params, part, temperature=temperature, sum_pi_squared=True)
        return torch.stack([scores.logprobs[..., 0], scores.sum_pi_squared], -1)

    return both


def critic_values(critic: Critic, params: Params | None, seqs: Sequences, *,
                  batching: Batching) -> Float[Tensor, "b t"]:
    """The critic's values at each response position (0 on padding), without gradients, in
    ``batching``'s micro-batches (its token budget, else its rows)."""
    if params is None:
        raise ValueError("make_experience: a critic without TrainState.critic params")
    values = _batched(critic, functools.partial(response_values, critic, params), seqs, batching.micro_batch_rows,
                      batching.max_tokens)
    return torch.where(seqs.response_mask, values, 0.0)


def reference_logprobs(policy: CausalLM, params: Params, seqs: Sequences, *, temperature: float,
                       batching: Batching) -> Float[Tensor, "b t"]:
    """Log-probs of the responses under the reference params at ``temperature``, without
    gradients, in ``batching``'s micro-batches."""
    return _batched(policy, _logprobs_fn(policy, params, temperature), seqs, batching.micro_batch_rows,
                    batching.max_tokens)


def _teacher_fn(model: CausalLM, params: Params, temperature: float, top_k: int | None, vocab: int | None = None
                ) -> Callable[[Sequences], Tensor]:
    """The sampled tokens' log-probs and, with ``top_k``, the ``k`` likeliest tokens' log-probs and
    ids, stacked on the last axis as float32 ``[b, t, 1 + 2k]`` (ids below 2²⁴ are exact there);
    over the first ``vocab`` ids only, when given."""
    def scores(part: Sequences) -> Tensor:
        out = response_scores(model, params, part, temperature=temperature, top_k=top_k, vocab=vocab)
        if top_k is None:
            return out.logprobs
        return torch.cat([out.logprobs, out.top_logprobs, out.top_ids.to(torch.float32)], -1)

    return scores


def teacher_scores(teacher: CausalLM, params: Params, seqs: Sequences, *, temperature: float, batching: Batching,
                   top_k: int | None = None, vocab: int | None = None) -> TeacherScores:
    """The teacher's :class:`TeacherScores` of ``seqs``' responses at ``temperature``, without
    gradients, in ``batching``'s micro-batches; ``top_k`` as in :class:`ExperienceSettings`. The
    teacher must read the policy's token ids (its vocabulary is checked once, when it is loaded:
    :func:`~purerl.assembly.models.load_teacher`); ``vocab``: its distributions over the first
    ``vocab`` ids (the policy's, when the teacher's embedding has more padding rows)."""
    packed = _batched(teacher, _teacher_fn(teacher, params, temperature, top_k, vocab), seqs,
                      batching.micro_batch_rows, batching.max_tokens)
    if top_k is None:
        return TeacherScores(packed[..., 0])
    k = (packed.shape[-1] - 1) // 2
    return TeacherScores(packed[..., 0], packed[..., 1 + k:].to(torch.int64), packed[..., 1:1 + k])


@runtime_checkable
class CriticValues(Protocol):
    """What :func:`make_experience` asks of a critic role (:mod:`purerl.step.roles`)."""

    def values(self, params: Params | None, seqs: Sequences, *, batching: Batching) -> Tensor: ...


@runtime_checkable
class ReferenceLogprobs(Protocol):
    """What :func:`make_experience` asks of a reference role (:mod:`purerl.step.roles`)."""

    def logprobs(self, params: Params | None, seqs: Sequences, *, temperature: float,
                 batching: Batching) -> Tensor: ...


@runtime_checkable
class TeacherScoring(Protocol):
    """What :func:`make_experience` asks of a distillation teacher (:mod:`purerl.step.roles`): its
    params are its own (frozen, outside the train state)."""

    def scores(self, seqs: Sequences, *, temperature: float, batching: Batching,
               top_k: int | None) -> TeacherScores: ...


def _routing_fn(model: CausalLM, params: Params, temperature: float) -> Callable[[Sequences], Tensor]:
    """From one forward (routing as the update routes it): the log-probs, then per response
    position the sparse layers where the trainer's router disagrees with the engine's recorded
    experts and those where both recorded a choice, stacked on the last axis (``[rows, t, 3]``).
    Response tokens only: a ragged row's positions after its end are padding, which an engine may
    route while the batch decodes on, and which no loss reads."""

    def routed(part: Sequences) -> Tensor:
        record = torch.full_like(part.routing, -1)
        logprobs = response_scores(model, params, part, temperature=temperature, record=record).logprobs[..., 0]
        t = part.response_length
        differ, both = disagreement(part.routing[:, -t:], record[:, -t:])
        real = part.response_mask[..., None]
        differ, both = differ & real, both & real
        return torch.stack([logprobs, differ.sum(-1).to(torch.float32), both.sum(-1).to(torch.float32)], -1)

    return routed


def make_experience(state: TrainState, rollout: Rollout, rewards: Float[Tensor, " b"] | Rewards, *,
                    policy: CausalLM, settings: ExperienceSettings = ExperienceSettings(),
                    critic: Critic | CriticValues | None = None,
                    reference: ReferenceLogprobs | None = None,
                    teacher: TeacherScoring | None = None) -> Experience:
    """Old log-probs (the policy before the update; the rollout's behaviour log-probs unless
    ``settings.recompute_old_logprobs``), reference log-probs, values (with a ``critic``) and
    ``Σπ²`` (with ``settings.sum_pi_squared``), all without gradients, at the rollout's sampling
    temperature, in ``settings.batching``'s micro-batches (``settings.critic_batching``'s for values).
    ``rewards``: one score per row, or :class:`~purerl.batch.Rewards` with ReMax baselines / GDPO
    components.

    ``critic``: a :class:`~purerl.models.Critic` (computed here with ``state.critic``) or a critic
    role, whose ``values`` may run wherever the critic lives. ``reference``: a reference role (an
    executor's, for a reference that lives on a pool of its own: its params are not in
    ``state``); without one, the reference log-probs are computed here when ``state.reference``
    holds params. ``teacher``: a distillation teacher role, scoring the responses with
    ``settings.teacher_top_k``."""
    rewards = Rewards.of(rewards)
    seqs, temperature, batching = rollout.sequences, rollout.temperature, settings.batching
    rows, budget = batching.micro_batch_rows, batching.max_tokens
    sum_pi_squared, old, recompute = None, rollout.behaviour_logprobs, settings.recompute_old_logprobs
    if settings.sum_pi_squared:  # Σπ² of π_old: the recomputed policy, whatever the flag
        both = _batched(policy, _logprobs_and_sum_pi_squared_fn(policy, state.policy, temperature), seqs, rows,
                        budget)
        sum_pi_squared = both[..., 1]
        if recompute:
            old, recompute = both[..., 0], False
    routing = None
    if seqs.routing is not None and policy.lean:  # the trainer's routers against the engine's record
        routed = _batched(policy, _routing_fn(policy, state.policy, temperature), seqs, rows, budget)
        routing = routed[..., 1:]
        if recompute:
            old, recompute = routed[..., 0], False
    if recompute:
        old = _batched(policy, _logprobs_fn(policy, state.policy, temperature), seqs, rows, budget)
    ref = None
    if reference is not None:
        ref = reference.logprobs(state.reference, seqs, temperature=temperature, batching=batching)
    elif state.reference is not None:
        ref = reference_logprobs(policy, state.reference, seqs, temperature=temperature, batching=batching)
    values, critic_batching = None, settings.critic_batching or batching
    if isinstance(critic, Critic):
        values = critic_values(critic, state.critic, seqs, batching=critic_batching)
    elif critic is not None:
        values = critic.values(state.critic, seqs, batching=critic_batching)
    scored = None
    if teacher is not None:
        scored = teacher.scores(seqs, temperature=temperature, batching=batching, top_k=settings.teacher_top_k)
    return Experience(seqs, rollout.group, rewards.scores.to(torch.float32), old, rollout.behaviour_logprobs, ref,
                      values, rewards.baselines, rewards.components, sum_pi_squared,
                      None if rewards.token_rewards is None else rewards.token_rewards.to(torch.float32), scored,
                      routing, temperature=temperature, on_policy=rollout.version == state.step)
