"""The report's curves: inline SVG line charts of metrics over steps, drawn here (no plotting library, nothing
fetched).

A :class:`Chart` names the metrics it draws; :func:`draw_charts` draws each chart that has at least one of them in
the rows and leaves out the rest, so a run gets exactly the curves it has data for. A series is a metric's finite
numeric values by step (a step logged twice keeps its last value; the ``"nan"`` strings a run writes for
non-finite values are gaps); values beyond ±:data:`MAX_DRAWN` (a diverged run's, or a damaged file's) and steps
beyond ±2**53 are left out, the chart's note counting them, so that every coordinate is a finite number. Every
text in the SVG is escaped.
"""

import html
import itertools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import attrs

__all__ = ["CHARTS", "Chart", "draw_charts", "series", "svg_chart"]


@attrs.frozen
class Chart:
    """One chart: its title, the metrics it may draw (each a line, in this order) and a note on what it shows."""

    title: str
    keys: tuple[str, ...]
    note: str = ""


CHARTS = (
    Chart("Train reward", ("critic/score/mean",), "mean task score of each step's samples"),
    Chart("Held-out accuracy", ("val/accuracy", "val/strict_accuracy"),
          "greedy answers to the held-out prompts; step 0 is the evaluation before training"),
    Chart("Response length", ("response_length/mean", "response_length/max"), "tokens"),
    Chart("Cut at the length limit", ("response_length/clip_ratio",),
          "share of responses cut at rollout.max_new_tokens"),
    Chart("Entropy", ("actor/entropy",), "nats per token"),
    Chart("KL", ("actor/ppo_kl", "actor/kl_loss", "actor/reward_kl_penalty", "distill/reverse_kl"),
          "nats per token"),
    Chart("Gradient norm", ("actor/grad_norm", "critic/grad_norm"), "before clipping"),
    Chart("Staleness", ("async/staleness",), "asynchronous runs: weight versions between sampling and training"),
)
"""The curves of a report, in page order."""

WIDTH, HEIGHT = 480, 240
LEFT, RIGHT, TOP, BOTTOM = 58, 12, 12, 44
COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd")
MARKED = 80
"""Series with at most this many points get a marker per point, with its value as a tooltip."""
MAX_DRAWN = 1e300
"""The largest magnitude drawn: any span of two drawn values, and the ticks' round numbers past it, stay finite."""
_MAX_STEP = 2**53


def series(rows: Iterable[Mapping[str, Any]], key: str) -> list[tuple[int, float]]:
    """``key``'s finite numeric values within ±:data:`MAX_DRAWN` by step, sorted by step (the last value of a step
    logged twice)."""
    by_step: dict[int, float] = {}
    for row in rows:
        value, step = row.get(key), row.get("step")
        if _number_in_range(value) and isinstance(step, int) and not isinstance(step, bool) \
                and abs(step) < _MAX_STEP:
            by_step[step] = float(value)
    return sorted(by_step.items())


def _number_in_range(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) \
        and abs(value) <= MAX_DRAWN


def _left_out(rows: Iterable[Mapping[str, Any]], key: str) -> int:
    """How many of ``key``'s finite numbers :func:`series` leaves out as beyond ±:data:`MAX_DRAWN`."""
    return sum(1 for row in rows if isinstance(value := row.get(key), (int, float)) and not isinstance(value, bool)
               and math.isfinite(value) and abs(value) > MAX_DRAWN)


def draw_charts(rows: Sequence[Mapping[str, Any]], charts: Sequence[Chart] = CHARTS) -> list[str]:
    """The ``<figure>`` of each chart that has data in ``rows`` (metrics rows, each with its integer ``step``),
    all on the same span of steps (so that the curves line up)."""
    drawn = [(chart, lines) for chart in charts
             if (lines := {key: points for key in chart.keys if (points := series(rows, key))})]
    steps = [x for _, lines in drawn for points in lines.values() for x, _ in points]
    figures = []
    for chart, lines in drawn:
        left = sum(_left_out(rows, key) for key in chart.keys)
        if left:
            chart = attrs.evolve(chart, note=f"{chart.note}; {left} value{'s' if left > 1 else ''} beyond "
                                             f"±{MAX_DRAWN:g} not drawn".lstrip("; "))
        figures.append(svg_chart(chart, lines, steps=(min(steps), max(steps))))
    return figures


def svg_chart(chart: Chart, lines: Mapping[str, Sequence[tuple[int, float]]],
              steps: tuple[int, int] | None = None) -> str:
    """A ``<figure>`` holding ``chart`` as an inline SVG of ``lines`` (metric -> points by step), its legend
    and note. The x axis spans ``steps`` (default: the data's), the y axis the data (a flat line gets some
    room); ticks are round numbers."""
    xs = [x for points in lines.values() for x, _ in points]
    ys = [y for points in lines.values() for _, y in points]
    x0, x1 = (float(x) for x in steps or (min(xs), max(xs)))
    y0, y1 = min(ys), max(ys)
    if x0 == x1:
        x0, x1 = x0 - 1, x1 + 1
    if y0 == y1:
        pad = abs(y0) * 0.1 or 1.0
        y0, y1 = y0 - pad, y1 + pad
    y_ticks = _ticks(y0, y1, 5)
    y0, y1 = min(y0, y_ticks[0]), max(y1, y_ticks[-1])
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def px(x: int | float) -> float:
        return LEFT + (x - x0) / (x1 - x0) * plot_w

    def py(y: int | float) -> float:
        return TOP + (y1 - y) / (y1 - y0) * plot_h

    parts = [f'<svg viewBox="0 0 {WIDTH} {HEIGHT}" role="img" aria-label="{_esc(chart.title)}">',
             f'<rect x="{LEFT}" y="{TOP}" width="{plot_w}" height="{plot_h}" class="plot"/>']
    for tick in y_ticks:
        parts.append(f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{py(tick):.1f}" y2="{py(tick):.1f}" class="grid"/>'
                     f'<text x="{LEFT - 4}" y="{py(tick) + 4:.1f}" text-anchor="end">{_number(tick)}</text>')
    for tick in _ticks(x0, x1, 6, integers=True):
        parts.append(f'<text x="{px(tick):.1f}" y="{TOP + plot_h + 16}" text-anchor="middle">{_number(tick)}</text>')
    parts.append(f'<text x="{LEFT + plot_w / 2:.1f}" y="{HEIGHT - 6}" text-anchor="middle">step</text>')
    for colour, (key, points) in zip(itertools.cycle(COLOURS), lines.items()):
        coords = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in _thinned(points, px, plot_w))
        parts.append(f'<polyline points="{coords}" stroke="{colour}" class="line"/>')
        if len(points) <= MARKED:
            parts.extend(f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="2.5" fill="{colour}">'
                         f'<title>step {x}: {_esc(key)} {_number(y)}</title></circle>' for x, y in points)
    parts.append("</svg>")
    legend = "".join(f'<span><i style="background:{colour}"></i>{_esc(key)}</span>'
                     for colour, key in zip(itertools.cycle(COLOURS), lines))
    note = f" <small>{_esc(chart.note)}</small>" if chart.note else ""
    return (f'<figure><figcaption><b>{_esc(chart.title)}</b>{note}</figcaption>{"".join(parts)}'
            f'<div class="legend">{legend}</div></figure>')


def _thinned(points: Sequence[tuple[int, float]], px: Callable[[int], float],
             columns: int) -> Sequence[tuple[int, float]]:
    """``points``, or where they outnumber the plot's pixel ``columns`` twice over, the lowest and the highest
    point of each column in step order: the same picture (spikes kept) in a bounded size."""
    if len(points) <= 2 * columns:
        return points
    lows: dict[int, tuple[int, float]] = {}
    highs: dict[int, tuple[int, float]] = {}
    for x, y in points:
        column = int(px(x))
        if column not in lows or y < lows[column][1]:
            lows[column] = (x, y)
        if column not in highs or y > highs[column][1]:
            highs[column] = (x, y)
    return sorted(set(lows.values()) | set(highs.values()))


def _ticks(low: float, high: float, count: int, *, integers: bool = False) -> list[float]:
    """Round tick values (1, 2 or 5 times a power of ten apart) covering ``[low, high]``, about ``count`` of
    them; with ``integers`` only whole numbers, inside the range."""
    raw = (high - low) / max(count - 1, 1)
    magnitude = 10.0 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= raw)
    if integers:
        step = max(1, round(step))
        first = math.ceil(low / step) * step
        return [float(first + i * step) for i in range(int((high - first) // step) + 1)]
    first, last = math.floor(low / step), math.ceil(high / step)
    return [float(round(i * step, 12)) for i in range(first, last + 1)]


def _number(value: int | float) -> str:
    """A tick or tooltip value: integers as such, others to 4 significant digits."""
    return str(int(value)) if float(value).is_integer() and abs(value) < 1e15 else f"{value:.4g}"


def _esc(text: str) -> str:
    return html.escape(str(text), quote=True)
