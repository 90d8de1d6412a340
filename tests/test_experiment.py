"""experiments/grpo_math.py end to end on a tiny model: outputs, and kill-and-resume."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow  # every test here takes seconds (BENCHMARKS.md: the suite's tiers)

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "experiments" / "grpo_math.py"
TINY = ["--tiny", "--steps", "6", "--prompts-per-step", "2", "--samples-per-prompt", "3", "--max-new-tokens", "6",
        "--eval-size", "4", "--train-size", "40", "--eval-every", "3", "--checkpoint-every", "2",
        "--no-progress", "--threads", "1"]
TIMING = ("timing/", "perf/", "time")


def _run(out_dir, *extra, wait=True):
    cmd = [sys.executable, str(SCRIPT), *TINY, "--out-dir", str(out_dir), *extra]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if wait:
        return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, check=True)
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)


def _metrics(out_dir):
    rows = [json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in rows]


def test_kill_and_resume_continues_with_identical_metrics(tmp_path):
    _run(tmp_path / "full")
    summary = json.loads((tmp_path / "full" / "summary.json").read_text())
    assert summary["steps"] == 6 and 0.0 <= summary["accuracy_after"] <= 1.0
    assert summary["machine"]["kernels"] == torch.backends.cpu.get_cpu_capability()  # what the run computed on
    assert summary["machine"]["threads"] == 1 and summary["machine"]["cpu"]
    assert (tmp_path / "full" / "curve.png").stat().st_size > 1000

    proc = _run(tmp_path / "killed", wait=False)
    checkpoint = tmp_path / "killed" / "checkpoints" / "step_00000004"
    deadline = time.monotonic() + 300
    while not checkpoint.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert checkpoint.exists(), proc.stdout.read().decode() if proc.poll() is not None else "timed out"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc.stdout.close()
    resumed = _run(tmp_path / "killed", "--resume")
    assert "resumed from" in resumed.stdout
    assert _metrics(tmp_path / "killed") == _metrics(tmp_path / "full")


def test_the_main_job_trains_asynchronously_within_its_staleness_bound(tmp_path):
    _run(tmp_path, "--async", "--max-staleness", "1", "--queue-batches", "1")
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["config"]["algorithm"]["rollout_correction"] == "token-tis"
    histogram = summary["async"]["staleness_histogram"]
    assert set(histogram) <= {"0", "1"} and sum(histogram.values()) == 6
    rows = _metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert all(r["async/staleness"] <= 1 and "rollout_corr/is_weight" in r for r in rows)
