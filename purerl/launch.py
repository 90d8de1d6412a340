"""What a job script does first, before its heavy imports (torch, transformers: seconds).

Until the run installs its stop request (:class:`~purerl.loop.recording.StopRequest`), Ctrl-C or
SIGTERM would print a traceback from deep inside an import. Nothing has been written yet, so the
script may simply end: one line, exit status 130. This module imports nothing heavy.
"""

import os
import signal
import sys

__all__ = ["end_quietly_until_started"]


def end_quietly_until_started(prog: str) -> None:
    """From now until the run installs its own handlers, SIGINT and SIGTERM end the process at
    once with one line naming ``prog`` and exit status 130."""

    def end(signum: int, frame: object) -> None:
        print(f"{prog}: stopped while starting ({signal.Signals(signum).name}); nothing was written",
              file=sys.stderr, flush=True)
        os._exit(130)  # no unwinding through a half-finished import

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, end)
