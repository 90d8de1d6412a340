"""Shared fixtures for unit and integration tests (tiny models, temp run folders)."""

import os
import shutil
from pathlib import Path

import pytest
import torch

torch.use_deterministic_algorithms(True)

RAY_TEMP = Path(__file__).resolve().parents[1] / "runs" / "ray"


@pytest.fixture(scope="session")
def ray_cluster():
    """One small local Ray instance for the whole session (temp dir under ``runs/``), or a skip
    where Ray is not installed."""
    ray = pytest.importorskip("ray")
    os.environ["RAY_AUTH_MODE"] = "disabled"
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    temp = RAY_TEMP / f"session-{os.getpid()}"
    temp.mkdir(parents=True, exist_ok=True)
    ray.init(address="local", num_cpus=6, include_dashboard=False, _temp_dir=str(temp), log_to_driver=False)
    yield ray
    ray.shutdown()
    shutil.rmtree(temp, ignore_errors=True)
