"""The golden runs: every recipe of ``examples/``, synchronous and asynchronous (staleness 1), on
the local executor and on Ray (2 FSDP2 ranks), 3 steps on the tiny model. ``metrics.json`` holds
what each run recorded: every metric of every step (timings and the queue's racy gauges left
out), the summary's accuracies and asynchronous report, and a digest of the exported weights.

Record (only when behaviour changes on purpose, saying why): ``python3 -m tests.golden.runs``."""

import contextlib
import hashlib
import io
import json
import os
import runpy
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).with_name("metrics.json")
RECIPES = sorted(p.name for p in (ROOT / "examples").iterdir() if p.suffix in (".toml", ".yaml"))
MODES = {"sync": [], "async": ["--async", "--max-staleness", "1"]}
EXECUTORS = {"local": [], "ray": ["--executor", "ray", "--train-ranks", "2", "--rollout-workers", "1"]}
COMMON = ["--tiny", "--steps", "3", "--prompts-per-step", "2", "--max-new-tokens", "16", "--eval-size", "4",
          "--train-size", "40", "--eval-every", "3", "--warmup-steps", "0", "--checkpoint-every", "0", "--no-progress", "--threads", "1",
          f"reward.fn={Path(__file__).with_name('reward.py')}:digit_fraction"]
SKIPPED = ("timing/", "perf/", "time", "async/queue_depth", "async/trainer_wait_s", "async/trainer_idle_frac",
           "async/generator_idle_frac")
"""Keys that measure time or depend on thread timing, not on what was computed."""
SUMMARY = ("steps", "accuracy_before", "accuracy_after", "strict_accuracy_after", "async")


def run_names() -> list[str]:
    return [f"{recipe}/{mode}/{executor}" for recipe in RECIPES for mode in MODES for executor in EXECUTORS]


def argv_of(name: str, out_dir: Path) -> list[str]:
    recipe, mode, executor = name.split("/")
    return ["--config", str(ROOT / "examples" / recipe), *COMMON, *MODES[mode], *EXECUTORS[executor],
            "--out-dir", str(out_dir)]


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
        job(argv_of(name, out))
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


def record(names: list[str] | None = None) -> dict:
    """The golden runs ``names`` (default: all, and ``custom_step.py``), on a Ray instance of their own."""
    import ray

    torch.use_deterministic_algorithms(True)  # as under pytest (tests/conftest.py)
    os.environ["RAY_AUTH_MODE"] = "disabled"
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    temp = tempfile.mkdtemp(prefix="ray")
    ray.init(address="local", num_cpus=6, include_dashboard=False, _temp_dir=temp, log_to_driver=False)
    try:
        golden = {name: run(name) for name in names or run_names()}
    finally:
        ray.shutdown()
    if names is None:
        golden["custom_step.py"] = run_custom_step()
    return golden


if __name__ == "__main__":
    if sys.argv[1:2] == ["--print"]:  # the runs named after it, as JSON on the last line of stdout
        print(json.dumps(record(sys.argv[2:])))
    else:
        GOLDEN.write_text(json.dumps(record(), indent=1) + "\n")
        print(f"wrote {GOLDEN}")
