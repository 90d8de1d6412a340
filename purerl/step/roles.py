"""Roles: the stages a step function asks of the critic, the reference and a distillation teacher,
wherever they live.

A step function does not compute the critic's values, the critic's update or the reference
log-probs itself: it asks a *role* for them, passing the params the state holds for that role.
The roles here compute in this process with those params (the local executor, and training ranks
that hold the role themselves). An executor that places a role on a pool of its own passes a
role of the same shape that runs the stage there instead; the state it steps then holds ``None``
for that role's params (they live with the pool), and the role ignores them. So one step
function runs under every placement (``executor.placement``). A teacher is frozen and not part of
the state: its role holds its model and params (:class:`LocalTeacher`), or reaches them on its pool.
"""

from typing import Any, Protocol, runtime_checkable

import attrs
from jaxtyping import Float
from torch import Tensor

from purerl.models import CausalLM, Critic, Params
from purerl.models import value_and_grad as pure_value_and_grad
from purerl.state import RngState
from purerl.step.experience import (
    CriticValues,
    ReferenceLogprobs,
    TeacherScores,
    TeacherScoring,
    critic_values,
    reference_logprobs,
    teacher_scores,
)
from purerl.step.settings import Batching, ValueLoss
from purerl.step.shaping import Metrics, TrainBatch
from purerl.step.update import ValueAndGrad, critic_update

__all__ = ["CriticRole", "LocalCritic", "LocalReference", "LocalTeacher", "ReferenceRole", "TeacherRole", "critic_role"]


@runtime_checkable
class CriticRole(CriticValues, Protocol):
    """The critic's two stages: values of a batch before any update (:class:`CriticValues`), and
    one update (donating ``params``/``opt_state``) on the shaped batch; returns the new params and
    optimizer state (``None`` for a critic that lives elsewhere) and the update's metrics."""

    def update(self, params: Params | None, opt_state: Any, batch: TrainBatch, *, optimizer: Any, loss: ValueLoss,
               batching: Batching, rng: RngState) -> tuple[Params | None, Any, Metrics]: ...


ReferenceRole = ReferenceLogprobs
"""The reference's one stage: log-probs of the responses (no gradients)."""

TeacherRole = TeacherScoring
"""A distillation teacher's one stage: its :class:`~purerl.step.experience.TeacherScores` of the
responses (no gradients)."""


@attrs.frozen
class LocalCritic:
    """The critic computed here, with the params the state holds; gradients by ``value_and_grad``
    (the pure one, or a sharded ``.backward()`` on FSDP ranks)."""

    model: Critic
    value_and_grad: ValueAndGrad = pure_value_and_grad

    def values(self, params: Params | None, seqs: Any, *, batching: Batching) -> Float[Tensor, "b t"]:
        return critic_values(self.model, params, seqs, batching=batching)

    def update(self, params: Params | None, opt_state: Any, batch: TrainBatch, *, optimizer: Any, loss: ValueLoss,
               batching: Batching, rng: RngState) -> tuple[Params, Any, Metrics]:
        if params is None:
            raise ValueError("critic update: a critic without TrainState.critic params")
        return critic_update(params, opt_state, batch, critic=self.model, loss=loss, batching=batching,
                             optimizer=optimizer, rng=rng, value_and_grad=self.value_and_grad)


@attrs.frozen
class LocalReference:
    """The reference computed here: the policy's model with the reference params."""

    model: CausalLM

    def logprobs(self, params: Params | None, seqs: Any, *, temperature: float,
                 batching: Batching) -> Float[Tensor, "b t"]:
        if params is None:
            raise ValueError("reference log-probs: a reference role without TrainState.reference params")
        return reference_logprobs(self.model, params, seqs, temperature=temperature, batching=batching)


@attrs.frozen
class LocalTeacher:
    """A teacher computed here: its own model and frozen params (any causal LM that reads the
    policy's token ids). ``vocab``: score over the first ``vocab`` ids (the policy's vocabulary,
    when the teacher's embedding has more padding rows, as Qwen2.5-7B's 152,064 against
    Qwen2.5-0.5B's 151,936; None: all)."""

    model: CausalLM
    params: Params
    vocab: int | None = None

    def scores(self, seqs: Any, *, temperature: float, batching: Batching, top_k: int | None) -> TeacherScores:
        return teacher_scores(self.model, self.params, seqs, temperature=temperature, batching=batching, top_k=top_k,
                              vocab=self.vocab)


def critic_role(critic: Critic | CriticRole, value_and_grad: ValueAndGrad = pure_value_and_grad) -> CriticRole:
    """``critic`` as a role: a :class:`~purerl.models.Critic` model becomes a :class:`LocalCritic`
    (with ``value_and_grad``); a role is returned as it is."""
    return LocalCritic(critic, value_and_grad) if isinstance(critic, Critic) else critic
