"""When a run stops, as a pure rule over its metric rows: the one home of what the recorder
(:class:`~purerl.loop.recording.StepRecorder`) stops a run for, what a replay of it stops at
(:mod:`purerl.replay`), and which flags of a row the report shows (:data:`FLAGS`).

Shaped like the health monitor (:mod:`purerl.health`) and optax's transforms: the limits bound once
(:class:`StopLimits`), a frozen carry (:class:`StopState`), and ``observe(state, step, row) -> (state',
verdict)``. A row is a step's metrics, its reward flags included; the verdict says why the run stops at
that step (:class:`Stop`), or that it goes on, with the lines a run prints on the way (each rejected
update, each step whose reward calls all failed). Effects stay with the callers: the recorder names
checkpoints and raises, a replay raises with its own prefix.

A run stops at step ``k`` when
- the weights it started from (those after step ``k − 1``) give non-finite log-probs
  (``rollout/nonfinite_logprobs``), or the weights after it do on the held-out evaluation
  (``val/nonfinite_logprobs``, :func:`outputs_stop`): they diverged although finite;
- the weight sync check failed (``actor/sync_failed``);
- an update diverged (``<role>/diverged``: non-finite weights or moments, or a norm changed by a huge
  factor, ``<role>/param_norm_change``);
- ``max_rejected_steps`` updates in a row were rejected (``<role>/rejected_updates``), or the reward
  calls of ``max_failed_reward_steps`` steps in a row all failed (``reward/all_failed``).
"""

import math
from collections.abc import Iterable, Mapping
from typing import Any

import attrs

__all__ = ["FLAGS", "Stop", "StopLimits", "StopState", "Verdict", "flagged", "fold", "observe", "outputs_stop"]

FLAGS = ("/diverged", "/rejected_updates", "/sync_failed")
"""The suffixes of a row's metrics that flag an update the rule reads (``actor/diverged``, …)."""

SYNC, DIVERGED, NONFINITE, REJECTED, REWARDS = "sync", "diverged", "nonfinite_outputs", "rejected", "rewards"


@attrs.frozen
class StopLimits:
    """``trainer.max_rejected_steps`` and ``trainer.max_failed_reward_steps``: how many steps in a row may
    have their update rejected, or all their reward calls fail, before the run stops."""

    max_rejected_steps: int = 3
    max_failed_reward_steps: int = 3


@attrs.frozen
class StopState:
    """The carry: the current streaks of rejected updates and of steps whose reward calls all failed."""

    rejected_in_a_row: int = 0
    failed_rewards_in_a_row: int = 0


@attrs.frozen
class Stop:
    """Why a run stops at ``step``: ``kind`` (``sync``, ``diverged``, ``nonfinite_outputs``, ``rejected``,
    ``rewards``), ``reason`` (the clause after ``step k: ``), and ``bad_from``, the first step whose weights
    went bad (the newest good checkpoint is of a step before it; None where the weights are sound: failing
    rewards, a failed sync)."""

    step: int
    kind: str
    reason: str
    bad_from: int | None


@attrs.frozen
class Verdict:
    """What one row tells: the :class:`Stop` (None: the run goes on) and the lines a run prints for it."""

    stop: Stop | None = None
    lines: tuple[str, ...] = ()


def flagged(row: Mapping[str, Any]) -> list[str]:
    """The keys of ``row`` that flag an update (:data:`FLAGS`) with a number above 0 (a row read back from a
    file may hold anything)."""
    return [key for key, value in row.items()
            if key.endswith(FLAGS) and isinstance(value, (int, float)) and value > 0]


def outputs_stop(step: int, row: Mapping[str, Any]) -> Stop | None:
    """The stop for weights that gave non-finite log-probs: those a step started from
    (``rollout/nonfinite_logprobs``, the weights of ``step − 1``), or those an evaluation read
    (``val/nonfinite_logprobs``, the weights of ``step``); None where every log-prob was finite."""
    for key, bad in (("rollout/nonfinite_logprobs", step - 1), ("val/nonfinite_logprobs", step)):
        if row.get(key):
            where = "the rollout of step" if key.startswith("rollout/") else "the held-out evaluation after step"
            return Stop(step, NONFINITE, f"the weights after step {bad} give non-finite log-probs ({int(row[key])} "
                                         f"tokens in {where} {step}): they diverged although finite", bad)
    return None


def observe(limits: StopLimits, state: StopState, step: int, row: Mapping[str, Any]) -> tuple[StopState, Verdict]:
    """Step ``step``'s row read by the rule: the carry after it and the verdict (the module note)."""
    if (stop := outputs_stop(step, row)) is not None:
        return state, Verdict(stop)
    if row.get("actor/sync_failed"):
        tolerance = row.get("actor/sync_tolerance", math.nan)
        return state, Verdict(Stop(step, SYNC, (
            f"weight sync check failed: step {step}'s rollout, sampled by weights version {step - 1}: the engine's "
            f"log-probs differ from the trainer's by {row.get('actor/sync_gap', math.nan):.3g} nats per token on "
            f"average, over the step's ActorLoss(sync_tolerance={tolerance:.3g}) (the main job's executor.sync_canary "
            "sets it): the weights did not arrive intact at the engine"), None))
    diverged = [key for key, value in row.items() if key.endswith("/diverged") and value]
    if diverged:
        changes = {k: v for k, v in row.items() if k.endswith("/param_norm_change")}
        what = ("non-finite weights or optimizer moments" if not changes else "weights of another scale: "
                + ", ".join(f"{k.split('/')[0]}'s norm changed ×{v:.3g} in one step" for k, v in changes.items())
                + " (a learning rate far too large)")
        return state, Verdict(Stop(step, DIVERGED, f"the update left {what} ({', '.join(diverged)})", step))
    lines: list[str] = []
    rejected = [key for key, value in row.items() if key.endswith("/rejected_updates") and value > 0]
    streak = state.rejected_in_a_row + 1 if rejected else 0
    if rejected:
        bad = [key.rsplit("/", 1)[1].removeprefix("nonfinite_") for key, value in row.items()
               if key.rsplit("/", 1)[-1].startswith("nonfinite_") and value > 0]
        why = f"non-finite {' and '.join(bad) or 'values'}"
        lines.append(f"step {step}: update rejected ({', '.join(rejected)}): {why} ({streak} in a row)")
        if streak >= limits.max_rejected_steps:
            return StopState(streak, state.failed_rewards_in_a_row), Verdict(Stop(step, REJECTED, (
                f"{streak} steps in a row had their update rejected ({why}: trainer.max_rejected_steps "
                f"{limits.max_rejected_steps})"), step), tuple(lines))
    failed = state.failed_rewards_in_a_row + 1 if row.get("reward/all_failed") else 0
    if failed:
        lines.append(f"step {step}: warning: every reward call failed or timed out ({failed} step(s) in a row)")
    carried = StopState(streak, failed)
    if failed >= limits.max_failed_reward_steps:
        return carried, Verdict(Stop(step, REWARDS, (
            f"every reward call failed or timed out in {failed} steps in a row (trainer.max_failed_reward_steps "
            f"{limits.max_failed_reward_steps})"), None), tuple(lines))
    return carried, Verdict(None, tuple(lines))


def fold(limits: StopLimits, rows: Iterable[Mapping[str, Any]], state: StopState = StopState()) -> StopState:  # noqa: B008
    """The carry after ``rows`` (each with its ``step``): where a resumed run or a replay from step ``k`` starts."""
    for row in rows:
        state = observe(limits, state, row["step"], row)[0]
    return state
