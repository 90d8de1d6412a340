"""Asynchronous training on the local executor: a generator thread, published versions, a bounded queue."""

import copy
import functools
import json
import time

import attrs
import pytest
import torch

from purerl.algo.kl_control import make_kl_controller
from purerl.assembly.stages import batch_plan_of, stage_settings_of
from purerl.config.job import AsyncConfig, JobConfig
from purerl.config.loading import build
from purerl.data.cursor import DataCursor, next_indices
from purerl.data.records import PromptRecord
from purerl.executors.base import ExecutorError
from purerl.executors.local import LocalExecutor
from purerl.io.metrics import MetricsLog
from purerl.loop.async_train import train_async
from purerl.loop.task import Task
from purerl.loop.train import train
from purerl.optim import adamw, chain, clip_by_global_norm
from purerl.rollout.backends.torch import TorchEngine
from purerl.state import RngState, TrainState
from purerl.step import grpo_step
from purerl.tiny import tiny_causal_lm
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


def _setup(slow_step: float = 0.0, generators: int = 1, trained: list | None = None):
    """The state, a local executor with ``generators`` engines, the first engine; ``trained``
    collects each step's prompt indices (a prompt's first token is 5 + its index)."""
    model, params = tiny_causal_lm(seed=0)
    optimizer = chain(clip_by_global_norm(1.0), adamw(1e-2))
    kl = make_kl_controller("fixed")
    step = functools.partial(grpo_step, optimizer=optimizer, kl_controller=kl, **stage_settings_of(_config()))

    def step_fn(state, rollout, *args, **kwargs):
        time.sleep(slow_step)  # a trainer slower than the generator
        if trained is not None:
            trained.append((rollout.sequences.input_ids[::3, 0] - 5).tolist())
        return step(state, rollout, *args, **kwargs)

    state = TrainState(policy=tree_clone(params), policy_opt=optimizer.init(params), kl=kl.init(),
                       rng=RngState(0), data=DataCursor(0))
    # each generator's engine: its own skeleton copy, so no two threads share a module
    engines = [TorchEngine(attrs.evolve(model, module=copy.deepcopy(model.module)), **ENGINE)
               for _ in range(generators)]
    executor = LocalExecutor(step_fn, model, TorchEngine(model, **ENGINE), engines)
    return executor.start(state), executor, engines[0] if generators == 1 else engines


def _run_async(tmp_path, config, slow_step=0.0, generators=1, trained=None, change=None):
    state, executor, engines = _setup(slow_step, generators, trained)
    if change is not None:
        change(engines)
    log = MetricsLog(tmp_path)
    state, report = train_async(state, executor=executor, task=TASK, plan=batch_plan_of(config), trainer=config.trainer,
                                asynchronous=config.asynchronous, run_dir=tmp_path, log=log)
    log.close()
    return state, report, list(MetricsLog.read(log.path))


def _cursor_order(steps: int) -> list[list[int]]:
    """The prompts of steps 1 … steps as the synchronous loop takes them."""
    order, cursor = [], DataCursor(0)
    for _ in range(steps):
        indices, cursor = next_indices(cursor, len(TASK.records), 2)
        order.append(indices)
    return order


def _run_sync(run_dir, steps):
    """The synchronous loop's final state and records."""
    state, executor, _ = _setup()
    log = MetricsLog(run_dir)
    config = _config(steps=steps)
    state = train(state, executor=executor, task=TASK, plan=batch_plan_of(config), trainer=config.trainer,
                  run_dir=run_dir, log=log)
    log.close()
    return state, list(MetricsLog.read(log.path))


def test_staleness_zero_is_the_synchronous_trainer_bit_for_bit(tmp_path):
    sync_state, sync_records = _run_sync(tmp_path / "sync", steps=5)
    async_state, report, async_records = _run_async(tmp_path / "async", _config(steps=5, max_staleness=0))
    assert_async_k0_equals_sync(sync_state, sync_records, async_state, async_records, report, steps=5)
    assert attrs.astuple(async_state.data) == attrs.astuple(sync_state.data)


def test_a_second_start_begins_another_run_whose_engines_load_its_weights():
    """An executor's start begins a run: starting again from other weights publishes version 0 anew,
    and an engine that held version 0 of the first run loads the second run's (a new executor's samples)."""
    from purerl.rollout.sampling import SamplingParams

    model, first = tiny_causal_lm(seed=0)
    _, second = tiny_causal_lm(seed=1)
    sampling, prompts = SamplingParams(max_new_tokens=6, n=2, temperature=1.0), [[5, 6, 7], [8, 9]]

    def state_of(params):
        return TrainState(policy=tree_clone(params), policy_opt=None, kl=None, rng=RngState(0))

    def sample(executor):
        with executor.engine(executor.newest(0)) as engine:
            return engine.generate(prompts, sampling, RngState(3)).sequences.input_ids

    def executor_of():
        generator = TorchEngine(attrs.evolve(model, module=copy.deepcopy(model.module)), **ENGINE)
        return LocalExecutor(lambda *a, **k: None, model, TorchEngine(model, **ENGINE), [generator])

    executor = executor_of()
    executor.start(state_of(first))
    of_first = sample(executor)
    executor.start(state_of(second))
    assert executor.newest().version == 0
    fresh = executor_of()
    fresh.start(state_of(second))
    assert torch.equal(sample(executor), sample(fresh)) and not torch.equal(of_first, sample(fresh))


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
    assert report["trained"] == 4 and report["discarded"] <= 3
    assert report["generated"] == report["trained"] + report["dropped_batches"] + report["discarded"]


def test_a_failing_generator_stops_the_run_naming_it(tmp_path):
    state, executor, generator = _setup()

    def broken(*args, **kwargs):
        raise RuntimeError("engine exploded")

    generator.generate = broken
    config = _config(restarts=0)
    start = time.monotonic()
    with pytest.raises(ExecutorError, match=r"generator 0 failed \(after 0 restart\(s\) in the run, asynchronous.restarts=0\): RuntimeError\(.engine exploded.\)"):
        train_async(state, executor=executor, task=TASK, plan=batch_plan_of(config), trainer=config.trainer,
                    asynchronous=config.asynchronous, run_dir=tmp_path)
    assert time.monotonic() - start < 10


def test_two_generators_with_staleness_zero_are_the_synchronous_trainer_bit_for_bit(tmp_path):
    """Each step's two prompt groups come from two generators (one group per call): every sample
    draws from its own stream, so the batch is the synchronous one."""
    sync_state, sync_records = _run_sync(tmp_path / "sync", steps=5)
    trained = []
    async_state, report, async_records = _run_async(
        tmp_path / "async", _config(steps=5, max_staleness=0, generators=2, groups_per_call=1), generators=2,
        trained=trained)
    assert_async_k0_equals_sync(sync_state, sync_records, async_state, async_records, report, steps=5,
                                logprob_tol=1e-5)
    assert trained == _cursor_order(5)
    status = json.loads((tmp_path / "async" / "status.json").read_text())
    assert status["trainer"]["step"] == 5 and len(status["generators"]) == 2
    assert sum(g["groups"] for g in status["generators"]) == 10  # under "wait" nothing is made in vain


@pytest.mark.parametrize("policy", ["wait", "drop"])
def test_three_generators_lose_no_group_and_train_none_twice(tmp_path, policy):
    """Generators run ahead of a slow trainer in any order; the trainer still takes every step's
    groups in cursor order (a dropped batch's prompts are skipped, as with one generator)."""
    trained = []
    config = _config(steps=6, max_staleness=1, stale_policy=policy, generators=3, groups_per_call=1)
    state, report, records = _run_async(tmp_path, config, slow_step=0.1, generators=3, trained=trained)
    assert state.step == 6 and len(trained) == 6
    batches = report["trained"] + report["dropped_batches"]
    order = _cursor_order(batches)
    assert trained == [b for b, kept in zip(order, _kept(records, batches)) if kept]
    assert all(r["async/staleness"] <= 1 for r in records)
    # the checkpointed cursor says which prompts were trained: those before it, and no others
    after_last = next_indices(DataCursor(0), len(TASK.records), 2 * len(_kept(records, batches)))[1]
    assert attrs.astuple(state.data) == attrs.astuple(after_last)


def _kept(records, batches):
    """Which of the first ``batches`` batches were trained: a dropped one is counted in the next
    trained step's ``async/dropped_batches``."""
    kept, dropped = [], 0
    for r in records:
        newly = int(r["async/dropped_batches"]) - dropped
        kept += [False] * newly + [True]
        dropped += newly
    return (kept + [False] * batches)[:batches]


def test_a_failing_generator_is_restarted_and_its_groups_handed_out_again(tmp_path):
    trained, calls = [], []

    def fail_once(engines):
        engine = engines[1]
        generate = engine.generate

        def flaky(*args, **kwargs):
            calls.append(1)
            if len(calls) == 2:
                raise RuntimeError("engine exploded once")
            return generate(*args, **kwargs)

        engine.generate = flaky

    config = _config(steps=4, max_staleness=0, generators=2, groups_per_call=1, restart_backoff_s=0.01)
    state, report, records = _run_async(tmp_path, config, generators=2, trained=trained, change=fail_once)
    assert state.step == 4 and report["restarts"] == 1 and records[-1]["async/generator_restarts"] == 1
    assert trained == _cursor_order(4)
    status = json.loads((tmp_path / "status.json").read_text())
    assert [g["restarts"] for g in status["generators"]] == [0, 1]


def test_a_straggling_generator_hands_in_fewer_groups_and_stalls_nobody(tmp_path):
    def slow_second(engines):
        generate = engines[1].generate

        def slow(*args, **kwargs):
            time.sleep(0.5)
            return generate(*args, **kwargs)

        engines[1].generate = slow

    trained = []
    config = _config(steps=6, max_staleness=2, generators=2, groups_per_call=1, queue_batches=2)
    state, report, _ = _run_async(tmp_path, config, generators=2, trained=trained, change=slow_second)
    assert trained == _cursor_order(6)
    fast, slow = json.loads((tmp_path / "status.json").read_text())["generators"]
    assert fast["groups"] >= 2 * slow["groups"], (fast, slow)


def test_interruptible_generators_continue_open_rows_on_newer_weights(tmp_path):
    """Decoding slowed (each poll of the interrupt waits 20 ms) so that versions are published
    mid-generation: rows are continued on the newer weights, and the run still trains every
    step's groups in order within the staleness bound."""
    def slow_polls(engines):
        for engine in engines:
            def slowed(*args, generate=engine.generate, interrupt=None, **kwargs):
                if interrupt is not None:
                    def interrupt(check=interrupt):
                        time.sleep(0.02)
                        return check()
                return generate(*args, interrupt=interrupt, **kwargs)

            engine.generate = slowed

    trained = []
    config = _config(steps=5, max_staleness=2, generators=2, interruptible=True)
    state, report, records = _run_async(tmp_path, config, slow_step=0.1, generators=2, trained=trained,
                                        change=slow_polls)
    assert state.step == 5 and trained == _cursor_order(5)
    assert all(r["async/staleness"] <= 2 for r in records)
    status = json.loads((tmp_path / "status.json").read_text())
    assert sum(g["interruptions"] for g in status["generators"]) >= 1
    assert sum(g["continued_rows"] for g in status["generators"]) >= 1


@pytest.mark.parametrize("kwargs, message", [({"max_staleness": -1}, "max_staleness"),
                                             ({"stale_policy": "block"}, "stale_policy"),
                                             ({"queue_batches": 0}, "queue_batches"),
                                             ({"generators": 0}, "generators")])
def test_bad_async_settings_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        AsyncConfig(**kwargs)


def test_generators_need_async_and_get_a_rollout_worker_each_on_ray():
    from purerl.config.rules import problems, resolve

    alone = resolve(build(JobConfig, {"asynchronous": {"generators": 2}}))
    assert any("asynchronous.generators=2 needs asynchronous training (--async)" in p for p in problems(alone))
    on_ray = resolve(build(JobConfig, {"asynchronous": {"enable": True, "generators": 3},
                                       "executor": {"kind": "ray", "rollout_workers": 1}}))
    assert on_ray.executor.rollout_workers == 3 and not problems(on_ray)
    for extra, message in ((({"rollout": {"engine": "vllm"}}), "rollout.engine=vllm cannot stop and continue a row"),
                           ({"rollout": {"stop": ["</answer>"]}}, "a stop string could span"),
                           ({"env": {"name": "calculator"}}, "episodes (env.multi_turn) are not continued")):
        config = resolve(build(JobConfig, {"asynchronous": {"enable": True, "interruptible": True}, **extra}))
        assert any(message in p for p in problems(config)), (message, problems(config))
