"""The run-health monitor: the symptoms of a run going wrong, read from each step's metrics row.

Pure: :meth:`Monitor.observe` takes the monitor's :class:`HealthState` and one row of
``metrics.jsonl`` (what the step and, every ``trainer.eval_every`` steps, its evaluation reported)
and returns the next state and the :class:`Event` of each symptom that started or cleared at that
step. A symptom starts when its condition has held for ``patience`` steps in a row, and clears
when it has not held for as many (held-out accuracy: at the next evaluation). The loops print each
event's line, write ``health/<symptom>`` (1 started, 0 cleared) into that step's row, and the
summary folds the rows again (:meth:`Monitor.fold`), so a resumed run reports its whole history.

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

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import attrs

from purerl.validators import at_least, in_range, positive

__all__ = ["OPENING_STEPS", "SYMPTOMS", "Context", "Event", "HealthLimits", "HealthState", "Monitor", "Symptom",
           "report"]


@attrs.frozen
class HealthLimits:
    """When a symptom is reported (defaults chosen from the main job's seeds, BENCHMARKS.md "Learns on
    every seed"). Groups alike because the task is solved are no symptom (a learned main job has most of
    its groups all right), and clipping alone is none either (the main job's gradient norm is 2–5× its
    clip of 1.0 on nearly every healthy step). Symptoms without a threshold: the task's reward the same for
    every sample whatever the shaping adds, or above 0 for every one (``constant_reward``), above 0 for no
    sample (``dead_reward``), a gradient norm of 0 while some rows had an advantage (``zero_gradient``)."""

    patience: int = attrs.field(default=3, validator=at_least(1))
    """Steps in a row a condition must hold for its symptom to start, and be absent for it to clear (a
    held-out drop starts at once)."""
    cut_share: float = attrs.field(default=0.5, validator=in_range(0, 1))
    """``cut_responses``: more than this share of a step's responses cut at ``rollout.max_new_tokens``."""
    no_signal_share: float = attrs.field(default=0.9, validator=in_range(0, 1))
    """``no_signal``: more than this share of groups score alike while most samples fail."""
    entropy_floor: float = attrs.field(default=0.05, validator=at_least(0))
    """``entropy_collapse``: ``actor/entropy`` below this many nats per token."""
    logprob_gap: float = attrs.field(default=0.1, validator=positive)
    """``logprob_drift``: the engine's log-probs more than this many nats per token (mean) from the
    trainer's."""
    grad_norm_factor: float = attrs.field(default=10.0, validator=positive)
    """``grad_norm_high``: a gradient norm over this many times ``actor.grad_clip``."""
    eval_drop: float = attrs.field(default=0.15, validator=in_range(0, 1))
    """``heldout_drop``: held-out accuracy more than this fraction (0.15 is 15 points) below the run's best
    evaluation."""
    guess_reward: float = attrs.field(default=0.25, validator=in_range(0, 1))
    """``guessing``: the task's reward above 0 for at most this share of samples, while most groups score
    alike (``guess_no_signal``) and responses have shrunk to a few tokens (``guess_length``, ``guess_tokens``)."""
    guess_no_signal: float = attrs.field(default=0.75, validator=in_range(0, 1))
    """``guessing``: more than this share of groups score alike (with the task's reward near 0, a random
    group of 4 is alike about half the time: this asks for more)."""
    guess_length: float = attrs.field(default=0.5, validator=in_range(0, 1))
    """``guessing``: the mean response length at most this fraction of its mean over the run's first
    steps (:data:`OPENING_STEPS`)."""
    guess_tokens: float = attrs.field(default=8.0, validator=positive)
    """``guessing``: the mean response length at most this many tokens (a bare answer)."""
    blame_share: float = attrs.field(default=0.1, validator=in_range(0, 1))
    """``dead_reward``, ``guessing``: blame ``reward.fn`` if this share of responses hold their answer, most at 0."""
    stall_steps: int = attrs.field(default=10, validator=at_least(2))
    """``stalled``: the steps averaged, compared with the run's first steps."""
    stall_rise: float = attrs.field(default=0.05, validator=in_range(0, 1))
    """``stalled``: the task's reward above 0 for under this share more of the samples (and under half)."""
    stall_entropy: float = attrs.field(default=0.15, validator=in_range(0, 1))
    """``stalled``: ``actor/entropy`` within this fraction of the first steps' (every panel run that learned
    or collapsed moved it further within ten steps, BENCHMARKS.md)."""
    stall_no_signal: float = attrs.field(default=0.5, validator=in_range(0, 1))
    """``stalled``: under this share of groups alike (the task's reward told samples apart)."""


@attrs.frozen
class Context:
    """What the lines name: the response budget, the gradient clip and the samples file (the run's
    :attr:`~purerl.io.layout.RunLayout.samples`; this module sits below :mod:`purerl.io`, so the caller names it)."""

    max_new_tokens: int = 0
    grad_clip: float = float("inf")
    samples: str = "the run's samples.jsonl"


OPENING_STEPS = 3
"""The run's first steps: ``guessing`` measures a collapse against them, ``stalled`` a stall."""


@attrs.frozen
class HealthState:
    """Per symptom, the steps in a row its condition held (``held``) or did not (``absent``); the
    symptoms active now and every one seen; the best held-out accuracy so far; the mean response length
    of each of the run's first :data:`OPENING_STEPS` steps (``opening``); the task's reward (share of
    samples above 0) and the entropy of each of those steps (``opening_learning``); and the last
    ``stall_steps`` steps' ``(reward, groups alike, entropy)`` (``recent``)."""

    held: Mapping[str, int] = attrs.field(factory=dict)
    absent: Mapping[str, int] = attrs.field(factory=dict)
    active: frozenset[str] = frozenset()
    seen: frozenset[str] = frozenset()
    best_accuracy: float | None = None
    opening: tuple[float, ...] = ()
    opening_learning: tuple[tuple[float, float], ...] = ()
    recent: tuple[tuple[float, float, float], ...] = ()


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


def _has(row: Row, *keys: str) -> bool:
    return all(isinstance(row.get(k), (int, float)) for k in keys)


def _cut(row: Row, limits: HealthLimits, context: Context, past: HealthState) -> bool | None:
    return row["response_length/clip_ratio"] > limits.cut_share if _has(row, "response_length/clip_ratio") else None


def _no_signal(row: Row, limits: HealthLimits, context: Context, past: HealthState) -> bool | None:
    if not _has(row, "health/no_signal_frac", "health/rule_positive_frac"):
        return None
    return 0 < row["health/rule_positive_frac"] < 0.5 and row["health/no_signal_frac"] > limits.no_signal_share


def _constant(row: Row, limits: HealthLimits, context: Context, past: HealthState) -> bool | None:
    """Nothing tells samples apart: the step's rewards all equal, or the task's own reward the same for every
    sample whatever the shaping (``reward.overlong_*``) adds: ``health/rule_spread`` 0 where the row has it,
    else every sample scored above 0. A reward above 0 for no sample is ``dead_reward``'s."""
    if not _has(row, "health/reward_spread", "health/rule_positive_frac"):
        return None
    positive = row["health/rule_positive_frac"]
    rule_alike = row["health/rule_spread"] == 0 if _has(row, "health/rule_spread") else positive == 1
    return positive > 0 and (row["health/reward_spread"] == 0 or rule_alike)


def _dead_reward(row: Row, limits: HealthLimits, context: Context, past: HealthState) -> bool | None:
    return row["health/rule_positive_frac"] == 0 if _has(row, "health/rule_positive_frac") else None


def _guessing(row: Row, limits: HealthLimits, context: Context, past: HealthState) -> bool | None:
    """Bare guesses: the task's reward above 0 for at most ``guess_reward`` of the samples, over
    ``guess_no_signal`` of the groups alike, and the mean response at most ``guess_tokens`` tokens and
    ``guess_length`` of its mean over the run's first steps (None before the first step's length is known)."""
    if not past.opening or not _has(row, "response_length/mean", "health/no_signal_frac", "health/rule_positive_frac"):
        return None
    short = min(limits.guess_tokens, limits.guess_length * _opening_length(past))
    return (row["health/rule_positive_frac"] <= limits.guess_reward
            and row["health/no_signal_frac"] > limits.guess_no_signal and row["response_length/mean"] <= short)


def _stall_window(row: Row, limits: HealthLimits, past: HealthState) -> tuple[float, float, float] | None:
    """The last ``stall_steps`` steps' mean reward, groups alike and entropy (None before as many are known)."""
    now = _learning(row)
    window = (*past.recent, now)[-limits.stall_steps:] if now else ()
    if len(past.opening_learning) < OPENING_STEPS or len(window) < limits.stall_steps:
        return None
    return tuple(sum(step[i] for step in window) / len(window) for i in range(3))


def _learning(row: Row) -> tuple[float, float, float] | None:  # what ``stalled`` reads; None where the row lacks it
    keys = ("health/rule_positive_frac", "health/no_signal_frac", "actor/entropy")
    return tuple(float(row[k]) for k in keys) if _has(row, *keys) else None


def _opening_learning(state: HealthState) -> tuple[float, float]:  # the first steps' reward and entropy
    return tuple(sum(step[i] for step in state.opening_learning) / len(state.opening_learning) for i in range(2))


def _stalled(row: Row, limits: HealthLimits, context: Context, past: HealthState) -> bool | None:
    """Updates too small to learn: the reward flat, its groups telling samples apart, the entropy unmoved."""
    if (window := _stall_window(row, limits, past)) is None:
        return None
    reward, alike, entropy = window
    first_reward, first_entropy = _opening_learning(past)
    return (reward < min(first_reward + limits.stall_rise, 0.5) and alike < limits.stall_no_signal
            and abs(entropy - first_entropy) <= limits.stall_entropy * first_entropy)


def _stalled_line(row: Row, limits: HealthLimits, context: Context, past: HealthState, steps: int) -> str:
    reward, alike, entropy = _stall_window(row, limits, past)
    first_reward, first_entropy = _opening_learning(past)
    return (f"the task rewarded {reward:.0%} of samples over the last {limits.stall_steps} steps ({first_reward:.0%} "
            f"over the first steps) though {1 - alike:.0%} of groups told their samples apart, and the entropy stayed "
            f"at {entropy:.2f} nats per token (from {first_entropy:.2f}), for {steps} steps: the updates are too small "
            f"to move the policy in this run's length; raise actor.lr (--lr), train LoRA at a larger one "
            f"(--lora-rank 32 --lr 5e-4), or run more steps (--steps); read {context.samples}")


def _opening_length(state: HealthState) -> float:
    """The mean response length over the run's first steps (0 before any)."""
    return sum(state.opening) / len(state.opening) if state.opening else 0.0


def _reference_unrewarded(row: Row, limits: HealthLimits) -> bool | None:
    """Whether the samples point at ``reward.fn``: at least ``blame_share`` of the responses contain their
    reference answer and most of those scored 0 or less (None where the row does not say). Fewer is chance:
    a short number of the question echoed (``Raj is 3 years old.``) holds a reference of 3."""
    if not _has(row, "health/reference_held_frac", "health/reference_unrewarded_frac"):
        return None
    return row["health/reference_held_frac"] >= limits.blame_share and row["health/reference_unrewarded_frac"] > 0.5


def _entropy(row: Row, limits: HealthLimits, context: Context, past: HealthState) -> bool | None:
    return row["actor/entropy"] < limits.entropy_floor if _has(row, "actor/entropy") else None


def _drift(row: Row, limits: HealthLimits, context: Context, past: HealthState) -> bool | None:
    return row["rollout/logprob_gap_mean"] > limits.logprob_gap if _has(row, "rollout/logprob_gap_mean") else None


def _grad_norm(row: Row, limits: HealthLimits, context: Context, past: HealthState) -> bool | None:
    if not _has(row, "actor/grad_norm"):
        return None
    return row["actor/grad_norm"] > limits.grad_norm_factor * context.grad_clip


def _zero_gradient(row: Row, limits: HealthLimits, context: Context, past: HealthState) -> bool | None:
    if not _has(row, "actor/grad_norm"):
        return None
    return row["actor/grad_norm"] == 0 and _some_advantage(row)


def _some_advantage(row: Row) -> bool:
    """Whether a row of the step had a nonzero advantage: read from the advantages' extremes where the row
    has them, since a step whose groups are all alike still forwards one row, with advantage 0, to check the
    weight sync (so ``actor/skipped_rows_frac`` is under 1 there and says nothing)."""
    if _has(row, "critic/advantages/max", "critic/advantages/min"):
        return row["critic/advantages/max"] != 0 or row["critic/advantages/min"] != 0
    return row.get("actor/skipped_rows_frac", 0.0) < 1


def _dropped(row: Row, limits: HealthLimits, context: Context, past: HealthState) -> bool | None:
    if not _has(row, "val/accuracy") or past.best_accuracy is None:
        return None
    return past.best_accuracy - row["val/accuracy"] > limits.eval_drop


_HARDER = ("more samples per prompt (rollout.n, --samples-per-prompt), algorithm.dynamic_sampling=true, a supervised "
          "warm-up first (env.sft_steps, where the environment writes demonstrations), or a smaller or easier task")
"""The knobs for a task the model cannot solve yet (its groups all fail alike)."""


def _constant_line(row: Row, limits: HealthLimits, context: Context, past: HealthState, steps: int) -> str:
    if row["health/reward_spread"] == 0:
        seen = "every sample of the step got the same reward"
    elif _has(row, "health/rule_spread"):
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


@attrs.frozen
class Event:
    """Symptom ``symptom`` started (``started``) or cleared at ``step``; ``line`` is what the console shows."""

    step: int
    symptom: str
    started: bool
    line: str


@attrs.frozen
class Monitor:
    """The monitor bound to its limits and to what its lines name."""

    limits: HealthLimits = HealthLimits()
    context: Context = Context()

    def observe(self, state: HealthState, row: Mapping[str, Any]) -> tuple[HealthState, list[Event]]:
        """The state after step ``row["step"]``'s row, and the symptoms that started or cleared there."""
        step = int(row.get("step", 0))
        held, absent, active, events = dict(state.held), dict(state.absent), set(state.active), []
        for name, symptom in SYMPTOMS.items():
            holds = symptom.holds(row, self.limits, self.context, state)
            if holds is None:
                continue
            held[name], absent[name] = (held.get(name, 0) + 1, 0) if holds else (0, absent.get(name, 0) + 1)
            patience = symptom.patience(self.limits)
            if name not in active and held[name] >= patience:
                active.add(name)
                events.append(Event(step, name, True, f"health: step {step}: {name}: "
                                    + symptom.line(row, self.limits, self.context, state, held[name])))
            elif name in active and absent[name] >= patience:
                active.discard(name)
                events.append(Event(step, name, False, f"health: step {step}: {name} cleared"))
        best = state.best_accuracy
        if _has(row, "val/accuracy"):
            best = row["val/accuracy"] if best is None else max(best, row["val/accuracy"])
        opening = state.opening
        if len(opening) < OPENING_STEPS and _has(row, "response_length/mean"):
            opening = (*opening, float(row["response_length/mean"]))
        learning, recent = state.opening_learning, state.recent
        if (step_learning := _learning(row)) is not None:
            if len(learning) < OPENING_STEPS:
                learning = (*learning, (step_learning[0], step_learning[2]))
            recent = (*recent, step_learning)[-(self.limits.stall_steps - 1):]
        return HealthState(held, absent, frozenset(active), state.seen | {e.symptom for e in events if e.started},
                           best, opening, learning, recent), events

    def fold(self, rows: Iterable[Mapping[str, Any]]) -> tuple[HealthState, list[Event]]:
        """The state after ``rows`` (a run's ``metrics.jsonl``, in order) and every event on the way."""
        state, events = HealthState(), []
        for row in rows:
            state, new = self.observe(state, row)
            events.extend(new)
        return state, events


def report(state: HealthState, events: list[Event], mode: str) -> dict[str, Any]:
    """The summary's ``health``: the mode, the symptoms active at the end and every one seen, and each event."""
    return {"mode": mode, "active": sorted(state.active), "seen": sorted(state.seen),
            "events": [attrs.asdict(e) for e in events]}
