"""Shared fixtures for unit and integration tests (tiny models, temp run folders)."""

import os
import shutil
import tempfile

import pytest
import torch

torch.use_deterministic_algorithms(True)
# the GGUF's conversion (purerl.models.gguf_cache) shared by the workers and kept between runs, not in ~/.cache
os.environ.setdefault("PURERL_CACHE", os.path.join(tempfile.gettempdir(), "purerl-test-cache"))


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


_SLOWEST_FIRST = ("test_ray_executor.py", "test_golden.py", "test_faults.py", "test_reliability.py",
                  "test_docs.py", "test_episode_jobs.py", "test_gguf.py", "test_experiment.py")
"""Files that take minutes, in falling order: pytest-xdist hands whole files to its workers in
collection order, so these start first and the short ones fill in around them."""


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(_SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file keeps its order
