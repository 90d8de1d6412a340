"""The updates: policy (actor) and value (critic) gradient steps over epochs × mini-batches ×
micro-batches, with the donated optimizer.

Optimizer updates *donate* the old params and optimizer state (they are updated in place and
returned): never use a ``TrainState`` after passing it to a step. A mini-batch whose loss or
gradient norm is not finite is rejected: the optimizer is not called (``*/rejected_updates``).
An update whose finite gradient still leaves a non-finite param or optimizer moment, or moves the
params' global norm by more than a factor of :data:`MAX_NORM_CHANGE` either way (huge but finite
weights: an ``lr`` of 1e6 or 1e30; a healthy step moves it by about 1e-4), flags ``*/diverged``
(and ``*/param_norm_change``, the factor): it was written in place (undoing it would cost a second copy of
params and moments), so the driver stops the run before anything of it is saved.

The one injected effect is ``value_and_grad``: the pure :func:`purerl.models.value_and_grad`
here, a sharded ``.backward()`` in distributed executors. Index tensors are built on the device
of the data they index; random draws come from CPU generators, so a seed gives the same shuffle
on every device (``tests/test_gpu.py`` checks what a CPU run cannot see).
"""

from collections.abc import Callable
from typing import Any

import attrs
import torch
from jaxtyping import Bool
from torch import Tensor

from purerl.algo.aggregation import LOSS_AGGREGATIONS, SumCount, loss_denominator, token_mean
from purerl.algo.distill import generalized_jsd_at_ids
from purerl.algo.kl import kl_loss
from purerl.algo.value_loss import clipped_value_loss
from purerl.models import CausalLM, Critic, Params, response_values
from purerl.models import value_and_grad as pure_value_and_grad
from purerl.models.scores import response_scores
from purerl.state import RngState
from purerl.step.micro_batches import chunks, micro_batch_rows, trimmed
from purerl.step.settings import ActorLoss, Batching, ValueLoss
from purerl.step.shaping import Metrics, TrainBatch
from purerl.tree import tree_all_finite, tree_leaves, tree_map

__all__ = ["ValueAndGrad", "actor_update", "critic_update"]

ValueAndGrad = Callable[[Callable[..., tuple[SumCount, Any]]], Callable[..., tuple[SumCount, Any, Any]]]

_LOSS_STREAM = 2  # the RNG stream of random choices inside losses
_SYNC_GAP = "sync_gap"  # an aux term read only before the first optimizer step: the weights that sampled


def _minibatches(n: int, rows: int | None, epochs: int, rng: RngState, device: torch.device) -> list[Tensor]:
    """Row index sets for ``epochs`` shuffled passes in mini-batches of ``rows`` (all rows if None),
    on ``device`` (the batch's: indices live beside the data they index). The shuffle is drawn on
    the CPU, so it is the same whatever the device."""
    size = n if rows is None else min(rows, n)
    g = rng.generator()
    out = []
    for _ in range(epochs):
        order = (torch.randperm(n, generator=g) if size < n else torch.arange(n)).to(device)
        out.extend(order[sl] for sl in chunks(n, size))
    return out


MAX_NORM_CHANGE = 2.0
"""The largest factor by which one optimizer step may change the params' global L2 norm."""


def _norm_change(before: Tensor, after: Tensor) -> float:
    """``max(after / before, before / after)`` of two global norms (inf when either is 0 and the other is not)."""
    before, after = float(before), float(after)
    if before == after:
        return 1.0
    if min(before, after) == 0:
        return float("inf")
    return max(after / before, before / after)


def _finite(*values: Tensor) -> bool:
    return all(bool(torch.isfinite(v).all()) for v in values)


@torch.no_grad()  # of params that require grad too (a rank's), read as a float
def _grad_norm(grads: Any) -> Tensor:
    leaves = [g for g in tree_leaves(grads) if isinstance(g, Tensor)]
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in leaves]))


def _actor_loss(policy: CausalLM, loss: ActorLoss, rng: RngState) -> Callable:
    """The actor's loss as a function of (params, micro-batch): the policy loss (with its own
    settings), the entropy bonus and the KL loss, all aggregated alike. Losses that draw at
    random (``clip_cov``) draw from one generator seeded by ``rng``, in micro-batch order."""
    policy_loss = loss.policy_loss
    agg, norm, entropy_coeff = policy_loss.aggregation, policy_loss.loss_norm, loss.entropy_coeff
    generator = rng.fold_in(_LOSS_STREAM).generator()

    def loss_fn(params: Params, batch: TrainBatch) -> tuple[SumCount, dict[str, SumCount]]:
        mask, temperature = batch.sequences.response_mask, batch.temperature
        ids = batch.sequences.responses()[..., None]
        if loss.distill is not None:
            teacher = batch.teacher
            if teacher is None or teacher.top_ids is None:
                raise ValueError("actor_update: a distillation loss needs the teacher's top-k scores "
                                 "(ExperienceSettings.teacher_top_k and a teacher role)")
            ids = torch.cat([ids, teacher.top_ids.long()], -1)  # the student's log-probs there too
        scores = response_scores(policy, params, batch.sequences, temperature=temperature, ids=ids,
                                 entropy=entropy_coeff != 0 or loss.compute_entropy)
        logp = scores.logprobs[..., 0]
        out = policy_loss(logp, batch.old_logprobs, batch.advantages, mask, is_weights=batch.is_weights,
                          generator=generator)
        total = out.loss
        aux = {"pg_loss": out.loss, "pg_clipfrac": out.clipfrac, "pg_clipfrac_lower": out.clipfrac_lower,
               "ppo_kl": out.ppo_kl}
        if batch.behaviour_logprobs is not None:  # the weight-sync check: no pass of its own
            gap = torch.where(mask, (logp.detach() - batch.behaviour_logprobs).abs(), 0.0)
            aux[_SYNC_GAP] = token_mean(gap, mask)
        if scores.entropy is not None:
            entropy = scores.entropy if entropy_coeff != 0 else scores.entropy.detach()
            ent = LOSS_AGGREGATIONS[agg](entropy, mask, norm)
            aux["entropy"] = ent
            if entropy_coeff != 0:
                total = SumCount(total.total - entropy_coeff * ent.total, total.count)
        if loss.kl_coef > 0:
            if batch.ref_logprobs is None:
                raise ValueError("actor_update: a KL loss (kl_coef > 0) needs reference log-probs "
                                 "(TrainState.reference params)")
            kl = kl_loss(logp, batch.ref_logprobs, mask, loss.kl_type, agg, norm)
            aux["kl_loss"] = kl
            total = SumCount(total.total + loss.kl_coef * kl.total, total.count)
        if loss.distill is not None:
            jsd = generalized_jsd_at_ids(scores.logprobs[..., 1:], batch.teacher.top_logprobs, mask,
                                         beta=loss.distill.beta)
            divergence = LOSS_AGGREGATIONS[agg](jsd, mask, norm)
            aux["distill_loss"] = divergence
            total = SumCount(total.total + loss.distill.coef * divergence.total, total.count)
        return total, aux

    return loss_fn


def _update(params: Params, opt_state: Any, optimizer: Any, batch: TrainBatch, indices: list[Tensor],
            loss_fn: Callable[[Params, TrainBatch], tuple[SumCount, Any]], batching: Batching,
            value_and_grad: ValueAndGrad, prefix: str, agg: str,
            needed: Bool[Tensor, " b"] | None = None) -> tuple[Params, Any, Metrics]:
    """Mini-batch × micro-batch gradient steps; micro-batch gradients add up to the mini-batch's.
    Micro-batches hold ``batching.micro_batch_rows`` rows, or at most ``batching.max_tokens``
    positions once their padding is trimmed (:mod:`purerl.step.micro_batches`).

    The micro-batch is an argument of the differentiated function (not closed over), so a
    data-parallel ``value_and_grad`` can take its own rank's rows of it. Rows where ``needed`` is
    False add nothing to the loss: they count in its denominator but skip forward and backward
    (a mini-batch with none left still takes its optimizer step, with zero gradients).
    """
    grad_fn, max_tokens = value_and_grad(loss_fn), batching.max_tokens
    sums: dict[str, SumCount] = {}
    norms, rejected, skipped, flags = [], 0, 0, {}
    param_norm = _grad_norm(params) if tree_leaves(params) else None
    for rows in indices:
        denominator = loss_denominator(batch.sequences.response_mask[rows], agg)
        if needed is not None:
            kept = rows[needed[rows]]
            skipped, rows = skipped + len(rows) - len(kept), kept
        mini = batch.rows(rows)
        grads, mini_loss = None, None
        parts = micro_batch_rows(mini.sequences, batching.micro_batch_rows, max_tokens)
        for sl in parts:
            micro = mini if len(parts) == 1 and max_tokens is None else mini.rows(sl)
            if max_tokens is not None:
                micro = trimmed(micro)
            loss, aux, grads = grad_fn(params, micro, denominator=denominator.clamp_min(1), into=grads)
            mini_loss = loss if mini_loss is None else mini_loss + loss
            for name, value in aux.items():
                if name == _SYNC_GAP and norms:
                    continue  # the params have moved since the weights that sampled
                sums[name] = sums[name] + value if name in sums else value
        if grads is None:
            grads = tree_map(torch.zeros_like, params)
        norm = _grad_norm(grads)
        finite_loss, finite_norm = mini_loss is None or _finite(mini_loss.total), _finite(norm)
        if not (finite_loss and finite_norm):
            rejected += 1
            flags = {"nonfinite_loss": float(not finite_loss), "nonfinite_grad_norm": float(not finite_norm)}
            break  # never feed a non-finite update to the (donating) optimizer
        params, opt_state = optimizer.update(grads, opt_state, params)
        norms.append(float(norm))
        if not tree_all_finite(params, opt_state):
            flags = {"diverged": 1.0}
            break
        if param_norm is not None:
            new_norm = _grad_norm(params)
            change = _norm_change(param_norm, new_norm)
            if not change <= MAX_NORM_CHANGE:
                flags = {"diverged": 1.0, "param_norm_change": change}
                break
            param_norm = new_norm
    metrics = {f"{prefix}/{name}": float(value.value()) for name, value in sums.items()}
    metrics[f"{prefix}/grad_norm"] = sum(norms) / len(norms) if norms else float("nan")
    metrics[f"{prefix}/rejected_updates"] = float(rejected)
    metrics.update({f"{prefix}/{name}": value for name, value in flags.items()})
    if needed is not None:
        metrics[f"{prefix}/skipped_rows_frac"] = skipped / max(sum(len(rows) for rows in indices), 1)
    return params, opt_state, metrics


def actor_update(params: Params, opt_state: Any, batch: TrainBatch, *, policy: CausalLM, loss: ActorLoss,
                 batching: Batching, optimizer: Any, rng: RngState,
                 value_and_grad: ValueAndGrad = pure_value_and_grad) -> tuple[Params, Any, Metrics]:
    """PPO-style policy updates of ``loss`` over ``batching.epochs`` × mini-batches × micro-batches
    (donates ``params``/``opt_state``). With ``loss.skip_zero_advantage_rows``, rows whose
    advantages are all 0 skip the forward and backward while the loss lets them (it vanishes
    there, and no entropy bonus, KL loss or distillation loss reads them); the actor metrics then average over the
    rows that were updated. With ``loss.sync_tolerance`` and the batch's ``behaviour_logprobs`` (set
    when the weights in ``params`` sampled it), ``actor/sync_gap`` is their mean distance to the first
    mini-batch's log-probs, and ``actor/sync_failed`` flags one over the tolerance (the driver stops)."""
    indices = _minibatches(len(batch.sequences), batching.mini_batch_rows, batching.epochs, rng,
                           batch.advantages.device)
    if loss.sync_tolerance is None:
        batch = attrs.evolve(batch, behaviour_logprobs=None)
    skip = (loss.skip_zero_advantage_rows and loss.entropy_coeff == 0 and loss.kl_coef == 0 and loss.distill is None
            and loss.policy_loss.vanishes_at_zero_advantage)
    needed = (batch.advantages != 0).any(-1) if skip else None
    if needed is not None and batch.behaviour_logprobs is not None and not bool(needed[indices[0]].any()):
        needed = needed.clone()  # one row's forward still checks the sync (a corrupted engine may earn no reward)
        needed[indices[0][0]] = True
    fixed = attrs.evolve(loss, policy_loss=loss.policy_loss.with_norm(_fixed_norm(loss.policy_loss.loss_norm,
                                                                                    batching, batch)))
    params, opt_state, metrics = _update(params, opt_state, optimizer, batch, indices, _actor_loss(policy, fixed, rng),
                                         batching, value_and_grad, "actor", loss.policy_loss.aggregation, needed)
    gap = metrics.get(f"actor/{_SYNC_GAP}")
    if gap is not None and not gap <= loss.sync_tolerance:
        metrics["actor/sync_failed"] = 1.0
        metrics["actor/sync_tolerance"] = loss.sync_tolerance  # for the stop's message (a failed step ends the run)
    return params, opt_state, metrics


def _fixed_norm(norm: float | None, batching: Batching, batch: TrainBatch) -> float | None:
    """With a token budget, a loss norm of None (the padded length, verl's default) is the batch's
    response width, so trimming a micro-batch's padding does not change the loss. The width is
    the batch's (responses are padded to the longest), so this is resolved per batch, not per job."""
    if batching.max_tokens is None or norm is not None:
        return norm
    return float(batch.sequences.response_length)


def critic_update(params: Params, opt_state: Any, batch: TrainBatch, *, critic: Critic, loss: ValueLoss,
                  batching: Batching, optimizer: Any, rng: RngState,
                  value_and_grad: ValueAndGrad = pure_value_and_grad) -> tuple[Params, Any, Metrics]:
    """Clipped value-loss updates over ``batching``'s epochs, mini- and micro-batches (donates
    ``params``/``opt_state``)."""
    norm = _fixed_norm(loss.norm, batching, batch)

    def loss_fn(p: Params, micro: TrainBatch) -> tuple[SumCount, dict[str, SumCount]]:
        values = response_values(critic, p, micro.sequences)
        out = clipped_value_loss(values, micro.values, micro.returns, micro.sequences.response_mask,
                                 clip=loss.clip, agg=loss.agg, norm=norm)
        return out.loss, {"vf_loss": out.loss, "vf_clipfrac": out.clipfrac}

    indices = _minibatches(len(batch.sequences), batching.mini_batch_rows, batching.epochs, rng,
                           batch.returns.device)
    return _update(params, opt_state, optimizer, batch, indices, loss_fn, batching, value_and_grad, "critic",
                   loss.agg)
