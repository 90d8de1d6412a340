"""The code stays lint-clean: ruff, with pyproject.toml's selection and line length, passes on purerl/."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_passes_on_the_package():
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "purerl"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, f"ruff check purerl failed (exit {done.returncode}):\n{done.stdout}{done.stderr}"
