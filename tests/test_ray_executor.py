"""The Ray executor on CPU: 2 FSDP2 gloo training ranks (+ a rollout worker when split).

The same step function runs on the local and the Ray executor; on the same rollout batch the
results must agree. Failures (a killed worker, a silent rank, an unknown weights version) must end
the run with an error naming the worker, quickly.
"""

import functools
import json
import os
import sys
import time
from pathlib import Path

import attrs
import pytest
import torch

from purerl.algo.kl_control import make_kl_controller
from purerl.assembly.stages import batch_plan_of, stage_settings_of
from purerl.config.job import ExecutorConfig, JobConfig
from purerl.config.loading import build
from purerl.data.cursor import DataCursor
from purerl.data.records import PromptRecord
from purerl.executors.base import ExecutorError, Roles
from purerl.executors.local import LocalExecutor
from purerl.executors.wire import params_digest
from purerl.io.metrics import MetricsLog
from purerl.loop.async_train import train_async
from purerl.loop.task import Task
from purerl.loop.train import train
from purerl.models import critic_from_causal_lm
from purerl.optim import adamw, chain, clip_by_global_norm
from purerl.rewards import score_responses
from purerl.rollout.backends.torch import TorchEngine
from purerl.rollout.sampling import SamplingParams
from purerl.state import RngState, TrainState
from purerl.step import grpo_step, ppo_step
from purerl.tiny import tiny_causal_lm
from purerl.tree import replace, tree_clone, tree_equal, tree_leaves
from tests import processes
from tests.equivalence import assert_async_k0_equals_sync

pytestmark = pytest.mark.slow  # every test here takes seconds (BENCHMARKS.md: the suite's tiers)

pytest.importorskip("ray")
ray_executor = pytest.importorskip("purerl.executors.ray")
StepFactory = ray_executor.StepFactory

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
ENGINE = dict(eos_token_ids=[1], pad_token_id=0)
SETUP = ray_executor.RaySetup(engine_kwargs=ENGINE)


def _even_tokens(rollout):
    responses, mask = rollout.sequences.responses(), rollout.sequences.response_mask
    return ((responses % 2 == 0) & mask).float().sum(-1) / mask.sum(-1).clamp_min(1)


def _job(steps=3, actor=None, **sections) -> JobConfig:
    """A job config sampling at temperature 1 (the steps' log-probs too), clipping at 0.2, the old
    log-probs recomputed by the ranks' forward (not the engine's: resolved, this job would take those)."""
    return build(JobConfig, {"trainer": {"steps": steps, "progress": False}, "data": {"prompts_per_step": 2},
                             "rollout": {"max_new_tokens": 6, "n": 3, "temperature": 1.0},
                             "actor": {"clip_high": 0.2, "recompute_old_logprobs": True, **(actor or {})},
                             **sections})


def _make_step_fn(micro_batch_rows):
    """Built on each rank: under jaxtyping's import hook purerl's closures do not pickle."""
    optimizer = chain(clip_by_global_norm(1.0), adamw(1e-3, weight_decay=0.01))
    config = _job(actor={"kl_loss_coef": 0.1, "micro_batch_rows": micro_batch_rows})
    return functools.partial(grpo_step, optimizer=optimizer, kl_controller=make_kl_controller("fixed", coef=0.001),
                             **stage_settings_of(config)), optimizer


def _setup(micro_batch_rows):
    model, params = tiny_causal_lm(seed=0)
    step_fn, optimizer = _make_step_fn(micro_batch_rows)
    kl = make_kl_controller("fixed", coef=0.001)

    def fresh():
        p = tree_clone(params)
        return TrainState(policy=p, policy_opt=optimizer.init(p), kl=kl.init(), rng=RngState(0),
                          data=DataCursor(0), reference=tree_clone(p))

    make = functools.partial(lambda rows: _make_step_fn(rows)[0], micro_batch_rows)
    return model, step_fn, make, fresh


@pytest.fixture(autouse=True)
def _pickle_this_module_by_value():
    from ray import cloudpickle  # Ray's own copy, the one that serialises tasks

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # rank processes cannot import tests/


SPLIT = ExecutorConfig(kind="ray", train_ranks=2, rollout_workers=1, placement="split", step_timeout=120,
                       sync_timeout=60)


@pytest.fixture(scope="class")
def shared(ray_cluster):
    """``shared(name, make)``: an executor the tests of a class start runs on in turn (each start begins a run
    on the same workers), made on first use, made again when a test left it stopped, closed with the class.
    Starting Ray workers is most of a test's time here (~3 s of imports each on a 2-core box)."""
    built = {}

    def get(name, make):
        executor = built.get(name)
        if executor is None or executor.groups.failure is not None or executor.broken:
            if executor is not None:
                executor.close()
            built[name] = executor = make()
        return executor

    yield get
    for executor in built.values():
        executor.close()


def _picky_reward(text, truth):
    if len(text) % 3 == 0:
        raise ValueError("a multiple of 3")
    return float(len(text))


@pytest.mark.parametrize("placement, micro_batch_rows, reward_workers", [("split", 5, 2), ("colocated", 1, 0)])
def test_ray_step_equals_local_step_then_a_two_step_loop_runs(ray_cluster, tmp_path, placement, micro_batch_rows,
                                                              reward_workers):
    # micro-batches of 1 row leave one rank without rows: it must still join every collective
    model, step_fn, make_step_fn, fresh = _setup(micro_batch_rows)
    config = ExecutorConfig(kind="ray", train_ranks=2, rollout_workers=1, reward_workers=reward_workers,
                            placement=placement, sync_checksum=True, step_timeout=120, sync_timeout=60)
    with ray_executor.RayExecutor(StepFactory(make_step_fn), model, SETUP, config) as executor:
        state = executor.start(fresh())
        assert state.policy == {} and state.policy_opt is None  # params live on the ranks
        with executor.engine(executor.newest(0)) as engine:
            # every rollout engine holds exactly the trainer's weights (sha256 over all params)
            assert set(executor.last_sync_digests) == {params_digest(fresh().policy)}
            rollout = engine.generate(PROMPTS, SamplingParams(max_new_tokens=8, n=4, temperature=1.0), RngState(1),
                                      version=0)
        assert rollout.sequences.input_ids.shape[0] == 12
        assert rollout.group.tolist() == [g for g in range(3) for _ in range(4)]
        scores = _even_tokens(rollout)
        state, metrics = executor.step(state, rollout, scores)
        ray_full = executor.full_state(state)

        local = LocalExecutor(step_fn, model, TorchEngine(model, **ENGINE))
        local_state, local_metrics = local.step(fresh(), rollout, scores)
        assert ray_full.step == local_state.step == 1 and ray_full.rng.counter == local_state.rng.counter == 1
        for name, value in local_state.policy.items():
            torch.testing.assert_close(ray_full.policy[name], value, rtol=0, atol=1e-5)
        for a, b in zip(tree_leaves(ray_full.policy_opt), tree_leaves(local_state.policy_opt)):
            if isinstance(a, torch.Tensor):
                torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
        assert metrics.keys() == local_metrics.keys()
        for key, value in local_metrics.items():
            assert metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
        assert tree_equal(ray_full.reference, fresh().reference)

        # the driver loop on this executor: two more steps, weights synced as versions 1, 2, 3
        records = [PromptRecord(({"role": "user", "content": str(i)},), "0") for i in range(6)]
        task = Task([[5 + i, 6, 7] for i in range(6)], records,
                    lambda text, truth: float(text.count("a")) / max(len(text), 1), lambda ids: "".join(map(chr, ids)))
        log = MetricsLog(tmp_path)
        before = executor.full_state(state)
        job = _job(trainer={"steps": 3, "checkpoint_every": 3, "progress": False})
        state = train(state, executor=executor, task=task, plan=batch_plan_of(job), trainer=job.trainer,
                      run_dir=tmp_path, log=log)
        log.close()
        assert state.step == 3 and executor.newest().version == 3
        assert [r["step"] for r in MetricsLog.read(log.path)] == [2, 3]
        assert not tree_equal(executor.full_state(state).policy, before.policy)
        assert (tmp_path / "checkpoints" / "step_00000003").is_dir()

        # rewards scored on the reward workers (or the driver) equal the driver's, errors numbered globally
        texts, truths = ["a" * i for i in range(11)], ["0"] * 11
        scored = executor.score(_picky_reward, texts, truths, timeout=5.0, penalty=-1.0)
        assert scored == score_responses(_picky_reward, texts, truths, timeout=5.0, penalty=-1.0)
        assert scored.errors == 4 and "sample 9: ValueError" in scored.error_messages[-1]

        # generating with weights the engines were never given fails closed, naming the worker
        with pytest.raises(ExecutorError, match=r"(rollout worker|train rank) \d .*version 7"), \
                executor.engine(executor.newest()) as engine:
            engine.generate(PROMPTS, SamplingParams(max_new_tokens=4, temperature=1.0, n=1), RngState(0), version=7)


def _verl_reward(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": 10.0 * len(data_source) + extra_info.get("w", 0.0) + (solution_str == ground_truth), "n": 1}


def test_ray_reward_workers_score_verl_functions_and_the_reward_model(ray_cluster, tmp_path):
    from purerl.rewards import load_reward_fn
    from purerl.rewards.model import RewardModel, save_tiny_reward_model

    path = save_tiny_reward_model(tmp_path / "rm")
    module = tmp_path / "ray_file_reward.py"  # importable only from its folder: the worker gets the driver's sys.path
    module.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return float(len(data_source) + len(solution_str))\n")
    model, _, make_step_fn, _ = _setup(4)
    config = ExecutorConfig(kind="ray", train_ranks=1, placement="colocated", reward_workers=1, step_timeout=120)
    prompts = ["what is 2+2?", "hi", "a longer prompt than the others", ""]
    responses = ["4", "hello there, friend", "y", "#### 12"]
    with ray_executor.RayExecutor(StepFactory(make_step_fn), Roles(model, reward_model=str(path)), SETUP,
                                  config) as executor:
        torch.testing.assert_close(executor.score_model(prompts, responses),
                                   RewardModel(path).score(prompts, responses), rtol=0, atol=0)
        scored = executor.score(_verl_reward, ["4", "5", "4"], ["4", "4", "4"], timeout=10.0, penalty=-1.0,
                                data_sources=["a", "bb", "ccc"], extra_infos=[{}, {"w": 0.5}, {"w": 2.0}])
        assert scored.values == [11.0, 20.5, 33.0] and scored.errors == 0
        from_file = load_reward_fn(f"{module}:compute_score")
        assert executor.score(from_file, ["x", "yy"], ["0", "0"], timeout=10.0, penalty=-1.0,
                              data_sources=["abc", "d"]).values == [4.0, 3.0]


def _make_ppo_step_fn(**actor):
    optimizer = chain(clip_by_global_norm(1.0), adamw(1e-3, weight_decay=0.01))
    config = _job(algorithm={"adv_estimator": "gae"}, actor={"micro_batch_rows": 4, "mini_batch_rows": 6,
                                                             "ppo_epochs": 2, **actor})
    kl = make_kl_controller("fixed", coef=0.001)
    return functools.partial(ppo_step, optimizer=optimizer, critic_optimizer=optimizer, kl_controller=kl,
                             **stage_settings_of(config)), optimizer


def test_ppo_with_a_sharded_critic_and_checkpointed_policy_equals_local(tiny_lm, ray_cluster):
    # activation checkpointing: FSDP's hooks must re-gather the params when a layer recomputes
    model, params = tiny_lm(seed=0, activation_checkpointing=True)
    critic, critic_params = critic_from_causal_lm(model, params)
    step_fn, optimizer = _make_ppo_step_fn()
    kl = make_kl_controller("fixed", coef=0.001)

    def fresh():
        p, c = tree_clone(params), tree_clone(critic_params)
        return TrainState(policy=p, policy_opt=optimizer.init(p), kl=kl.init(), rng=RngState(0),
                          critic=c, critic_opt=optimizer.init(c))

    engine = TorchEngine(model, **ENGINE)
    local = LocalExecutor(step_fn, Roles(model, critic=critic), engine)
    engine.sync(params, 0)
    rollout = engine.generate(PROMPTS, SamplingParams(max_new_tokens=8, n=4, temperature=1.0), RngState(3), version=0)
    scores = _even_tokens(rollout)
    local_state, local_metrics = local.step(fresh(), rollout, scores)

    config = ExecutorConfig(kind="ray", train_ranks=2, placement="colocated", step_timeout=120)
    make = functools.partial(lambda: _make_ppo_step_fn()[0])
    with ray_executor.RayExecutor(StepFactory(make), Roles(model, critic=critic), SETUP, config) as executor:
        state, metrics = executor.step(executor.start(fresh()), rollout, scores)
        full = executor.full_state(state)
    for tree in ("policy", "critic"):
        for name, value in getattr(local_state, tree).items():
            torch.testing.assert_close(getattr(full, tree)[name], value, rtol=0, atol=1e-5)
    assert "critic/vf_loss" in metrics
    for key, value in local_metrics.items():
        assert metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key


PRESETS = {  # placement: (training ranks, workers of the other pools); at most the session cluster's 6 CPUs
    "fully_collocated": dict(train_ranks=2),
    "hybrid_engine": dict(train_ranks=2, reward_workers=1),
    "split_collocate": dict(train_ranks=1, critic_workers=2),  # the critic's own pool sharded over 2 ranks
    "standalone": dict(train_ranks=2, reward_workers=1),
}


@pytest.mark.parametrize("placement", list(PRESETS))
def test_every_placement_runs_ppo_with_a_critic_a_reference_and_a_reward_model_like_the_local_executor(
        tiny_lm, ray_cluster, tmp_path, placement):
    """Each preset puts the rollout, the reference, the critic and the reward model on its pools;
    the same step function then gives the local executor's samples, reward-model scores, metrics
    and params (to float rounding: sums reduced over other ranks in another order)."""
    from purerl.rewards.model import RewardModel, save_tiny_reward_model

    model, params = tiny_lm(seed=0)
    critic, critic_params = critic_from_causal_lm(model, params)
    step_fn, optimizer = _make_ppo_step_fn(kl_loss_coef=0.1)
    kl = make_kl_controller("fixed", coef=0.001)
    reward_model = save_tiny_reward_model(tmp_path / "rm")
    sampling = SamplingParams(max_new_tokens=6, n=2, temperature=1.0)

    def fresh():
        p, c = tree_clone(params), tree_clone(critic_params)
        return TrainState(policy=p, policy_opt=optimizer.init(p), kl=kl.init(), rng=RngState(0),
                          critic=c, critic_opt=optimizer.init(c), reference=tree_clone(p))

    def texts(rollout):
        prompts = ["".join(chr(97 + t % 26) for t in p) for p in PROMPTS for _ in range(sampling.n)]
        responses = ["".join(chr(97 + int(t) % 26) for t, m in zip(row, mask) if m)
                     for row, mask in zip(rollout.sequences.responses(), rollout.sequences.response_mask)]
        return prompts, responses

    def two_steps(executor, score, step_scores=None):
        """Two steps on the executor's own samples, with its reward model's scores (or, to compare
        the steps alone, ``step_scores``: the two runs' scores differ by float rounding)."""
        state, rollouts, scores, metrics = executor.start(fresh()), [], [], []
        for step in range(2):
            with executor.engine(executor.newest(step)) as engine:
                rollouts.append(engine.generate(PROMPTS, sampling, RngState(7).fold_in(step), version=step))
            scores.append(score(*texts(rollouts[-1])))
            state, m = executor.step(state, rollouts[-1], scores[-1] if step_scores is None else step_scores[step])
            metrics.append(m)
        return executor.full_state(state), rollouts, scores, metrics

    local_rm = RewardModel(str(reward_model))
    local = LocalExecutor(step_fn, Roles(model, critic=critic), TorchEngine(model, **ENGINE))
    want, want_rollouts, want_scores, want_metrics = two_steps(local, local_rm.score)

    config = ExecutorConfig(kind="ray", placement=placement, step_timeout=120, **PRESETS[placement])
    make = functools.partial(lambda: _make_ppo_step_fn(kl_loss_coef=0.1)[0])
    with ray_executor.RayExecutor(StepFactory(make), Roles(model, critic=critic, reward_model=str(reward_model)),
                                  SETUP, config) as executor:
        got, rollouts, scores, metrics = two_steps(executor, executor.score_model, want_scores)
        labels = {label.rsplit(" ", 1)[0] for _, label in executor.groups.actors}
        rendezvous = list(executor.groups.rendezvous)
    assert rendezvous and not any(path.exists() for path in rendezvous)  # one per group, removed on close
    assert labels == {"fully_collocated": {"train rank"}, "hybrid_engine": {"train rank", "reward worker"},
                      "split_collocate": {"train rank", "rollout worker", "critic rank"},
                      "standalone": {"train rank", "rollout worker", "reward worker", "critic rank",
                                     "reference rank"}}[placement]
    for ours, theirs in zip(rollouts, want_rollouts):
        assert torch.equal(ours.sequences.input_ids, theirs.sequences.input_ids)
    for ours, theirs in zip(scores, want_scores):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)  # rows padded in other shards
    for ours, theirs in zip(metrics, want_metrics):
        assert "critic/vf_loss" in ours and "actor/kl_loss" in ours
        assert ours.keys() == theirs.keys()
        for key, value in theirs.items():
            assert ours[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    for tree in ("policy", "critic", "reference"):
        for name, value in getattr(want, tree).items():
            torch.testing.assert_close(getattr(got, tree)[name], value, rtol=0, atol=1e-5)
    want_opt, got_opt = tree_leaves(want.critic_opt), tree_leaves(got.critic_opt)  # the pool's optimizer state
    assert len(got_opt) == len(want_opt) > 2
    for ours, theirs in zip(got_opt, want_opt):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


def _tiny_task(prompts: int = 8) -> Task:
    records = [PromptRecord(({"role": "user", "content": str(i)},), "0") for i in range(prompts)]
    return Task([[5 + i, 6, 7] for i in range(prompts)], records,
                lambda text, truth: float(text.count("a")) / max(len(text), 1), lambda ids: "".join(map(chr, ids)))


def test_rollout_workers_stop_open_rows_when_interrupted_and_continue_them(ray_cluster):
    """Ray's view of a generator's two rollout workers: an interrupt polled on the driver reaches
    each worker while it generates (two methods at once); the rows still open stop, and
    continuing them completes the rollout with the trainer's log-probs."""
    from purerl.batch import FINISH_INTERRUPTED
    from purerl.models import response_logprobs
    from purerl.rollout.partial import Interruptible
    from purerl.rollout.queue import Weights

    model, _, _, fresh = _setup(4)
    config = ExecutorConfig(kind="ray", train_ranks=1, rollout_workers=2, placement="split")
    sampling = SamplingParams(max_new_tokens=200, temperature=1.0, n=2)
    with ray_executor.RayExecutor(_sleeping_step, model, attrs.evolve(SETUP, generators=1), config) as executor:
        state = fresh()
        executor.start(state)
        with executor.engine(executor.newest(0)) as engine:
            whole = engine.generate(PROMPTS, sampling, RngState(1), version=0)
            cut = engine.generate(PROMPTS, sampling, RngState(1), version=0, interrupt=lambda: True)
            polls = []
            resumed = Interruptible(engine, lambda v: (polls.append(v), Weights(1) if len(polls) == 1 else None)[1],
                                    lambda w: None)  # "newer" weights that are the same: nothing to load
            again = resumed.generate(PROMPTS, sampling, RngState(1), version=0)
    assert (cut.finish_reasons == FINISH_INTERRUPTED).any() and cut.sequences.response_length < 200
    k, alive = cut.sequences.response_length, cut.sequences.response_mask  # each worker stopped at its own step
    assert torch.equal(cut.sequences.responses()[alive], whole.sequences.responses()[:, :k][alive])  # same draws
    assert resumed.interruptions == 1 and not (again.finish_reasons == FINISH_INTERRUPTED).any()
    trainer = response_logprobs(model, state.policy, again.sequences)
    mask = again.sequences.response_mask
    torch.testing.assert_close(again.behaviour_logprobs[mask], trainer[mask], rtol=0, atol=1e-4)


def _sleeping_step(state, rollout, scores, **effects):
    time.sleep(60)


def test_a_rank_that_outlives_the_step_timeout_ends_the_run(ray_cluster):
    model, _, _, fresh = _setup(4)
    config = ExecutorConfig(kind="ray", train_ranks=2, placement="colocated", step_timeout=3)
    with ray_executor.RayExecutor(_sleeping_step, model, SETUP, config) as executor:
        state = executor.start(fresh())
        with executor.engine(executor.newest(0)) as engine:
            rollout = engine.generate(PROMPTS, SamplingParams(max_new_tokens=4, n=2, temperature=1.0), RngState(1),
                                      version=0)
        start = time.monotonic()
        with pytest.raises(ExecutorError, match=r"step: train rank 0, train rank 1 did not answer within 3 s"):
            executor.step(state, rollout, _even_tokens(rollout))
        assert time.monotonic() - start < 20


def test_a_sync_to_a_dead_rollout_worker_fails_closed(ray_cluster):
    model, _, _, fresh = _setup(4)
    config = ExecutorConfig(kind="ray", train_ranks=2, placement="split", sync_timeout=30)
    with ray_executor.RayExecutor(_sleeping_step, model, SETUP, config) as executor:
        state = executor.start(fresh())
        with executor.engine(executor.newest(0)):
            pass
        ray_cluster.kill(executor.rollout[0])
        executor.publish(replace(state, step=1))
        start = time.monotonic()
        with pytest.raises(ExecutorError, match=r"weight sync: rollout worker 0 died"), \
                executor.engine(executor.newest(1)):
            pass
        assert time.monotonic() - start < 20
        with pytest.raises(ExecutorError):  # everything was stopped: nothing runs on half a cluster
            executor.wait([(executor.train[0].pid.remote(), "train rank 0")], 10.0, "ping")


def test_the_job_joins_a_running_cluster_with_ray_address_and_leaves_it_running(ray_cluster, tmp_path):
    from ray.util import placement_group_table

    address = ray_cluster.get_runtime_context().gcs_address
    out = tmp_path / "run"
    cmd = [sys.executable, str(ROOT / "experiments" / "grpo_math.py"), "--tiny", "--executor", "ray",
           "--ray-address", address, "--placement", "colocated", "--steps", "2", "--prompts-per-step", "2",
           "--samples-per-prompt", "2", "--max-new-tokens", "4", "--eval-size", "2", "--train-size", "20",
           "--eval-every", "0", "--checkpoint-every", "2", "--no-progress", "--threads", "1", "--out-dir", str(out)]
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
    done = processes.run(cmd, env=env, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert json.loads((out / "summary.json").read_text())["steps"] == 2
    assert (out / "checkpoints" / "step_00000002").is_dir()
    assert ray_cluster.is_initialized() and ray_cluster.get(ray_cluster.put(1)) == 1  # the cluster lives on
    assert all(pg["state"] == "REMOVED" for pg in placement_group_table().values())


def test_the_job_scores_with_a_reward_model_and_a_user_function_on_reward_workers(ray_cluster, tmp_path):
    from purerl.rewards.model import save_tiny_reward_model

    (tmp_path / "my_reward.py").write_text("def compute_score(data_source, solution_str, ground_truth, "
                                           "extra_info=None):\n    return 0.25 if data_source else -5.0\n")
    reward_model = save_tiny_reward_model(tmp_path / "rm")
    out = tmp_path / "run"
    cmd = [sys.executable, str(ROOT / "experiments" / "grpo_math.py"), "--tiny", "--executor", "ray",
           "--ray-address", ray_cluster.get_runtime_context().gcs_address, "--placement", "colocated",
           "--train-ranks", "1", "--reward-workers", "1", "--reward-model", str(reward_model),
           f"reward.fn={tmp_path / 'my_reward.py'}:compute_score", "reward.model_weight=0.5",
           "--steps", "2", "--prompts-per-step", "2", "--samples-per-prompt", "2", "--max-new-tokens", "4",
           "--eval-size", "2", "--train-size", "20", "--eval-every", "0", "--no-progress", "--threads", "1",
           "--out-dir", str(out)]
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
    done = processes.run(cmd, env=env, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["critic/score/mean"] == pytest.approx(0.25 + 0.5 * r["reward/model_mean"]
                                                       + r["reward/overlong_penalty_mean"], abs=1e-5)


def _make_budget_step_fn():
    optimizer = chain(clip_by_global_norm(1.0), adamw(1e-3, weight_decay=0.01))
    config = _job(actor={"kl_loss_coef": 0.1, "micro_batch_rows": 2, "max_tokens_per_micro_batch": 24})
    return functools.partial(grpo_step, optimizer=optimizer, kl_controller=make_kl_controller("fixed", coef=0.001),
                             **stage_settings_of(config))


def test_the_samples_do_not_depend_on_the_number_of_rollout_workers(ray_cluster):
    """Every worker samples its shard with the step's RNG and the prompts' own streams (no
    per-shard RNG): 3 workers (5 prompts: shards of 2, 2 and 1) draw the samples one local engine draws."""
    model, _, make_step_fn, fresh = _setup(2)
    local = TorchEngine(model, **ENGINE)
    local.sync(fresh().policy, 0)
    prompts, streams = [*PROMPTS, [14, 15], [16]], [9, 2, 7, 0, 5]
    sampling = SamplingParams(max_new_tokens=8, n=2, temperature=1.0)
    expected = local.generate(prompts, sampling, RngState(4), version=0, streams=streams)
    width = expected.sequences.response_length
    for workers in (3,):
        config = ExecutorConfig(kind="ray", train_ranks=1, rollout_workers=workers, step_timeout=120,
                                sync_timeout=60)
        with ray_executor.RayExecutor(StepFactory(make_step_fn), model, SETUP, config) as executor:
            executor.start(fresh())
            with executor.engine(executor.newest(0)) as engine:
                got = engine.generate(prompts, sampling, RngState(4), version=0, streams=streams)
        assert got.sequences.response_length == width
        assert torch.equal(got.sequences.responses(), expected.sequences.responses()), workers
        assert torch.equal(got.sequences.response_mask, expected.sequences.response_mask), workers


def _split(shared, model):
    """The shared split executor: 2 ranks running the token-budget GRPO step, a rollout worker, a generator."""
    return shared("split", lambda: ray_executor.RayExecutor(StepFactory(_make_budget_step_fn), model,
                                                            attrs.evolve(SETUP, generators=1), SPLIT))


class TestOneSplitExecutor:
    """Runs started one after another on one split executor (:func:`_split`): each start begins a run on the
    same workers, and the executor is closed when the class ends (its workers hold half the session's CPUs)."""

    @pytest.mark.parametrize("generators", [1])  # 2 generators: tests/test_async.py (local), and below (restarts)
    def test_async_with_staleness_zero_on_ray_is_the_synchronous_trainer_bit_for_bit(self, shared, tmp_path,
                                                                                     generators):
        """Generators on the rollout pool, ranks on the train pool: with k = 0 ("wait") every batch is
        sampled by the weights the synchronous loop would have used, so weights and metrics agree.
        Both runs on one executor, one after the other (a start begins a run on the same workers).
        With two generators, each with its rollout worker and one prompt group of two, the samples
        are the same (per-sample streams), the engine's log-probs equal up to float rounding (measured:
        it passes with ``[1, 2]``; the local test runs the two-generator case in the suite)."""
        model, _, _, fresh = _setup(2)
        task = _tiny_task()
        executor = _split(shared, model) if generators == 1 else shared(f"split, {generators} generators", lambda: (
            ray_executor.RayExecutor(StepFactory(_make_budget_step_fn), model,
                                     attrs.evolve(SETUP, generators=generators),
                                     attrs.evolve(SPLIT, rollout_workers=2))))
        results = {}
        for mode in ("sync", "async"):
            log = MetricsLog(tmp_path / mode)
            state = executor.start(fresh())
            common = dict(executor=executor, task=task, run_dir=tmp_path / mode, log=log)
            if mode == "sync":
                job = _job(steps=5)
                state, report = train(state, plan=batch_plan_of(job), trainer=job.trainer, **common), None
            else:
                job = _job(steps=5, asynchronous={"enable": True, "max_staleness": 0, "generators": generators})
                state, report = train_async(state, plan=batch_plan_of(job), trainer=job.trainer,
                                            asynchronous=job.asynchronous, **common)
            results[mode] = executor.full_state(state), list(MetricsLog.read(log.path)), report
            log.close()
        (sync_state, sync_records, _), (async_state, async_records, report) = results["sync"], results["async"]
        assert_async_k0_equals_sync(sync_state, sync_records, async_state, async_records, report, steps=5,
                                    logprob_tol=1e-5 if generators > 1 else 0.0)

    def test_async_on_ray_with_staleness_one_overlaps_and_stays_in_bounds(self, shared, tmp_path):
        model, _, _, fresh = _setup(2)
        job = _job(trainer={"steps": 6, "eval_every": 3, "progress": False},
                   asynchronous={"enable": True, "max_staleness": 1, "queue_batches": 1})
        log = MetricsLog(tmp_path)
        evaluated = []

        def evaluate_fn(state):  # runs on the rollout workers between two of the generator's batches
            with executor.engine(executor.newest(state.step), "evaluate") as engine:
                rollout = engine.generate(PROMPTS, SamplingParams(max_new_tokens=4, temperature=1.0, n=1), RngState(0),
                                          version=state.step)
            evaluated.append((state.step, rollout.version))
            return {"val/accuracy": 0.0}

        executor = _split(shared, model)
        state, report = train_async(executor.start(fresh()), executor=executor, task=_tiny_task(),
                                    plan=batch_plan_of(job), trainer=job.trainer, asynchronous=job.asynchronous,
                                    run_dir=tmp_path, log=log, evaluate_fn=evaluate_fn)
        assert executor.newest().version == 6  # the final weights, published for a final evaluation
        log.close()
        records = list(MetricsLog.read(log.path))
        assert state.step == 6 and [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
        assert set(report["staleness_histogram"]) <= {0, 1} and report["trained"] == report["generated"] == 6
        assert all(r["async/staleness"] <= 1 and r["async/queue_depth"] <= 1 for r in records)
        versions = [r["step"] - 1 - r["async/staleness"] for r in records]  # the weights each batch was sampled with
        assert versions == sorted(versions)
        assert evaluated == [(3, 3), (6, 6)]

    def test_offloading_params_and_optimizer_state_leaves_every_weight_unchanged(self, shared):
        """On CPU the offloaded tensors stay where they are, but the path runs: FSDP2's CPUOffloadPolicy
        and the optimizer state moved around each step; two steps give the same bits as without (the
        shared split executor, which offloads nothing)."""
        from purerl.executors.fsdp import Offload

        model, _, _, fresh = _setup(2)
        rollout = TorchEngine(model, **ENGINE)
        rollout.sync(fresh().policy, 0)
        batch = rollout.generate(PROMPTS, SamplingParams(max_new_tokens=6, n=4, temperature=1.0), RngState(1),
                                 version=0)
        scores = _even_tokens(batch)
        offloading = ray_executor.RayExecutor(
            StepFactory(_make_budget_step_fn), model,
            attrs.evolve(SETUP, generators=1, offload=Offload(params=True, optimizer=True)), SPLIT)
        finals = []
        with offloading:
            for executor in (_split(shared, model), offloading):
                state = executor.start(fresh())
                for _ in range(2):
                    state, _ = executor.step(state, batch, scores)
                finals.append(executor.full_state(state))
        plain, offloaded = finals
        assert tree_equal(plain.policy, offloaded.policy) and tree_equal(plain.policy_opt, offloaded.policy_opt)
        assert not tree_equal(plain.policy, fresh().policy)

    def test_token_budget_micro_batches_on_fsdp2_ranks_equal_the_local_step(self, shared):
        model, _, _, fresh = _setup(2)
        engine = TorchEngine(model, **ENGINE)
        engine.sync(fresh().policy, 0)
        batch = engine.generate(PROMPTS, SamplingParams(max_new_tokens=8, n=4, temperature=1.0), RngState(3), version=0)
        scores = _even_tokens(batch)
        executor = _split(shared, model)  # its ranks run _make_budget_step_fn's step
        state, metrics = executor.step(executor.start(fresh()), batch, scores)
        ray_full = executor.full_state(state)
        local_state, local_metrics = LocalExecutor(_make_budget_step_fn(), model, engine).step(fresh(), batch, scores)
        for name, value in local_state.policy.items():
            torch.testing.assert_close(ray_full.policy[name], value, rtol=0, atol=1e-5)
        for key, value in local_metrics.items():
            assert metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key


def _generator(shared, model):
    """The shared executor of a generator whose rollout worker is given up after 2 s and checked by the
    weight-sync canary after each load (its rank never steps)."""
    from purerl.rollout.canary import Canary

    config = ExecutorConfig(kind="ray", train_ranks=1, rollout_workers=1, placement="split")
    return shared("generator", lambda: ray_executor.RayExecutor(
        _sleeping_step, Roles(model, canary=Canary(model, tolerance=5e-2)),
        attrs.evolve(SETUP, generators=1, generate_timeout=2.0), config))


class TestOneGeneratorExecutor:
    """Runs started one after another on one generator's executor (:func:`_generator`), closed when the
    class ends."""

    def test_a_hung_generator_worker_is_given_up_after_the_generate_timeout_and_restarted(self, shared):
        """A generator's rollout worker that outlasts ``generate_timeout`` fails that generator alone
        (the ranks keep running); restarting it starts a new worker, which loads the weights again
        and samples what the old one sampled."""
        model, _, _, fresh = _setup(4)
        sampling = SamplingParams(max_new_tokens=8, temperature=1.0, n=2)
        executor = _generator(shared, model)
        executor.start(fresh())
        with executor.engine(executor.newest(0)) as engine:
            before = engine.generate(PROMPTS, sampling, RngState(1), version=0)
        executor.wait([(executor.rollout[0].straggle.remote(10_000.0), "rollout worker 0")], 30.0, "straggle")
        start = time.monotonic()
        with pytest.raises(ExecutorError, match=r"generate: rollout worker 0 did not answer within 2 s"), \
                executor.engine(executor.newest(0)) as engine:
            engine.generate(PROMPTS, sampling, RngState(1), version=0)
        assert time.monotonic() - start < 15 and executor.broken == {0}
        executor.wait([(executor.train[0].pid.remote(), "train rank 0")], 10.0, "ping")  # nothing else stopped
        executor.restart_generator(0)
        with executor.engine(executor.newest(0)) as engine:
            after = engine.generate(PROMPTS, sampling, RngState(1), version=0)
        assert executor.broken == set()
        assert torch.equal(after.sequences.input_ids, before.sequences.input_ids)

    def test_a_generators_rollout_worker_checks_each_load_and_a_corrupted_one_stops_the_run(self, shared):
        """Asynchronous generators' rollout workers run the weight-sync canary after each load (a batch
        they sample may be older than any version a step checks): a tensor scaled on its way into the
        engine is named with the worker and the version, and no restart is tried."""
        from purerl.rollout.canary import CanaryError

        model, _, _, fresh = _setup(4)
        executor = _generator(shared, model)
        executor.start(fresh())
        with executor.engine(executor.newest(0)) as engine:  # version 0 loads and passes
            engine.generate(PROMPTS, SamplingParams(max_new_tokens=4, n=1), RngState(1), version=0)
        executor.wait([(executor.rollout[0].scramble.remote(3.0), "rollout worker 0")], 30.0, "scramble")
        with pytest.raises(CanaryError, match=r"rollout worker 0 at weights version 0: .* nats per token"):
            executor.reload(executor.newest(0))
