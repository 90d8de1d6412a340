"""The run-health monitor: the symptoms of a run going wrong, read from each step's metrics row.

Pure: :meth:`Monitor.observe` takes the monitor's :class:`HealthState` and one row of
``metrics.jsonl`` (what the step and, every ``trainer.eval_every`` steps, its evaluation reported)
and returns the next state and the :class:`Event` of each symptom that started or cleared at that
step. A symptom starts when its condition has held for ``patience`` steps in a row, and clears
when it has not held for as many (held-out accuracy: at the next evaluation). The loops print each
event's line, write ``health/<symptom>`` (1 started, 0 cleared) into that step's row, and the
summary folds the rows again (:meth:`Monitor.fold`), so a resumed run reports its whole history.

Rooms: :mod:`~purerl.health.limits` (when a symptom is reported, what its lines name),
:mod:`~purerl.health.state` (the carry from row to row: typed records, no positional tuples),
:mod:`~purerl.health.symptoms` (each symptom: its signal, condition and line), :mod:`~purerl.health.monitor`
(the monitor, its events, the summary's report).
"""

from purerl.health.limits import OPENING_STEPS, Context, HealthLimits
from purerl.health.monitor import Event, HealthState, Learning, Monitor, report
from purerl.health.symptoms import SYMPTOMS, Symptom

__all__ = ["OPENING_STEPS", "SYMPTOMS", "Context", "Event", "HealthLimits", "HealthState", "Learning", "Monitor",
           "Symptom", "report"]
