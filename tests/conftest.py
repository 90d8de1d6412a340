"""Shared fixtures for unit and integration tests (tiny models, temp run folders)."""

import os
import shutil
import tempfile

# One torch thread in each process the suite starts (set before torch loads, inherited by the jobs and Ray
# workers it starts): pytest-xdist runs one worker per core, and workers each spinning a team of OpenMP
# threads over the same cores ran the suite 13 % slower (BENCHMARKS.md). A thread count the user set stays.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("MPLBACKEND", "Agg")  # plots to files only, in every process of the suite

import pytest  # noqa: E402
import torch  # noqa: E402

torch.use_deterministic_algorithms(True)
# the GGUF's conversion (purerl.models.gguf_cache) shared by the workers and kept between runs, not in ~/.cache
os.environ.setdefault("PURERL_CACHE", os.path.join(tempfile.gettempdir(), "purerl-test-cache"))


@pytest.fixture(scope="session")
def tiny_lm():
    """The tests' tiny model: ``tiny_lm(config=None, *, seed=0, dtype=…, device=…, activation_checkpointing=…,
    **overrides)`` gives a new random ``(model, params)``, by default of the tiny Llama with ``overrides``
    (:func:`purerl.tiny.tiny_causal_lm`; test helpers outside a test call that directly)."""
    from purerl.tiny import tiny_causal_lm

    return tiny_causal_lm


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


_SLOWEST_FIRST = ("test_ray_executor.py", "test_bench_scripts.py", "test_ray_worker_loss.py", "test_golden.py",
                  "test_family_exactness.py", "test_reliability.py", "test_policy_loss.py", "test_advantages.py",
                  "test_docs.py", "test_distill.py", "test_agents.py", "test_correction.py", "test_episode_jobs.py",
                  "test_gguf.py", "test_replay.py", "test_browser.py", "test_fused_head_memory.py",
                  "test_routing_replay.py", "test_experiment.py", "test_gemma3_270m.py", "test_lora.py",
                  "test_mixed_precision.py", "test_faults.py", "test_cold_start.py")
"""Files that take longest, in falling order (a 2-core Zen 4, 2026-12-07, BENCHMARKS.md): pytest-xdist hands
whole files to its workers in collection order (``--no-loadscope-reorder`` in pyproject.toml: its own order is
by number of tests), so these start first and the short ones fill in around them."""


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(_SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file keeps its order
