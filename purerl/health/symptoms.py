"""The symptoms the health monitor knows (:data:`SYMPTOMS`), each a :class:`Symptom` record.

Each symptom is a :class:`Symptom` record in :data:`SYMPTOMS`: the signal it reads, when it holds,
and its line, which names the step, what was seen and the setting or file to look at. A row that
lacks a symptom's signal (a critic warm-up step has no policy gradient) leaves that symptom as it
was. The signals are metrics the step already reports, and those the sampling adds for this
(:func:`purerl.loop.sampling.joined_batch`): ``health/no_signal_frac`` (groups whose rewards are
all equal), ``health/reward_spread`` (the step's highest reward less its lowest, shaping included) and
``health/rule_positive_frac`` (samples the task's reward scored above 0); and, where the sampling
records them, ``health/rule_spread`` (the task's own reward's highest less its lowest, before any
shaping), ``health/reference_held_frac`` (responses that contain their reference answer) and
``health/reference_unrewarded_frac`` (of those, the share the task's reward scored 0 or less).
A symptom that reads one of these last three does without it where the row lacks it.
"""

from collections.abc import Callable, Mapping
from typing import Any

import attrs

from purerl.health.limits import OPENING_STEPS, Context, HealthLimits
from purerl.health.state import HealthState, Learning

__all__ = ["SYMPTOMS", "Row", "Symptom", "has", "learning_of"]


@attrs.frozen
class Symptom:
    """One symptom: ``holds(row, limits, context, past)`` is True or False where the row has its
    signal, None where it has not (``past``: the :class:`HealthState` before this row);
    ``line(row, limits, context, past, steps)`` says what was seen when it starts (``steps``: for how
    long); ``patience(limits)`` is how many steps in a row make it start (and clear)."""

    holds: Callable[[Mapping[str, Any], HealthLimits, Context, HealthState], bool | None]
    line: Callable[[Mapping[str, Any], HealthLimits, Context, HealthState, int], str]
    patience: Callable[[HealthLimits], int] = lambda limits: limits.patience


Row = Mapping[str, Any]
"""One row of ``metrics.jsonl``: a step's metrics (and its evaluation's, at evaluation steps)."""


def has(row: Row, *keys: str) -> bool:
    """Whether ``row`` holds a number under each of ``keys``."""
    return all(isinstance(row.get(k), (int, float)) for k in keys)


def _cut(row: Row, limits: HealthLimits, context: Context, past: HealthState) -> bool | None:
    return row["response_length/clip_ratio"] > limits.cut_share if has(row, "response_length/clip_ratio") else None


def _no_signal(row: Row, limits: HealthLimits, context: Context, past: HealthState) -> bool | None:
    if not has(row, "health/no_signal_frac", "health/rule_positive_frac"):
        return None
    return 0 < row["health/rule_positive_frac"] < 0.5 and row["health/no_signal_frac"] > limits.no_signal_share


def _constant(row: Row, limits: HealthLimits, context: Context, past: HealthState) -> bool | None:
    """Nothing tells samples apart: the step's rewards all equal, or the task's own reward the same for every
    sample whatever the shaping (``reward.overlong_*``) adds: ``health/rule_spread`` 0 where the row has it,
    else every sample scored above 0. A reward above 0 for no sample is ``dead_reward``'s."""
    if not has(row, "health/reward_spread", "health/rule_positive_frac"):
        return None
    positive = row["health/rule_positive_frac"]
    rule_alike = row["health/rule_spread"] == 0 if has(row, "health/rule_spread") else positive == 1
    return positive > 0 and (row["health/reward_spread"] == 0 or rule_alike)


def _dead_reward(row: Row, limits: HealthLimits, context: Context, past: HealthState) -> bool | None:
    return row["health/rule_positive_frac"] == 0 if has(row, "health/rule_positive_frac") else None


def _guessing(row: Row, limits: HealthLimits, context: Context, past: HealthState) -> bool | None:
    """Bare guesses: the task's reward above 0 for at most ``guess_reward`` of the samples, over
    ``guess_no_signal`` of the groups alike, and the mean response at most ``guess_tokens`` tokens and
    ``guess_length`` of its mean over the run's first steps (None before the first step's length is known)."""
    if not past.opening or not has(row, "response_length/mean", "health/no_signal_frac", "health/rule_positive_frac"):
        return None
    short = min(limits.guess_tokens, limits.guess_length * _opening_length(past))
    return (row["health/rule_positive_frac"] <= limits.guess_reward
            and row["health/no_signal_frac"] > limits.guess_no_signal and row["response_length/mean"] <= short)


def _stall_window(row: Row, limits: HealthLimits, past: HealthState) -> Learning | None:
    """What the last ``stall_steps`` steps learned, on average (None before as many are known)."""
    now = learning_of(row)
    window = (*past.recent, now)[-limits.stall_steps:] if now else ()
    if len(past.opening_learning) < OPENING_STEPS or len(window) < limits.stall_steps:
        return None
    return Learning.mean(window)


def learning_of(row: Row) -> Learning | None:
    """What ``stalled`` reads of the step ``row`` (None where the row lacks it)."""
    keys = ("health/rule_positive_frac", "health/no_signal_frac", "actor/entropy")
    return Learning(*(float(row[k]) for k in keys)) if has(row, *keys) else None


def _stalled(row: Row, limits: HealthLimits, context: Context, past: HealthState) -> bool | None:
    """Updates too small to learn: the reward flat, its groups telling samples apart, the entropy unmoved."""
    if (window := _stall_window(row, limits, past)) is None:
        return None
    first = Learning.mean(past.opening_learning)
    return (window.reward < min(first.reward + limits.stall_rise, 0.5) and window.alike < limits.stall_no_signal
            and abs(window.entropy - first.entropy) <= limits.stall_entropy * first.entropy)


def _stalled_line(row: Row, limits: HealthLimits, context: Context, past: HealthState, steps: int) -> str:
    now, first = _stall_window(row, limits, past), Learning.mean(past.opening_learning)
    return (f"the task rewarded {now.reward:.0%} of samples over the last {limits.stall_steps} steps "
            f"({first.reward:.0%} over the first steps) though {1 - now.alike:.0%} of groups told their samples apart, "
            f"and the entropy stayed at {now.entropy:.2f} nats per token (from {first.entropy:.2f}), for {steps} "
            f"steps: the updates are too small "
            f"to move the policy in this run's length; raise actor.lr (--lr), train LoRA at a larger one "
            f"(--lora-rank 32 --lr 5e-4), or run more steps (--steps); read {context.samples}")


def _opening_length(state: HealthState) -> float:
    """The mean response length over the run's first steps (0 before any)."""
    return sum(state.opening) / len(state.opening) if state.opening else 0.0


def _reference_unrewarded(row: Row, limits: HealthLimits) -> bool | None:
    """Whether the samples point at ``reward.fn``: at least ``blame_share`` of the responses contain their
    reference answer and most of those scored 0 or less (None where the row does not say). Fewer is chance:
    a short number of the question echoed (``Raj is 3 years old.``) holds a reference of 3."""
    if not has(row, "health/reference_held_frac", "health/reference_unrewarded_frac"):
        return None
    return row["health/reference_held_frac"] >= limits.blame_share and row["health/reference_unrewarded_frac"] > 0.5


def _entropy(row: Row, limits: HealthLimits, context: Context, past: HealthState) -> bool | None:
    return row["actor/entropy"] < limits.entropy_floor if has(row, "actor/entropy") else None


def _drift(row: Row, limits: HealthLimits, context: Context, past: HealthState) -> bool | None:
    return row["rollout/logprob_gap_mean"] > limits.logprob_gap if has(row, "rollout/logprob_gap_mean") else None


def _grad_norm(row: Row, limits: HealthLimits, context: Context, past: HealthState) -> bool | None:
    if not has(row, "actor/grad_norm"):
        return None
    return row["actor/grad_norm"] > limits.grad_norm_factor * context.grad_clip


def _zero_gradient(row: Row, limits: HealthLimits, context: Context, past: HealthState) -> bool | None:
    if not has(row, "actor/grad_norm"):
        return None
    return row["actor/grad_norm"] == 0 and _some_advantage(row)


def _some_advantage(row: Row) -> bool:
    """Whether a row of the step had a nonzero advantage: read from the advantages' extremes where the row
    has them, since a step whose groups are all alike still forwards one row, with advantage 0, to check the
    weight sync (so ``actor/skipped_rows_frac`` is under 1 there and says nothing)."""
    if has(row, "critic/advantages/max", "critic/advantages/min"):
        return row["critic/advantages/max"] != 0 or row["critic/advantages/min"] != 0
    return row.get("actor/skipped_rows_frac", 0.0) < 1


def _dropped(row: Row, limits: HealthLimits, context: Context, past: HealthState) -> bool | None:
    if not has(row, "val/accuracy") or past.best_accuracy is None:
        return None
    return past.best_accuracy - row["val/accuracy"] > limits.eval_drop


_HARDER = ("more samples per prompt (rollout.n, --samples-per-prompt), algorithm.dynamic_sampling=true, a supervised "
          "warm-up first (env.sft_steps, where the environment writes demonstrations), or a smaller or easier task")
"""The knobs for a task the model cannot solve yet (its groups all fail alike)."""


def _constant_line(row: Row, limits: HealthLimits, context: Context, past: HealthState, steps: int) -> str:
    if row["health/reward_spread"] == 0:
        seen = "every sample of the step got the same reward"
    elif has(row, "health/rule_spread"):
        seen = (f"the task's reward gave every sample the same score (the rewards' spread of "
                f"{row['health/reward_spread']:.3g} is the shaping's)")
    else:
        seen = "the task's reward scored every sample above 0 (whatever the shaping adds)"
    return (f"{seen} for {steps} steps: nothing tells answers apart; read {context.samples} and check reward.fn (a "
            "reward that accepts anything, under which held-out accuracy means nothing too, or a task already solved)")


def _dead_reward_line(row: Row, limits: HealthLimits, context: Context, past: HealthState, steps: int) -> str:
    seen = f"the task's reward gave no sample more than 0 for {steps} steps"
    suspect = _reference_unrewarded(row, limits)
    held = row.get("health/reference_held_frac")
    if suspect:
        return (f"{seen}, though {held:.0%} of responses contain their reference answer: "
                f"check reward.fn against what the model writes in {context.samples}")
    if suspect is False:
        return (f"{seen} and {f'only {held:.0%} of responses contain their' if held else 'no response contains its'} "
                f"reference answer: the model cannot solve the task yet (reward.fn is not to blame); try {_HARDER}; "
                f"read {context.samples}")
    return (f"{seen}: read {context.samples} (each response, its reward and the reference): if responses that "
            f"contain their reference score 0, check reward.fn; if none does, the model cannot solve the task yet: "
            f"try {_HARDER}")


def _guessing_line(row: Row, limits: HealthLimits, context: Context, past: HealthState, steps: int) -> str:
    seen = (f"responses of {row['response_length/mean']:.1f} tokens on average (from {_opening_length(past):.1f} "
            f"over the first steps) while the task rewarded {row['health/rule_positive_frac']:.0%} of samples and "
            f"{row['health/no_signal_frac']:.0%} of groups scored alike, for {steps} steps: the model answers with "
            f"bare guesses, whose alike groups teach nothing; try {_HARDER}")
    if _reference_unrewarded(row, limits):
        return (f"{seen}; but {row['health/reference_unrewarded_frac']:.0%} of the responses that contain their "
                f"reference answer scored 0: check reward.fn against them in {context.samples}")
    return f"{seen}; read {context.samples}"


SYMPTOMS: dict[str, Symptom] = {
    "cut_responses": Symptom(_cut, lambda row, limits, context, past, steps: (
        f"{row['response_length/clip_ratio']:.0%} of responses cut at rollout.max_new_tokens={context.max_new_tokens} "
        f"(over {limits.cut_share:.0%} for {steps} steps): the answers do not fit; raise rollout.max_new_tokens or "
        f"reward.overlong_buffer, and read the responses in {context.samples}")),
    "no_signal": Symptom(_no_signal, lambda row, limits, context, past, steps: (
        f"{row['health/no_signal_frac']:.0%} of groups scored alike (over {limits.no_signal_share:.0%} for {steps} "
        f"steps) while {row['health/rule_positive_frac']:.0%} of samples were rewarded: those groups have "
        "advantages of 0 and teach nothing; the task is too hard for the model: a larger rollout.n, "
        "algorithm.dynamic_sampling=true, or easier data")),
    "constant_reward": Symptom(_constant, _constant_line),
    "dead_reward": Symptom(_dead_reward, _dead_reward_line),
    "guessing": Symptom(_guessing, _guessing_line),
    "stalled": Symptom(_stalled, _stalled_line),
    "entropy_collapse": Symptom(_entropy, lambda row, limits, context, past, steps: (
        f"entropy {row['actor/entropy']:.3g} nats per token (under {limits.entropy_floor:g} for {steps} steps): "
        "the policy has collapsed onto single answers; lower actor.lr, or add actor.entropy_coeff")),
    "logprob_drift": Symptom(_drift, lambda row, limits, context, past, steps: (
        f"the engine's log-probs are {row['rollout/logprob_gap_mean']:.3g} nats per token from the trainer's "
        f"(over {limits.logprob_gap:g} for {steps} steps): the rollout is off-policy; check the weight sync, "
        "rollout.engine and model.dtype, or set algorithm.rollout_correction")),
    "grad_norm_high": Symptom(_grad_norm, lambda row, limits, context, past, steps: (
        f"gradient norm {row['actor/grad_norm']:.3g}, over {limits.grad_norm_factor:g}× actor.grad_clip="
        f"{context.grad_clip:g} for {steps} steps: every update is clipped hard and steers by direction alone; "
        "lower actor.lr")),
    "zero_gradient": Symptom(_zero_gradient, lambda row, limits, context, past, steps: (
        f"gradient norm 0 for {steps} steps although some rows have an advantage: the weights no longer respond "
        "(an update too large, e.g. actor.lr); resume from an earlier checkpoint with a smaller actor.lr")),
    "heldout_drop": Symptom(_dropped, lambda row, limits, context, past, steps: (
        f"held-out accuracy {row['val/accuracy']:.1%}, over {100 * limits.eval_drop:.0f} points below the run's "
        f"best: the run is forgetting; lower actor.lr, or keep the checkpoint of the best evaluation"),
        patience=lambda limits: 1),
}
"""Every symptom the monitor knows, by the name its lines and ``health/*`` keys use."""
