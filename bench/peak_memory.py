"""Peak resident memory of one update, measured in a fresh process (shared by the benches).

A bench re-runs its own script with ``--memory NAME``; that process calls :func:`held_and_peak`
and prints its JSON. glibc is told to mmap tensors over 64 KiB (``MALLOC_MMAP_THRESHOLD_``), so
freed tensors go back to the system and the resident set follows the live tensors rather than
what the heap keeps after a free.
"""

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import psutil


def held_and_peak(update: Callable[[], None]) -> dict[str, int]:
    """After one warm-up ``update()`` (optimizer moments touched): the resident set held between
    updates and the high-water mark of the next one (Linux's ``VmHWM``, reset first), in bytes."""
    update()
    held = psutil.Process().memory_info().rss
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM, the peak resident set
    update()
    status = Path("/proc/self/status").read_text()
    peak = int(next(line for line in status.splitlines() if line.startswith("VmHWM:")).split()[1]) * 1024
    return {"held": held, "peak": peak}


def in_fresh_process(script: str, flags: list[str], name: str) -> dict[str, int]:
    """``script flags --memory name`` in a fresh Python process: the JSON its last line prints."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    out = subprocess.run([sys.executable, script, *flags, "--memory", name], capture_output=True, text=True,
                         check=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])
