"""Two runs' or replays' metrics, step by step: what ``python3 -m purerl.replay --compare A B``
prints and plots (a run folder, a replay folder or a ``metrics.jsonl`` each), and how a metric reads
back from ``metrics.jsonl`` (:meth:`~purerl.io.metrics.MetricsLog.write` writes a non-finite one as
its text)."""

import math
from pathlib import Path
from typing import Any

from purerl.io.layout import RunLayout
from purerl.io.metrics import MetricsLog

__all__ = ["HEADLINE", "CompareError", "as_written", "compare", "numeric"]


class CompareError(RuntimeError):
    """A file that is not a run's metrics, or a plot that cannot be written; the message is one line."""


def as_written(value: Any) -> Any:
    """A metric as :meth:`~purerl.io.metrics.MetricsLog.write` writes it: a finite number, else its text."""
    return value if isinstance(value, (int, float)) and math.isfinite(value) else str(value)


def numeric(value: Any) -> float | None:
    """A metric read back from ``metrics.jsonl`` as a number (its ``"nan"``, ``"inf"`` too); None for others."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        return None
    try:
        return float(value)
    except ValueError:
        return None



HEADLINE = ("critic/score/mean", "critic/advantages/max", "actor/pg_loss", "actor/grad_norm", "actor/ppo_kl",
            "actor/entropy")
"""The metrics :func:`compare` prints and plots by default."""


def compare(a: str | Path, b: str | Path, *, keys: tuple[str, ...] = HEADLINE, plot: str | Path | None = None,
            out: Any = print) -> dict[int, dict[str, tuple[float, float]]]:
    """Per step, ``keys``' values in two runs or replays (a folder holding ``metrics.jsonl``, or the
    file): ``{step: {key: (a, b)}}`` over the steps both recorded, printed as differences; ``plot``:
    one figure of the keys over the steps, both lines in each panel."""
    rows = [_rows_by_step(_metrics_file(x)) for x in (a, b)]
    steps = sorted(set(rows[0]) & set(rows[1]))
    table = {step: {k: (x, y) for k in keys if (x := numeric(rows[0][step].get(k))) is not None
                    and (y := numeric(rows[1][step].get(k))) is not None} for step in steps}
    for step in steps:
        out(f"step {step}: " + "; ".join(f"{k} {x:.4g} -> {y:.4g} ({y - x:+.3g})" for k, (x, y) in table[step].items()))
    if plot is not None:
        try:
            _plot(table, keys, (str(a), str(b)), Path(plot))
        except (OSError, ValueError) as err:  # a folder that is not there, a format matplotlib does not write
            raise CompareError(f"replay --compare: could not write the plot {plot} "
                              f"({getattr(err, 'strerror', None) or err})") from None
        out(f"wrote {plot}")
    return table


def _rows_by_step(path: Path) -> dict[int, dict[str, Any]]:
    """The rows of a ``metrics.jsonl`` by their step, or a one-line :class:`CompareError` naming the file."""
    try:
        rows = MetricsLog.read(path)
    except (OSError, ValueError) as err:
        raise CompareError(f"replay --compare: {err if str(path) in str(err) else f'{path}: {err}'}") from None
    bad = next((n for n, row in enumerate(rows, 1) if not isinstance(row, dict) or isinstance(row.get("step"), bool)
                or not isinstance(row.get("step"), int)), None)
    if bad is not None:
        raise CompareError(f"replay --compare: {path}: record {bad} has no integer step (not a run's metrics.jsonl)")
    return {row["step"]: row for row in rows}


def _metrics_file(path: str | Path) -> Path:
    path = Path(path)
    found = RunLayout(path).metrics if path.is_dir() else path
    if not found.exists():
        raise CompareError(f"replay --compare: {found} does not exist "
                          "(give a run or replay folder, or its metrics.jsonl)")
    return found


def _plot(table: dict[int, dict[str, tuple[float, float]]], keys: tuple[str, ...], names: tuple[str, str],
          path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [k for k in keys if any(k in row for row in table.values())]
    fig, axes = plt.subplots(1, len(shown), figsize=(3.2 * len(shown), 2.8), squeeze=False)
    for ax, key in zip(axes[0], shown):
        steps = [s for s, row in table.items() if key in row]
        for side, name in enumerate(names):
            ax.plot(steps, [table[s][key][side] for s in steps], marker=".", label=Path(name).name or name)
        ax.set_title(key, fontsize=9)
        ax.set_xlabel("step")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
