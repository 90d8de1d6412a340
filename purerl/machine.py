"""What a run computed on, as its ``summary.json`` records it (``machine``).

A run's numbers depend on the kernels its arithmetic ran through as well as on its seed: the same
seed of the main job samples other responses on a CPU whose ATen kernels are AVX2 than on one whose
are AVX-512, since the sums round differently and sampling carries the difference on (BENCHMARKS.md,
"Learns on every seed", the twelfth session: seed 8 gained +43.8 on an Intel Xeon, +37.5 on an AMD
EPYC). A result that names its machine can be compared with another, or reproduced, knowingly.
Recorded by the process that writes the summary: with the Ray executor, the driver's machine.
"""

import platform
from pathlib import Path
from typing import Any

import torch

__all__ = ["describe", "device_problem", "machine"]


def machine() -> dict[str, Any]:
    """``cpu`` (model name, family and model), ``kernels`` (the instruction set ATen dispatches to:
    ``AVX2``, ``AVX512``, … as ``ATEN_CPU_CAPABILITY`` leaves it), ``threads``, ``torch`` and
    ``accelerator`` (the name of the CUDA device present, used or not; None without one)."""
    return {"cpu": _cpu(), "kernels": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "accelerator": torch.cuda.get_device_name() if torch.cuda.is_available() else None}


def device_problem(name: str) -> str | None:
    """Why this process cannot compute on the torch device ``name`` (cpu, cuda, cuda:N, mps), in one
    line naming the cause and the way out; None when it can."""
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        return "not a device name (cpu, cuda, cuda:N or mps)"
    if device.type == "cuda":
        if not torch.cuda.is_available():
            why = "it is built without CUDA" if torch.version.cuda is None else "it sees no CUDA GPU"
            return f"CUDA is not available to this torch ({why}); use cpu"
        if device.index is not None and device.index >= torch.cuda.device_count():
            return f"this torch sees {torch.cuda.device_count()} CUDA device(s), numbered from 0"
    elif device.type == "mps":
        if not torch.backends.mps.is_available():
            return "MPS is not available to this torch; use cpu"
    elif device.type != "cpu":
        return "cpu, cuda, cuda:N or mps are served"
    return None


def describe(recorded: Any) -> str | None:
    """One line for a recorded :func:`machine` (None for a run from before runs recorded one). The threads
    are part of it: a sum split over another number of threads rounds differently too."""
    if not isinstance(recorded, dict) or not recorded.get("cpu"):
        return None
    threads = recorded.get("threads")
    line = f"{recorded['cpu']}, ATen {recorded.get('kernels')}" + (
        f", {threads} thread{'s' if threads != 1 else ''}" if isinstance(threads, int) else "")
    return line + (f", {recorded['accelerator']}" if recorded.get("accelerator") else "")


def _cpu() -> str:
    """``model name (family F, model M)`` from ``/proc/cpuinfo``; elsewhere what :mod:`platform` says."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    name = fields.get("model name") or platform.processor() or platform.machine()
    if "cpu family" in fields and "model" in fields:
        return f"{name} (family {fields['cpu family']}, model {fields['model']})"
    return name
