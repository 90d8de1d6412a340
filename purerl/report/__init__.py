"""A run's report: one self-contained HTML page of a run folder, to read a run without a server.

    python3 -m purerl.report RUN_DIR [-o FILE] [--max-sample-chars N]

writes ``RUN_DIR/report.html`` (or ``FILE``): the run at a glance (state, model, algorithm, executor, held-out
accuracy before and after), the health monitor's lines (:mod:`purerl.health`), the curves the run has data for
(train reward, held-out accuracy, response length, the share cut at the length limit, entropy, KL, gradient norm,
an asynchronous run's staleness: :data:`~purerl.report.charts.CHARTS`), the settings that differ from the
defaults, and the rows of ``samples.jsonl`` (prompt, response, reward, reference) filterable by step, phase and
right or wrong.

A damaged run file costs only what is damaged: the page keeps the rest and says at its top, one line each, what
it left out or cut (a line that is not JSON, a row without an integer step, a section that is not an object, a
summary field of another type). Its size and the memory it takes are bounded whatever the files' size: the samples
are read a line at a time, and the page embeds at most :data:`~purerl.report.run_files.MAX_STEP_ROWS` rows of a
step and phase, :data:`~purerl.report.run_files.MAX_TEXT_CHARS` characters of a text, whole steps within
``--max-sample-chars``.

Invariants: the page fetches nothing (style, SVG curves and script inline; it holds no URL of its own) and escapes
every text of the run; the run folder is only read, except for the default output file, which is replaced whole
(written beside it, then renamed: a reader never sees half a page); a live run is read as it is now (a torn last
line skipped), so the page is a snapshot; a folder that is not a run fails in one line naming the missing file.
Any run writes the same files: synchronous, asynchronous or on Ray (:mod:`purerl.report.run_files`).
"""

import argparse
import os
from pathlib import Path

from purerl.io.layout import RunLayout
from purerl.report.page import MAX_SAMPLE_CHARS, render
from purerl.report.run_files import ReportError, read_run

__all__ = ["ReportError", "main", "parser", "write_report"]


def write_report(run_dir: str | Path, out: str | Path | None = None, *,
                 max_sample_chars: int = MAX_SAMPLE_CHARS) -> Path:
    """Write the report of the run in ``run_dir`` to ``out`` (default ``run_dir/report.html``) and return its
    path; a :class:`ReportError` naming the file for a folder that is not a run or an unreadable run file."""
    files = read_run(run_dir, max_sample_chars=max_sample_chars)
    target = Path(out) if out is not None else RunLayout(files.path).report
    page = render(files, max_sample_chars=max_sample_chars)
    partial = target.with_name(f".{target.name}.partial")
    try:
        partial.write_text(page, encoding="utf-8")
        os.replace(partial, target)
    except OSError as err:
        partial.unlink(missing_ok=True)
        raise ReportError(f"{target}: could not write the report ({err.strerror or err})") from None
    return target


def parser() -> argparse.ArgumentParser:
    """The command line's flags."""
    parser = argparse.ArgumentParser(prog="python3 -m purerl.report", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run's folder (its --out-dir)")
    parser.add_argument("-o", "--output", metavar="FILE", help="where to write the page (default RUN_DIR/report.html)")
    parser.add_argument("--max-sample-chars", type=int, default=MAX_SAMPLE_CHARS,
                        help="characters of the page the samples table may take; over it, the table keeps whole "
                             f"steps spread over the run (default {MAX_SAMPLE_CHARS})")
    return parser


def main(argv: list[str] | None = None) -> int:
    """The command line: exit status 0 and one line naming the page, or 1 and one line naming what is wrong."""
    import sys

    args = parser().parse_args(argv)
    try:
        path = write_report(args.run_dir, args.output, max_sample_chars=args.max_sample_chars)
    except ReportError as err:
        print(f"purerl.report: {err}", file=sys.stderr)
        return 1
    print(f"wrote {path} ({path.stat().st_size / 1e6:.2f} MB)")
    return 0
