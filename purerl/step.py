"""Stage functions and the composed GRPO / PPO steps.

Every stage is a function of explicit inputs that returns new values::

    experience = make_experience(state, rollout, scores, ...)     # old/ref log-probs, values
    batch, kl_state, m1 = shape_rewards(experience, state.kl, ...)  # KL penalty, advantages
    critic, critic_opt, m2 = critic_update(...)                     # PPO only
    policy, policy_opt, m3 = actor_update(...)

:func:`grpo_step` and :func:`ppo_step` compose them; a user script can compose its own step from
the same stages (see the README). The one injected effect is ``value_and_grad``: the pure
``purerl.models.value_and_grad`` here, a sharded ``.backward()`` in distributed executors.

Optimizer updates *donate* the old params and optimizer state (they are updated in place and
returned): never use a ``TrainState`` after passing it to a step. A step whose loss or gradient
norm is not finite is rejected: the optimizer is not called, so with one mini-batch per step
(the default) the returned state equals the input state apart from the RNG counter and step.

Devices: the stages run where the rollout's tensors are (CPU or one GPU). An index tensor is
built on the device of the data it indexes (torch refuses a CPU index of a CUDA tensor's rows
when it is combined with a CUDA mask); random draws come from CPU generators, so a seed gives
the same shuffle on every device. A CPU run cannot see a mix-up: ``tests/test_gpu.py`` can.
"""

import functools
import math
from collections.abc import Callable
from typing import Any

import attrs
import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from purerl.algo.advantages import AdvantageConfig, AdvantageInputs, compute_advantages
from purerl.algo.aggregation import LOSS_AGGREGATIONS, SumCount, loss_denominator
from purerl.algo.correction import IS_CORRECTIONS, CorrectionConfig, importance_weights
from purerl.algo.kl import apply_kl_penalty, kl_loss
from purerl.algo.logprobs import (
    entropy_from_logits,
    logprobs_from_logits,
    sum_pi_squared_from_logits,
)
from purerl.algo.masked import masked_mean
from purerl.algo.policy_loss import (
    POLICY_LOSSES,
    LossOptions,
    PolicyLossConfig,
    loss_aggregation,
    vanishes_at_zero_advantage,
)
from purerl.algo.value_loss import clipped_value_loss
from purerl.batch import FINISH_LENGTH, Rewards, Rollout, Sequences
from purerl.models import CausalLM, Critic, Params, response_logits, response_values
from purerl.models import value_and_grad as pure_value_and_grad
from purerl.state import RngState, TrainState
from purerl.tree import pytree, tree_leaves, tree_map

__all__ = [
    "StepConfig",
    "Experience",
    "TrainBatch",
    "token_level_scores",
    "make_experience",
    "shape_rewards",
    "actor_update",
    "critic_update",
    "grpo_step",
    "ppo_step",
    "Metrics",
]

Metrics = dict[str, float]
ValueAndGrad = Callable[[Callable[..., tuple[SumCount, Any]]], Callable[..., tuple[SumCount, Any, Any]]]


@attrs.frozen
class StepConfig:
    """Hyperparameters of one RL step (defaults follow verl's GRPO recipes where they exist)."""

    adv_estimator: str = "grpo"
    norm_adv_by_std: bool = True
    gamma: float = 1.0
    lam: float = 1.0
    policy_loss: str = "vanilla"
    clip_low: float = 0.2
    clip_high: float = 0.2
    clip_c: float | None = 3.0
    loss_agg: str = "token-mean"
    loss_norm: float | None = None
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    use_kl_in_reward: bool = False
    kl_penalty: str = "kl"
    ppo_epochs: int = 1
    mini_batch_rows: int | None = None
    micro_batch_rows: int = 8
    temperature: float = 1.0
    value_clip: float | None = 0.5
    compute_entropy: bool = True
    recompute_old_logprobs: bool = True
    """False: use the rollout's behaviour log-probs as π_old (verl's bypass mode). Exact when the
    engine samples from the trainer's distribution (embedded engine, fp32, no top-p/top-k) and
    saves one forward pass over the batch."""
    rollout_correction: str = "none"
    """Importance weights from the behaviour policy (the engine's log-probs) to the proximal one (the
    recomputed old log-probs), multiplying the per-token policy loss (:mod:`purerl.algo.correction`):
    ``none``, ``token-tis``, ``seq-tis``, ``token-mask``. For stale rollouts this is the decoupled
    PPO objective; for an engine that computes differently from the trainer, truncated IS."""
    correction: CorrectionConfig = CorrectionConfig()
    """The cap (and ``token-mask``'s lower bound) of ``rollout_correction``."""
    loss_options: LossOptions = LossOptions()
    """Settings of particular policy losses (SAPO's τ, clip-cov and KL-cov ratios, DRO's β,
    bypass mode); the clip settings and aggregation above apply to every loss."""
    gdpo_weights: tuple[float, ...] | None = None
    """``gdpo``: the weight of each reward component (:class:`~purerl.batch.Rewards`); None: all 1."""
    skip_zero_advantage_rows: bool = True
    """Leave rows whose advantages are all 0 (GRPO groups whose samples scored alike) out of the
    actor's forward and backward, for policy losses to which such rows add exactly 0 loss and
    gradient (:func:`~purerl.algo.policy_loss.vanishes_at_zero_advantage`: ``−A·f(ratio)`` per
    token; not ``kl_cov``, ``clip_cov``, ``dro``): the update is the same (the loss is still
    normalised by the whole mini-batch). Applies only while no entropy bonus and no KL loss
    depend on those rows. The actor metrics (``pg_loss``, ``ppo_kl``, ``entropy``, …)
    then average over the rows that went through the update; ``actor/skipped_rows_frac`` counts
    the others."""

    @property
    def policy_loss_config(self) -> PolicyLossConfig:
        return PolicyLossConfig.of(self.loss_options, clip_low=self.clip_low, clip_high=self.clip_high,
                                   clip_c=self.clip_c, agg=self.loss_agg, norm=self.loss_norm)

    @property
    def actor_agg(self) -> str:
        """The aggregation the actor's loss terms share (``loss_agg``, unless the policy loss fixes its own)."""
        return loss_aggregation(self.policy_loss, self.loss_agg)

    def __attrs_post_init__(self) -> None:
        if self.loss_agg not in LOSS_AGGREGATIONS:
            raise ValueError(f"StepConfig: unknown loss_agg {self.loss_agg!r}; known: {LOSS_AGGREGATIONS.names()}")
        if self.policy_loss not in POLICY_LOSSES:
            raise ValueError(f"StepConfig: unknown policy_loss {self.policy_loss!r}; known: {POLICY_LOSSES.names()}")
        if self.rollout_correction not in IS_CORRECTIONS:
            raise ValueError(f"StepConfig: unknown rollout_correction {self.rollout_correction!r}; "
                             f"known: {IS_CORRECTIONS.names()}")
        if self.ppo_epochs < 1 or self.micro_batch_rows < 1:
            raise ValueError("StepConfig: ppo_epochs and micro_batch_rows must be ≥ 1")
        if self.mini_batch_rows is not None and self.mini_batch_rows < 1:
            raise ValueError("StepConfig: mini_batch_rows must be ≥ 1 or None")


@pytree
class Experience:
    """A scored rollout with everything the updates need, computed before any update.
    ``baselines``/``components``: see :class:`~purerl.batch.Rewards`; ``sum_pi_squared``:
    ``Σ_v π_old(v)²`` per response position, for the optimal-token-baseline estimators."""

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


@pytree
class TrainBatch:
    """What the actor and critic updates consume. ``is_weights``: the off-policy correction's
    per-token weights of the policy loss (None: uncorrected; see ``StepConfig.rollout_correction``)."""

    sequences: Sequences
    old_logprobs: Float[Tensor, "b t"]
    ref_logprobs: Float[Tensor, "b t"] | None
    advantages: Float[Tensor, "b t"]
    returns: Float[Tensor, "b t"]
    values: Float[Tensor, "b t"] | None
    is_weights: Float[Tensor, "b t"] | None = None

    def rows(self, index: Tensor | slice) -> "TrainBatch":
        return tree_map(lambda x: x[index] if isinstance(x, Tensor) else x, self)


def token_level_scores(scores: Float[Tensor, " b"], mask: Bool[Tensor, "b t"]) -> Float[Tensor, "b t"]:
    """Each sequence's score placed on its last valid token (0 elsewhere, and for empty rows)."""
    positions = torch.arange(mask.shape[1], device=mask.device)
    last = torch.where(mask, positions, -1).max(-1).values
    onehot = (positions[None] == last[:, None]) & mask
    return torch.where(onehot, scores[:, None].to(torch.float32), 0.0)


def _chunks(n: int, size: int) -> list[slice]:
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


@torch.no_grad()
def _batched(model: CausalLM | Critic, fn: Callable[[Sequences], Tensor], seqs: Sequences, rows: int) -> Tensor:
    """``fn`` (row-wise) over ``seqs`` in chunks of ``rows``, without gradients, concatenated."""
    return torch.cat([model.map_rows(fn, seqs.rows(sl)) for sl in _chunks(len(seqs), rows)])


def _logprobs_fn(model: CausalLM, params: Params, temperature: float) -> Callable[[Sequences], Tensor]:
    def logprobs(part: Sequences) -> Tensor:
        return logprobs_from_logits(response_logits(model, params, part), part.responses(), temperature=temperature)

    return logprobs


def _logprobs_and_sum_pi_squared_fn(model: CausalLM, params: Params,
                                    temperature: float) -> Callable[[Sequences], Tensor]:
    """Log-probs and ``Σ_v π(v)²`` per response position, stacked on the last axis, from one forward."""
    def both(part: Sequences) -> Tensor:
        logits = response_logits(model, params, part)
        return torch.stack([logprobs_from_logits(logits, part.responses(), temperature=temperature),
                            sum_pi_squared_from_logits(logits, temperature=temperature).to(torch.float32)], -1)

    return both


_NEEDS_SUM_PI_SQUARED = ("optimal_token_baseline", "tir_optimal_token_baseline")


def make_experience(state: TrainState, rollout: Rollout, scores: Float[Tensor, " b"] | Rewards, *,
                    policy: CausalLM, config: StepConfig, critic: Critic | None = None) -> Experience:
    """Old log-probs (the policy before the update), reference log-probs and values, no gradients.
    ``scores``: one per row, or :class:`~purerl.batch.Rewards` with ReMax baselines / GDPO
    components."""
    rewards = Rewards.of(scores)
    seqs = rollout.sequences
    rows, sum_pi_squared, old = config.micro_batch_rows, None, rollout.behaviour_logprobs
    if config.adv_estimator in _NEEDS_SUM_PI_SQUARED:  # Σπ² of π_old: the recomputed policy, whatever the flag
        both = _batched(policy, _logprobs_and_sum_pi_squared_fn(policy, state.policy, config.temperature), seqs, rows)
        sum_pi_squared = both[..., 1]
        if config.recompute_old_logprobs:
            old = both[..., 0]
    elif config.recompute_old_logprobs:
        old = _batched(policy, _logprobs_fn(policy, state.policy, config.temperature), seqs, rows)
    needs_ref = config.use_kl_loss or config.use_kl_in_reward
    if needs_ref and state.reference is None:
        raise ValueError("make_experience: KL to the reference needs TrainState.reference params")
    ref = _batched(policy, _logprobs_fn(policy, state.reference, config.temperature), seqs, rows) if needs_ref else None
    values = None
    if config.adv_estimator == "gae":
        if critic is None or state.critic is None:
            raise ValueError("make_experience: the 'gae' estimator needs a critic and TrainState.critic params")
        values = _batched(critic, functools.partial(response_values, critic, state.critic), seqs, rows)
        values = torch.where(seqs.response_mask, values, 0.0)
    return Experience(seqs, rollout.group, rewards.scores.to(torch.float32), old, rollout.behaviour_logprobs, ref,
                      values, rewards.baselines, rewards.components, sum_pi_squared)


def shape_rewards(experience: Experience, kl_state: Any, kl_controller: Any, *,
                  config: StepConfig) -> tuple[TrainBatch, Any, Metrics]:
    """Token rewards (with the KL penalty when ``use_kl_in_reward``), advantages and the
    off-policy correction's weights (``rollout_corr/*`` metrics)."""
    mask = experience.sequences.response_mask
    rewards = token_level_scores(experience.scores, mask)
    metrics: Metrics = {}
    if config.use_kl_in_reward:
        penalty = apply_kl_penalty(rewards, experience.old_logprobs, experience.ref_logprobs, mask,
                                   kl_state.coef, config.kl_penalty)
        metrics["actor/reward_kl_penalty"] = float(penalty.current_kl)
        metrics["actor/reward_kl_penalty_coeff"] = float(kl_state.coef)
        kl_state = kl_controller.update(kl_state, penalty.current_kl, len(experience.scores))
        rewards = penalty.rewards
    is_weights, correction = importance_weights(config.rollout_correction, experience.old_logprobs,
                                                experience.behaviour_logprobs, mask, config.correction)
    otb = config.adv_estimator in _NEEDS_SUM_PI_SQUARED
    inputs = AdvantageInputs(rewards=rewards, mask=mask, values=experience.values, group=experience.group,
                             reward_baselines=experience.baselines, reward_components=experience.components,
                             old_logprobs=experience.old_logprobs if otb else None,
                             sum_pi_squared=experience.sum_pi_squared if otb else None,
                             is_weights=is_weights if otb else None)
    adv_config = AdvantageConfig(gamma=config.gamma, lam=config.lam, norm_by_std=config.norm_adv_by_std,
                                 gdpo_weights=config.gdpo_weights)
    advantages, returns = compute_advantages(config.adv_estimator, inputs, adv_config)
    metrics.update({
        "critic/score/mean": float(experience.scores.mean()),
        "critic/rewards/mean": float(rewards.sum(-1).mean()),
        "critic/advantages/mean": float(masked_mean(advantages, mask)),
        "critic/advantages/max": float(torch.where(mask, advantages, -math.inf).max()) if mask.any() else 0.0,
        "critic/advantages/min": float(torch.where(mask, advantages, math.inf).min()) if mask.any() else 0.0,
        "critic/returns/mean": float(masked_mean(returns, mask)),
    })
    metrics.update({f"rollout_corr/{name}": float(value.value()) for name, value in correction.items()})
    batch = TrainBatch(experience.sequences, experience.old_logprobs, experience.ref_logprobs,
                       advantages, returns, experience.values, is_weights)
    return batch, kl_state, metrics


def _minibatches(n: int, rows: int | None, epochs: int, rng: RngState, device: torch.device) -> list[Tensor]:
    """Row index sets for ``epochs`` shuffled passes in mini-batches of ``rows`` (all rows if None),
    on ``device`` (the batch's: indices live beside the data they index). The shuffle is drawn on
    the CPU, so it is the same whatever the device."""
    size = n if rows is None else min(rows, n)
    g = rng.generator()
    out = []
    for _ in range(epochs):
        order = (torch.randperm(n, generator=g) if size < n else torch.arange(n)).to(device)
        out.extend(order[sl] for sl in _chunks(n, size))
    return out


def _finite(*values: Tensor) -> bool:
    return all(bool(torch.isfinite(v).all()) for v in values)


def _grad_norm(grads: Any) -> Tensor:
    leaves = [g for g in tree_leaves(grads) if isinstance(g, Tensor)]
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in leaves]))


def _accumulate(total: Any, grads: Any) -> Any:
    if total is None:
        return grads
    torch._foreach_add_([t for t in tree_leaves(total)], [g for g in tree_leaves(grads)])
    return total


def _actor_loss(policy: CausalLM, config: StepConfig, rng: RngState) -> Callable:
    """The actor's loss as a function of (params, micro-batch): policy loss, entropy bonus, KL loss,
    all aggregated alike (:attr:`StepConfig.actor_agg`). Losses that draw at random (``clip_cov``)
    draw from one generator seeded by ``rng``, in micro-batch order."""
    loss_config, agg = config.policy_loss_config, config.actor_agg
    generator = rng.fold_in(_LOSS_STREAM).generator()

    def loss_fn(params: Params, batch: TrainBatch) -> tuple[SumCount, dict[str, SumCount]]:
        mask = batch.sequences.response_mask
        logits = response_logits(policy, params, batch.sequences)
        logp = logprobs_from_logits(logits, batch.sequences.responses(), temperature=config.temperature)
        out = POLICY_LOSSES[config.policy_loss](logp, batch.old_logprobs, batch.advantages, mask, loss_config,
                                                is_weights=batch.is_weights, generator=generator)
        total = out.loss
        aux = {"pg_loss": out.loss, "pg_clipfrac": out.clipfrac, "pg_clipfrac_lower": out.clipfrac_lower,
               "ppo_kl": out.ppo_kl}
        if config.entropy_coeff != 0 or config.compute_entropy:
            with torch.set_grad_enabled(config.entropy_coeff != 0 and torch.is_grad_enabled()):
                entropy = entropy_from_logits(logits if config.entropy_coeff != 0 else logits.detach(),
                                              temperature=config.temperature)
            ent = LOSS_AGGREGATIONS[agg](entropy, mask, config.loss_norm)
            aux["entropy"] = ent
            if config.entropy_coeff != 0:
                total = SumCount(total.total - config.entropy_coeff * ent.total, total.count)
        if config.use_kl_loss:
            kl = kl_loss(logp, batch.ref_logprobs, mask, config.kl_loss_type, agg, config.loss_norm)
            aux["kl_loss"] = kl
            total = SumCount(total.total + config.kl_loss_coef * kl.total, total.count)
        return total, aux

    return loss_fn


_LOSS_STREAM = 2  # the RNG stream of random choices inside losses


def _update(params: Params, opt_state: Any, optimizer: Any, batch: TrainBatch, indices: list[Tensor],
            loss_fn: Callable[[Params, TrainBatch], tuple[SumCount, Any]], config: StepConfig,
            value_and_grad: ValueAndGrad, prefix: str, agg: str,
            needed: Bool[Tensor, " b"] | None = None) -> tuple[Params, Any, Metrics]:
    """Mini-batch × micro-batch gradient steps; micro-batch gradients add up to the mini-batch's.

    The micro-batch is an argument of the differentiated function (not closed over), so a
    data-parallel ``value_and_grad`` can take its own rank's rows of it. Rows where ``needed`` is
    False add nothing to the loss: they count in its denominator but skip forward and backward
    (a mini-batch with none left still takes its optimizer step, with zero gradients).
    """
    grad_fn = value_and_grad(loss_fn)
    sums: dict[str, SumCount] = {}
    norms, rejected, skipped = [], 0, 0
    for rows in indices:
        denominator = loss_denominator(batch.sequences.response_mask[rows], agg)
        if needed is not None:
            kept = rows[needed[rows]]
            skipped, rows = skipped + len(rows) - len(kept), kept
        mini = batch.rows(rows)
        grads, mini_loss = None, None
        parts = _chunks(len(rows), config.micro_batch_rows)
        for sl in parts:
            micro = mini if len(parts) == 1 else mini.rows(sl)
            loss, aux, g = grad_fn(params, micro, denominator=denominator.clamp_min(1))
            grads = _accumulate(grads, g)
            mini_loss = loss if mini_loss is None else mini_loss + loss
            for name, value in aux.items():
                sums[name] = sums[name] + value if name in sums else value
        if grads is None:
            grads = tree_map(torch.zeros_like, params)
        norm = _grad_norm(grads)
        if not _finite(norm, *([] if mini_loss is None else [mini_loss.total])):
            rejected += 1
            break  # never feed a non-finite update to the (donating) optimizer
        params, opt_state = optimizer.update(grads, opt_state, params)
        norms.append(float(norm))
    metrics = {f"{prefix}/{name}": float(value.value()) for name, value in sums.items()}
    metrics[f"{prefix}/grad_norm"] = sum(norms) / len(norms) if norms else float("nan")
    metrics[f"{prefix}/rejected_updates"] = float(rejected)
    if needed is not None:
        metrics[f"{prefix}/skipped_rows_frac"] = skipped / max(sum(len(rows) for rows in indices), 1)
    return params, opt_state, metrics


def actor_update(params: Params, opt_state: Any, batch: TrainBatch, *, policy: CausalLM, optimizer: Any,
                 config: StepConfig, rng: RngState,
                 value_and_grad: ValueAndGrad = pure_value_and_grad) -> tuple[Params, Any, Metrics]:
    """PPO-style policy updates over ``ppo_epochs`` × mini-batches (donates ``params``/``opt_state``);
    rows with all-zero advantages skip forward and backward (see ``StepConfig.skip_zero_advantage_rows``)."""
    indices = _minibatches(len(batch.sequences), config.mini_batch_rows, config.ppo_epochs, rng,
                           batch.advantages.device)
    skip = (config.skip_zero_advantage_rows and config.entropy_coeff == 0 and not config.use_kl_loss
            and vanishes_at_zero_advantage(config.policy_loss, config.policy_loss_config))
    needed = (batch.advantages != 0).any(-1) if skip else None
    return _update(params, opt_state, optimizer, batch, indices, _actor_loss(policy, config, rng), config,
                   value_and_grad, "actor", config.actor_agg, needed)


def critic_update(params: Params, opt_state: Any, batch: TrainBatch, *, critic: Critic, optimizer: Any,
                  config: StepConfig, rng: RngState,
                  value_and_grad: ValueAndGrad = pure_value_and_grad) -> tuple[Params, Any, Metrics]:
    """Clipped value-loss updates (donates ``params``/``opt_state``)."""

    def loss_fn(p: Params, micro: TrainBatch) -> tuple[SumCount, dict[str, SumCount]]:
        values = response_values(critic, p, micro.sequences)
        out = clipped_value_loss(values, micro.values, micro.returns, micro.sequences.response_mask,
                                 clip=config.value_clip, agg=config.loss_agg, norm=config.loss_norm)
        return out.loss, {"vf_loss": out.loss, "vf_clipfrac": out.clipfrac}

    indices = _minibatches(len(batch.sequences), config.mini_batch_rows, config.ppo_epochs, rng,
                           batch.returns.device)
    return _update(params, opt_state, optimizer, batch, indices, loss_fn, config, value_and_grad, "critic",
                   config.loss_agg)


def _rollout_metrics(rollout: Rollout, experience: Experience) -> Metrics:
    mask = rollout.sequences.response_mask
    lengths = mask.sum(-1).float()
    gap = (experience.behaviour_logprobs - experience.old_logprobs).abs()
    return {
        "response_length/mean": float(lengths.mean()),
        "response_length/max": float(lengths.max()),
        "response_length/clip_ratio": float((rollout.finish_reasons == FINISH_LENGTH).float().mean()),
        "rollout/logprob_gap_max": float(torch.where(mask, gap, 0.0).max()),
        "rollout/logprob_gap_mean": float(masked_mean(gap, mask)),
    }


def grpo_step(state: TrainState, rollout: Rollout, scores: Float[Tensor, " b"] | Rewards, *, policy: CausalLM,
              optimizer: Any, kl_controller: Any, config: StepConfig,
              value_and_grad: ValueAndGrad = pure_value_and_grad) -> tuple[TrainState, Metrics]:
    """One GRPO step on a scored rollout: experience, advantages, actor update (no critic)."""
    experience = make_experience(state, rollout, scores, policy=policy, config=config)
    batch, kl_state, metrics = shape_rewards(experience, state.kl, kl_controller, config=config)
    params, opt_state, actor_metrics = actor_update(state.policy, state.policy_opt, batch, policy=policy,
                                                    optimizer=optimizer, config=config, rng=state.rng,
                                                    value_and_grad=value_and_grad)
    metrics.update(actor_metrics)
    metrics.update(_rollout_metrics(rollout, experience))
    return state.advance(policy=params, policy_opt=opt_state, kl=kl_state, rng=state.rng.next()), metrics


def ppo_step(state: TrainState, rollout: Rollout, scores: Float[Tensor, " b"] | Rewards, *, policy: CausalLM,
             critic: Critic, optimizer: Any, critic_optimizer: Any, kl_controller: Any, config: StepConfig,
             value_and_grad: ValueAndGrad = pure_value_and_grad, critic_warmup: int = 0) -> tuple[TrainState, Metrics]:
    """One PPO step: experience with values, GAE, critic update, then actor update. During the
    first ``critic_warmup`` steps (``state.step < critic_warmup``) only the critic trains (verl's
    ``trainer.critic_warmup``): the policy and its optimizer state come back unchanged."""
    experience = make_experience(state, rollout, scores, policy=policy, config=config, critic=critic)
    batch, kl_state, metrics = shape_rewards(experience, state.kl, kl_controller, config=config)
    critic_params, critic_opt, critic_metrics = critic_update(
        state.critic, state.critic_opt, batch, critic=critic, optimizer=critic_optimizer, config=config,
        rng=state.rng, value_and_grad=value_and_grad)
    if state.step < critic_warmup:
        params, opt_state, actor_metrics = state.policy, state.policy_opt, {"actor/critic_warmup": 1.0}
    else:
        params, opt_state, actor_metrics = actor_update(state.policy, state.policy_opt, batch, policy=policy,
                                                        optimizer=optimizer, config=config, rng=state.rng.next(),
                                                        value_and_grad=value_and_grad)
    metrics.update(critic_metrics)
    metrics.update(actor_metrics)
    metrics.update(_rollout_metrics(rollout, experience))
    metrics["critic/values/mean"] = float(masked_mean(experience.values, experience.sequences.response_mask))
    return state.advance(policy=params, policy_opt=opt_state, critic=critic_params, critic_opt=critic_opt,
                         kl=kl_state, rng=state.rng.next().next()), metrics
