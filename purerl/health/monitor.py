"""The health monitor bound to its limits (:class:`Monitor`): each row observed, the events of the symptoms
that started or cleared, and the summary's report."""

from collections.abc import Iterable, Mapping
from typing import Any

import attrs

from purerl.health.limits import OPENING_STEPS, Context, HealthLimits
from purerl.health.state import HealthState, Learning
from purerl.health.symptoms import SYMPTOMS, has, learning_of

__all__ = ["Event", "HealthState", "Learning", "Monitor", "report"]


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
        if has(row, "val/accuracy"):
            best = row["val/accuracy"] if best is None else max(best, row["val/accuracy"])
        opening = state.opening
        if len(opening) < OPENING_STEPS and has(row, "response_length/mean"):
            opening = (*opening, float(row["response_length/mean"]))
        learning, recent = state.opening_learning, state.recent
        if (step_learning := learning_of(row)) is not None:
            if len(learning) < OPENING_STEPS:
                learning = (*learning, step_learning)
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
