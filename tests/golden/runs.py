"""The golden runs: every recipe of ``examples/``, synchronous and asynchronous (staleness 1), on
the local executor and on Ray (2 FSDP2 ranks), 3 steps on the tiny model. ``metrics.json`` holds
what each run recorded: every metric of every step (timings and the queue's racy gauges left
out), the summary's accuracies and asynchronous report, and a digest of the exported weights.

The runs compare every float bit for bit, so they run where the numerics do not depend on the CPU
(:data:`PINS`, set before torch loads): one thread, ATen's kernels at AVX2, MKL's reproducible
SSE2 branch (the one MKL keeps equal on Intel and AMD processors; its AVX2 branch falls back to
ISA-based dispatch on AMD), oneDNN capped at AVX2. The tests get them from a :class:`PinnedRuns`
process; recording re-executes itself under the pins.

Record (only when behaviour changes on purpose, saying why): ``python3 -m tests.golden.runs``."""

import contextlib
import hashlib
import io
import json
import os
import runpy
import shutil
import subprocess
import sys
import tempfile
import tomllib
import traceback
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).with_name("metrics.json")
RECIPES = sorted(p.name for p in (ROOT / "examples").iterdir() if p.suffix in (".toml", ".yaml"))
MODES = {"sync": [], "async": ["--async", "--max-staleness", "1"]}
# the Ray runs wait up to 900 s for their workers to start (not 300): a loaded 2-core box running the suite
# has taken longer; a wait, not a timing, and no part of what a golden run records
EXECUTORS = {"local": [], "ray": ["--executor", "ray", "--train-ranks", "2", "--rollout-workers", "1",
                                  "executor.start_timeout=900"]}
COMMON = ["--tiny", "--steps", "3", "--prompts-per-step", "2", "--max-new-tokens", "16", "--eval-size", "4",
          "--train-size", "40", "--eval-every", "3", "--warmup-steps", "0", "--checkpoint-every", "0", "--no-progress", "--threads", "1",
          f"reward.fn={Path(__file__).with_name('reward.py')}:digit_fraction"]
SKIPPED = ("timing/", "perf/", "time", "async/queue_depth", "async/trainer_wait_s", "async/trainer_idle_frac",
           "async/generator_idle_frac", "health/", "actor/sync_gap")
"""Keys that measure time or depend on thread timing, not on what was computed; and diagnostics recorded
after these runs were: the health monitor's (``health/*``, read from the step's batch and metrics;
``tests/test_health.py`` checks them) and the weight-sync check's gap (``actor/sync_gap``;
``tests/test_canary.py``)."""
PINS = {
    "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "MKL_DYNAMIC": "FALSE", "OMP_DYNAMIC": "FALSE",
    "ATEN_CPU_CAPABILITY": "avx2",
    "MKL_CBWR": "COMPATIBLE",
    "ONEDNN_MAX_CPU_ISA": "AVX2", "DNNL_MAX_CPU_ISA": "AVX2",
}
"""The environment under which the golden numbers hold on any x86-64 CPU with AVX2: whatever the
host sets for these is replaced (Ray's workers inherit it from the process that starts Ray)."""
SUMMARY = ("steps", "accuracy_before", "accuracy_after", "strict_accuracy_after", "async")


def run_names() -> list[str]:
    return [f"{recipe}/{mode}/{executor}" for recipe in RECIPES for mode in MODES for executor in EXECUTORS]


def argv_of(name: str, out_dir: Path) -> list[str]:
    recipe, mode, executor = name.split("/")
    return ["--config", str(ROOT / "examples" / recipe), *COMMON, *_shaping(recipe), *MODES[mode],
            *EXECUTORS[executor], "--out-dir", str(out_dir)]


def _shaping(recipe: str) -> list[str]:
    """A recipe that names no overlong buffer runs without one, as recorded before the buffer became a
    default (a third of the budget): these runs pin their reward as they pin ``reward.fn``; the shaping's
    maths stays pinned by ``dapo.toml``, which names its buffer."""
    from purerl.config.loading import load_file

    named = "overlong_buffer" in load_file(ROOT / "examples" / recipe).get("reward", {})
    return [] if named else ["reward.overlong_buffer=0"]


def _digest(path: Path) -> str:
    from safetensors.torch import load_file

    tensors = load_file(path)
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def outcome(out_dir: Path) -> dict:
    """What a finished run recorded, in the form ``metrics.json`` keeps."""
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    metrics = [{k: v for k, v in row.items() if not k.startswith(SKIPPED)} for row in rows]
    result = {"metrics": metrics}
    if (out_dir / "summary.json").exists():
        summary = json.loads((out_dir / "summary.json").read_text())
        result["summary"] = {k: summary[k] for k in SUMMARY if k in summary}
    export = out_dir / "export" / "model.safetensors"
    if export.exists():
        result["export_sha256"] = _digest(export)
    return result


@contextlib.contextmanager
def _threads() -> None:
    before = torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads(before)


def run(name: str) -> dict:
    """Run the golden run ``name`` in this process; what it recorded."""
    with tempfile.TemporaryDirectory() as tmp, _threads():
        out = Path(tmp) / "run"
        argv = argv_of(name, out)
        if name.startswith("distill.toml/"):  # its teacher: a tiny one, made here (tests.jobs.tiny_teacher)
            from tests.jobs import tiny_teacher

            argv.append(f"distill.teacher={tiny_teacher(Path(tmp) / 'teacher')}")
        job(argv)
        return outcome(out)


def run_custom_step() -> dict:
    """``examples/custom_step.py`` as written (it trains into ``runs/custom_step`` of its folder of work)."""
    with tempfile.TemporaryDirectory() as tmp, _threads(), contextlib.chdir(tmp), \
            contextlib.redirect_stdout(io.StringIO()):
        runpy.run_path(str(ROOT / "examples" / "custom_step.py"), run_name="__main__")
        return outcome(Path(tmp) / "runs" / "custom_step")


def job(argv: list[str]) -> None:
    """The job's command line, run in this process (as ``experiments/grpo_math.py`` runs it, but the plot)."""
    from purerl.config.command_line import parse_command_line
    from purerl.run import run

    inv = parse_command_line(argv, prog="golden", default_out_dir="")
    run(inv.config, inv.out_dir)


def pinned() -> bool:
    """Whether this process runs under :data:`PINS`."""
    return all(os.environ.get(k) == v for k, v in PINS.items())


def _start_ray() -> str:
    """A Ray instance of this process's own (its workers inherit the pinned environment); its temp
    folder (removed by :func:`_stop_ray`)."""
    from purerl.executors.ray.pools import start_local_ray

    os.environ["RAY_AUTH_MODE"] = "disabled"
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    temp = tempfile.mkdtemp(prefix="ray")
    start_local_ray(6, temp, log_to_driver=False)
    return temp


def _stop_ray(temp: str) -> None:
    import ray

    ray.shutdown()
    shutil.rmtree(temp, ignore_errors=True)


def _as_under_pytest() -> None:
    """The suite's settings (tests/conftest.py, pyproject's pytest options) in a process of its own:
    deterministic algorithms, purerl's annotations checked, the same warnings made errors."""
    from jaxtyping import install_import_hook

    install_import_hook("purerl", "beartype.beartype")
    torch.use_deterministic_algorithms(True)
    options = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    for rule in reversed(options["filterwarnings"]):
        action, message, category, module = (rule.split(":", 3) + ["", "", ""])[:4]
        where, _, cls = category.rpartition(".")
        kind = getattr(__import__(where or "builtins", fromlist=[cls]), cls) if cls else Warning
        warnings.filterwarnings(action, message, kind, module)


def record(names: list[str] | None = None) -> dict:
    """The golden runs ``names`` (default: all, and ``custom_step.py``), on a Ray instance of their own
    (this process must run under :data:`PINS`)."""
    assert pinned(), "the golden runs are recorded under PINS (python3 -m tests.golden.runs sets them)"
    torch.use_deterministic_algorithms(True)  # as under pytest (tests/conftest.py)
    temp = _start_ray()
    try:
        golden = {name: run(name) for name in names or run_names()}
    finally:
        _stop_ray(temp)
    if names is None:
        golden["custom_step.py"] = run_custom_step()
    return golden


class PinnedRuns:
    """A process under :data:`PINS` that runs golden runs on request (``runs(name)``, or
    ``"custom_step.py"``) and returns what they recorded; it starts Ray the first time a run needs it.
    Requests go in on its stdin, answers come back as one JSON line each on a pipe of their own
    (what the runs print goes to the process's stdout and stderr, untouched)."""

    def __init__(self) -> None:
        read, write = os.pipe()
        self._process = subprocess.Popen(
            [sys.executable, "-m", "tests.golden.runs", "--serve", str(write)], cwd=ROOT,
            env={**os.environ, **PINS}, stdin=subprocess.PIPE, text=True, pass_fds=(write,))
        os.close(write)
        self._answers = os.fdopen(read)

    def __call__(self, name: str) -> dict:
        self._process.stdin.write(name + "\n")
        self._process.stdin.flush()
        line = self._answers.readline()
        if not line:
            raise RuntimeError(f"{name}: the pinned golden process ended (exit code {self._process.wait()})")
        answer = json.loads(line)
        if "error" in answer:
            raise RuntimeError(f"{name} failed in the pinned golden process:\n{answer['error']}")
        return answer["outcome"]

    def close(self) -> None:
        self._process.stdin.close()
        self._process.wait(timeout=120)
        self._answers.close()


def _serve(fd: int) -> None:
    """:class:`PinnedRuns`' far side: a run name per line on stdin, its outcome (or error) on ``fd``."""
    _as_under_pytest()
    answers = os.fdopen(fd, "w")
    temp = None
    try:
        for line in sys.stdin:
            name = line.strip()
            try:
                if name.endswith("/ray") and temp is None:
                    temp = _start_ray()
                answer = {"outcome": run_custom_step() if name == "custom_step.py" else run(name)}
            except Exception:  # the test reports it; this process serves the next run
                answer = {"error": traceback.format_exc()}
            answers.write(json.dumps(answer) + "\n")
            answers.flush()
    finally:
        answers.close()
        if temp is not None:
            _stop_ray(temp)


def differences(name: str, got: dict) -> list[str]:
    """The metrics (``key@step``) and parts of ``got`` that differ from the recorded run ``name``."""
    want = json.loads(GOLDEN.read_text())[name]
    moved = [f"{k}@{w['step']}" for g, w in zip(got["metrics"], want["metrics"]) for k in set(g) | set(w)
             if g.get(k) != w.get(k)]
    return sorted(moved) + [part for part in ("summary", "export_sha256") if got.get(part) != want.get(part)]


if __name__ == "__main__":
    if sys.argv[1:2] == ["--unpinned"]:  # the local runs named after it as the host's environment computes them
        torch.use_deterministic_algorithms(True)
        for name in sys.argv[2:]:
            moved = differences(name, run(name))
            print(f"{name}: {'as recorded' if not moved else f'{len(moved)} numbers differ, e.g. {moved[:3]}'}")
        sys.exit(0)
    if not pinned():  # before torch does anything: re-execute under the pins
        os.execve(sys.executable, [sys.executable, "-m", "tests.golden.runs", *sys.argv[1:]], {**os.environ, **PINS})
    if sys.argv[1:2] == ["--serve"]:
        _serve(int(sys.argv[2]))
    elif sys.argv[1:2] == ["--print"]:  # the runs named after it, as JSON on the last line of stdout
        print(json.dumps(record(sys.argv[2:])))
    else:
        GOLDEN.write_text(json.dumps(record(), indent=1) + "\n")
        print(f"wrote {GOLDEN}")
