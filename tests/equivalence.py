"""Shared checks of the k = 0 equivalence: asynchronous training with staleness 0 is the
synchronous loop, step for step."""

import torch

from purerl.state import TrainState


def assert_async_k0_equals_sync(sync_state: TrainState, sync_records: list[dict], async_state: TrainState,
                                async_records: list[dict], report: dict, steps: int, logprob_tol: float = 0.0) -> None:
    """Same report of a wait-policy run, same step and RNG, bit-identical weights, and the same
    metrics apart from timings. ``logprob_tol``: how far the engine's log-prob diagnostics
    (``rollout/logprob_*``) may differ, where the rows decoded beside a row differ (several
    generators): its samples are the same, its log-probs only up to float rounding."""
    assert report == {"staleness_histogram": {0: steps}, "trained": steps, "dropped_batches": 0, "discarded": 0,
                      "generated": steps, "restarts": 0}
    assert async_state.step == sync_state.step == steps
    assert (async_state.rng.seed, async_state.rng.counter) == (sync_state.rng.seed, sync_state.rng.counter)
    for name, value in sync_state.policy.items():
        assert torch.equal(async_state.policy[name], value), name
    for sync_record, async_record in zip(sync_records, async_records, strict=True):
        for key, value in sync_record.items():
            if key.startswith("rollout/logprob_") and logprob_tol:
                assert abs(async_record[key] - value) <= logprob_tol, key
            elif not key.startswith(("timing/", "perf/", "time")):
                assert async_record[key] == value, key
