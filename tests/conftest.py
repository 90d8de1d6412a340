"""Shared fixtures for unit and integration tests (tiny models, temp run folders)."""

import os
import shutil
import tempfile

import pytest
import torch

torch.use_deterministic_algorithms(True)


@pytest.fixture(scope="session")
def ray_cluster():
    """One small local Ray instance for the whole session, or a skip where Ray is not installed.
    Its temp folder is a short one of the system's: Ray's socket paths must stay under 107 bytes,
    which a folder under a deeply nested checkout would exceed."""
    ray = pytest.importorskip("ray")
    os.environ["RAY_AUTH_MODE"] = "disabled"
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    temp = tempfile.mkdtemp(prefix="ray")
    from purerl.executors.ray.pools import start_local_ray

    start_local_ray(6, temp, log_to_driver=False)  # the product's own start: on loopback
    yield ray
    ray.shutdown()
    shutil.rmtree(temp, ignore_errors=True)
