"""A job's command line, end to end: parse (:mod:`purerl.config.command_line`), run
(:func:`purerl.run.run`), plot ``curve.png``; user errors end it with one line naming the script.
The experiment scripts (``experiments/*.py``) are this, with their defaults and titles."""

import math
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from purerl.config.command_line import parse_command_line
from purerl.config.job import JobConfig

__all__ = ["main", "plot_curve"]


def plot_curve(run_dir: Path, records: list[dict], before: float | None, after: float, title: str,
               before_warm_up: float | None = None) -> Path:
    """``curve.png``: the training reward per step and the held-out greedy accuracy (and, after an
    SFT warm-up, the accuracy before it, at step 0)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from purerl.io.layout import RunLayout

    steps = [r["step"] for r in records]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, [r.get("critic/score/mean", math.nan) for r in records], label="train reward (mean)")
    evals = [(0, before)] * (before is not None) + [(r["step"], r["val/accuracy"]) for r in records
                                                    if "val/accuracy" in r]
    if not records or "val/accuracy" not in records[-1]:
        evals.append((records[-1]["step"] if records else 0, after))
    ax.plot(*zip(*evals), "o-", label="held-out greedy accuracy")
    if before_warm_up is not None:
        ax.plot([0], [before_warm_up], "kx", markersize=9, label="held-out accuracy before the SFT warm-up")
    ax.set_xlabel("step")
    ax.set_ylim(-0.02, max(1.12, max(v for _, v in evals) + 0.05))
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    path = RunLayout(run_dir).curve
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: Sequence[str] | None, *, prog: str, description: str | None, default_out_dir: str,
         title: Callable[[JobConfig], str], defaults: Sequence[str] = ()) -> dict:
    """The job; user errors end it with one line (``--debug``: a traceback) and exit status 1, a
    stop request (Ctrl-C, SIGTERM) after the step in flight, checkpointed, with exit status 130.
    ``defaults``: ``--config`` files applied before the command line's own."""
    argv = sys.argv[1:] if argv is None else list(argv)
    inv = parse_command_line([*(a for path in defaults for a in ("--config", path)), *argv], prog=prog,
                             description=description, default_out_dir=default_out_dir)
    # the run's machinery (torch, the model) loads once the command line is read: --help and its errors need none
    from purerl.data.records import DataError
    from purerl.executors.base import ExecutorError
    from purerl.io.checkpoint import CheckpointError
    from purerl.io.layout import RunLayout
    from purerl.io.run_folder import RunFolderError
    from purerl.loop.recording import Interrupted, StopRequest, TrainingStopped
    from purerl.rollout.canary import CanaryError
    from purerl.run import run

    try:
        with StopRequest() as stop:
            summary = run(inv.config, inv.out_dir, resume=inv.resume, overwrite=inv.overwrite, stop=stop.event)
        signal.signal(signal.SIGINT, signal.default_int_handler)  # what launch's early handlers did is over
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    except Interrupted as e:
        how = "rerun the same command with --resume" if e.checkpoint else "nothing was trained; rerun to start"
        print(f"{prog}: {e}; {how}", file=sys.stderr, flush=True)
        raise SystemExit(130) from None
    except KeyboardInterrupt:  # a second Ctrl-C: stopped at once, in the middle of a step
        if inv.debug:
            raise
        print(f"{prog}: stopped at once (a second interrupt); the newest checkpoint in {inv.out_dir} resumes with "
              "--resume", file=sys.stderr, flush=True)
        raise SystemExit(130) from None
    except (ExecutorError, CanaryError, DataError, RunFolderError, CheckpointError, TrainingStopped, OSError,
            ValueError) as e:
        if inv.debug:
            raise
        raise SystemExit(f"{prog}: {e} (--debug: the traceback)") from None
    run_dir = Path(inv.out_dir)
    curve = plot_curve(run_dir, summary.pop("records"), summary["accuracy_before"], summary["accuracy_after"],
                       title(inv.config), summary.get("sft", {}).get("accuracy_before_sft"))
    adapter = f", {summary['adapter']} (the LoRA adapter: peft's PeftModel.from_pretrained loads it)" \
        if "adapter" in summary else ""
    print(f"wrote {RunLayout(run_dir).summary}, {curve}, {summary['export']} (from_pretrained loads it){adapter}",
          flush=True)
    return summary
