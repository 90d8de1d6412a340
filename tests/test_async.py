"""Asynchronous training on the local executor: a generator thread, published versions, a bounded queue."""

import copy
import functools
import time

import attrs
import pytest

from purerl.algo.kl_control import make_kl_controller
from purerl.config.job import AsyncConfig, JobConfig
from purerl.config.loading import build
from purerl.data.cursor import DataCursor
from purerl.data.records import PromptRecord
from purerl.executors.base import ExecutorError
from purerl.executors.local import LocalExecutor
from purerl.io.metrics import MetricsLog
from purerl.loop.async_train import train_async
from purerl.loop.sampling import Task
from purerl.loop.train import train
from purerl.models import causal_lm_from_config
from purerl.optim import adamw, chain, clip_by_global_norm
from purerl.rollout.backends.torch import TorchEngine
from purerl.state import RngState, TrainState
from purerl.step import grpo_step
from purerl.tiny import tiny_llama_config
from purerl.tree import tree_clone
from tests.equivalence import assert_async_k0_equals_sync

ENGINE = dict(eos_token_ids=[1], pad_token_id=0)


def decode(ids):
    return "".join(map(chr, ids))


TASK = Task([[5 + i, 6, 7] for i in range(8)], [PromptRecord(({"role": "user", "content": str(i)},), "0")
                                                 for i in range(8)],
            lambda text, truth: float(text.count("a")) / max(len(text), 1), decode)


def _config(steps=4, **asynchronous) -> JobConfig:
    return build(JobConfig, {"trainer": {"steps": steps, "checkpoint_every": 2, "progress": False},
                             "data": {"prompts_per_step": 2}, "rollout": {"max_new_tokens": 6, "n": 3, "temperature": 1.0},
                             "actor": {"clip_high": 0.28, "micro_batch_rows": 4},
                             "asynchronous": {"enable": True, **asynchronous}})


def _setup(slow_step: float = 0.0):
    model, params = causal_lm_from_config(tiny_llama_config(), seed=0)
    optimizer = chain(clip_by_global_norm(1.0), adamw(1e-2))
    kl = make_kl_controller("fixed")
    step = functools.partial(grpo_step, optimizer=optimizer, kl_controller=kl, config=_config())

    def step_fn(*args, **kwargs):
        time.sleep(slow_step)  # a trainer slower than the generator
        return step(*args, **kwargs)

    state = TrainState(policy=tree_clone(params), policy_opt=optimizer.init(params), kl=kl.init(),
                       rng=RngState(0), data=DataCursor(0))
    # the generator's engine: its own skeleton copy, so the two threads never share a module
    generator = TorchEngine(attrs.evolve(model, module=copy.deepcopy(model.module)), **ENGINE)
    executor = LocalExecutor(step_fn, model, TorchEngine(model, **ENGINE), generator_engine=generator)
    return executor.start(state), executor, generator


def _run_async(tmp_path, config, slow_step=0.0):
    state, executor, _ = _setup(slow_step)
    log = MetricsLog(tmp_path)
    state, report = train_async(state, executor=executor, task=TASK, config=config, run_dir=tmp_path, log=log)
    log.close()
    return state, report, list(MetricsLog.read(log.path))


def test_staleness_zero_is_the_synchronous_trainer_bit_for_bit(tmp_path):
    state, executor, _ = _setup()
    log = MetricsLog(tmp_path / "sync")
    sync_state = train(state, executor=executor, task=TASK, config=_config(steps=5), run_dir=tmp_path / "sync",
                       log=log)
    log.close()
    sync_records = list(MetricsLog.read(log.path))
    async_state, report, async_records = _run_async(tmp_path / "async", _config(steps=5, max_staleness=0))
    assert_async_k0_equals_sync(sync_state, sync_records, async_state, async_records, report, steps=5)
    assert attrs.astuple(async_state.data) == attrs.astuple(sync_state.data)


def test_a_slow_trainer_trains_on_batches_one_version_old_never_older(tmp_path):
    state, report, records = _run_async(tmp_path, _config(max_staleness=1, queue_batches=1), slow_step=0.3)
    assert state.step == 4 and sum(report["staleness_histogram"].values()) == 4
    assert report["trained"] == report["generated"] == 4  # under "wait" nothing is made in vain
    assert set(report["staleness_histogram"]) <= {0, 1} and report["staleness_histogram"].get(1, 0) >= 2
    assert all(r["async/staleness"] <= 1 and r["async/queue_depth"] <= 1 for r in records)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    versions = [r["step"] - 1 - r["async/staleness"] for r in records]  # the weights each batch was sampled with
    assert versions == sorted(versions)
    assert (tmp_path / "checkpoints" / "step_00000004").is_dir()


def test_the_drop_policy_drops_stale_batches_and_counts_them(tmp_path):
    state, report, records = _run_async(tmp_path, _config(max_staleness=0, stale_policy="drop", queue_batches=2),
                                        slow_step=0.3)
    assert state.step == 4 and report["staleness_histogram"] == {0: 4}
    assert all(r["async/staleness"] == 0 for r in records)
    assert report["dropped_batches"] >= 1
    # every batch the generator queued was trained, dropped, or still queued at the end
    assert report["trained"] == 4 and report["discarded"] <= 2
    assert report["generated"] == report["trained"] + report["dropped_batches"] + report["discarded"]


def test_a_failing_generator_stops_the_run_naming_it(tmp_path):
    state, executor, generator = _setup()

    def broken(*args, **kwargs):
        raise RuntimeError("engine exploded")

    generator.generate = broken
    start = time.monotonic()
    with pytest.raises(ExecutorError, match="generator failed: RuntimeError\\('engine exploded'\\)"):
        train_async(state, executor=executor, task=TASK, config=_config(), run_dir=tmp_path)
    assert time.monotonic() - start < 10


@pytest.mark.parametrize("kwargs, message", [({"max_staleness": -1}, "max_staleness"),
                                             ({"stale_policy": "block"}, "stale_policy"),
                                             ({"queue_batches": 0}, "queue_batches")])
def test_bad_async_settings_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        AsyncConfig(**kwargs)
