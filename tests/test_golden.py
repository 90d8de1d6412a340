"""Golden metrics: every recipe, synchronous and asynchronous, on the local executor and on Ray,
reproduces the numbers recorded in ``tests/golden/metrics.json`` exactly (CPU, fixed seeds).

On Ray each recipe runs in one of the two modes, alternating over the recipes (so each mode runs
on Ray for half of them; ``python3 -m tests.golden.runs`` records all four): the suite's time goes
to a recipe's maths locally in both modes, and asynchronous training on Ray with staleness 0 is
pinned to the synchronous trainer bit for bit in ``tests/test_ray_executor.py``.

The runs happen in one process of their own under ``runs.PINS`` (one thread, ATen at AVX2, MKL's
reproducible branch, oneDNN at AVX2), so the numbers hold on any x86-64 CPU with AVX2, Intel or
AMD, whatever instruction sets the host would dispatch to (``tools/golden_matrix.sh`` runs this
file under each). That process starts a Ray instance of its own for the Ray runs.

A change that moves a number on purpose re-records them (``python3 -m tests.golden.runs``) and
says which numbers moved, and why, in its commit."""

import json

import pytest

from tests.golden import runs

GOLDEN = json.loads(runs.GOLDEN.read_text())

pytestmark = pytest.mark.slow  # every test here takes seconds (BENCHMARKS.md: the suite's tiers)


@pytest.fixture(scope="module")
def pinned_run():
    """Runs a golden run under ``runs.PINS`` and returns what it recorded."""
    runner = runs.PinnedRuns()
    yield runner
    runner.close()


def _assert_reproduced(name: str, got: dict) -> None:
    want = GOLDEN[name]
    staleness = [row.get("async/staleness") for row in got["metrics"]]
    assert staleness == [row.get("async/staleness") for row in want["metrics"]], (
        f"{name}: the generator sampled other weights versions than the golden run ({staleness}): "
        "a timing race, not a change of the maths")
    assert len(got["metrics"]) == len(want["metrics"])
    for got_row, want_row in zip(got["metrics"], want["metrics"]):
        changed = {k: (want_row.get(k), got_row.get(k)) for k in set(got_row) | set(want_row)
                   if got_row.get(k) != want_row.get(k)}
        assert not changed, f"{name}, step {want_row['step']}: (golden, now) {changed}"
    assert got.get("summary") == want.get("summary"), name
    assert got.get("export_sha256") == want.get("export_sha256"), f"{name}: the exported weights differ"


@pytest.mark.parametrize("name", [n for n in runs.run_names() if n.endswith("/local")])
def test_every_recipe_reproduces_its_golden_metrics_locally(name, pinned_run):
    _assert_reproduced(name, pinned_run(name))


ON_RAY_IN_THE_SUITE = ("grpo.toml", "ppo_gae.toml", "tool_math.toml", "dapo.toml")
"""The recipes whose Ray runs the suite reproduces: each brings a role or a path of its own to the Ray
executor (the base step; a critic and a reference; multi-turn episodes; dynamic sampling's refills). A
teacher's scores on the Ray ranks and on a pool of its own are checked against the local executor's in
``tests/test_distill.py``; the other recipes differ from GRPO only in an estimator or a loss, computed by the
same code on every executor and pinned by their local runs above. ``PURERL_GOLDEN_ALL_RAY=1`` (and
``tools/golden_matrix.sh``) reproduces every recipe's Ray run. Kept to this set for the suite's time on a
2-core box (~20 s a run)."""


def _on_ray() -> list[str]:
    """Each recipe's Ray run in one mode (the modes in turn over the recipes), for the recipes of
    :data:`ON_RAY_IN_THE_SUITE`, or every recipe with ``PURERL_GOLDEN_ALL_RAY=1``."""
    import os

    modes = list(runs.MODES)
    every = os.environ.get("PURERL_GOLDEN_ALL_RAY") == "1"
    return [f"{recipe}/{modes[i % len(modes)]}/ray" for i, recipe in enumerate(runs.RECIPES)
            if every or recipe in ON_RAY_IN_THE_SUITE]


def _amx() -> bool:
    from pathlib import Path

    try:
        return "amx_tile" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


UNREPRODUCED_ON_AMX = ("dapo.toml/async/ray", "remax.toml/async/ray")
"""Found 2026-11-28 on an Intel Xeon with AMX (family 6, model 167): these two asynchronous Ray runs differ
from the recording in ``actor/grad_norm``'s last bits (1.5704180002 recorded, 1.5704178810 here, dapo's step
1), at 1ad3c0f as at today's code, every other golden run equal; the pins (ATen and oneDNN at AVX2, MKL's
reproducible branch) do not cover whatever dispatches differently there. Root cause open; elsewhere they
must reproduce."""


@pytest.mark.parametrize("name", _on_ray())
def test_every_recipe_reproduces_its_golden_metrics_on_ray(name, pinned_run):
    pytest.importorskip("ray")
    if name in UNREPRODUCED_ON_AMX and _amx():
        pytest.xfail(f"{name}: not bit-reproducible on this AMX host (UNREPRODUCED_ON_AMX)")
    _assert_reproduced(name, pinned_run(name))


def test_the_custom_step_example_reproduces_its_golden_metrics(pinned_run):
    _assert_reproduced("custom_step.py", pinned_run("custom_step.py"))


@pytest.mark.parametrize("name", [n for n in runs.run_names() if n.startswith("long.toml/")])
def test_packed_forwards_and_a_token_budget_leave_the_numbers_as_padded_up_to_float_rounding(name):
    """``examples/long.toml`` is ``grpo.toml`` with packed forwards and token-budget micro-batches
    (the golden runs cap responses at 16 tokens). Its recorded numbers (reproduced exactly above)
    are the padded GRPO run's on the same executor (the same matrix products: Adam turns a
    rounding-level gradient into a step of ±lr, so runs whose products round differently part
    by ~1e-4 in two steps): every sampled length, reward and accuracy equal; the losses,
    entropies and gradient norms to 1e-5 relative or 1e-6 absolute (float32: the packed attention
    and LM head sum in another order, ~3e-7 relative measured; the near-zero on-policy ``ppo_kl``
    and log-prob gaps differ by ~1e-8 absolute)."""
    _, mode, executor = name.split("/")
    packed, padded = GOLDEN[name], GOLDEN[f"grpo.toml/{mode}/{executor}"]
    assert packed["summary"] == padded["summary"]
    assert len(packed["metrics"]) == len(padded["metrics"]) == 3
    for got, want in zip(packed["metrics"], padded["metrics"]):
        assert got.keys() == want.keys()
        for key, value in want.items():
            exact = key.startswith(("response_length/", "critic/score", "critic/rewards", "reward/", "step"))
            assert got[key] == (value if exact else pytest.approx(value, rel=1e-5, abs=1e-6)), (name, key)
