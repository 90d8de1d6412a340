"""The stop messages of :class:`~purerl.loop.recording.StepRecorder` name the true cause: a reward
function that fails on every call stops the run naming it and its exception, and advises no smaller
learning rate (that advice belongs to updates that diverged)."""

import pytest

from purerl.loop.recording import StepRecorder, TrainingStopped
from tests.jobs import run_job


def _at(step):
    from purerl.state import RngState, TrainState

    return TrainState(policy={}, policy_opt=None, kl=None, rng=RngState(0), step=step)


def _recorder(run_dir, step, **kwargs):
    """A step recorder of a run at ``step`` that stops after 2 steps of failed rewards (its executor checkpoints
    nothing here)."""
    from purerl.assembly.stages import step_function
    from purerl.config.job import JobConfig, TrainerConfig
    from purerl.config.loading import build
    from purerl.executors.local import LocalExecutor
    from purerl.io.metrics import MetricsLog
    from purerl.rollout.backends.torch import TorchEngine
    from purerl.tiny import tiny_causal_lm

    model, _ = tiny_causal_lm(seed=0)
    executor = LocalExecutor(step_function(build(JobConfig, {})), model,
                             TorchEngine(model, eos_token_ids=[1], pad_token_id=0))
    settings = TrainerConfig(progress=False, checkpoint_every=0, max_failed_reward_steps=2)
    return StepRecorder(_at(step), executor, settings, run_dir, MetricsLog(run_dir), **kwargs)


def _failed(*messages):
    return {"reward/all_failed": 1.0, "reward/error_messages": [f"sample {i}: {m}" for i, m in enumerate(messages)],
            "perf/gen_tokens_per_s": 1.0}


def test_a_reward_that_raises_on_every_call_stops_naming_the_exception_without_learning_rate_advice(tmp_path):
    (tmp_path / "checkpoints" / "step_00000004").mkdir(parents=True)
    record = _recorder(tmp_path, 4)
    record(_at(5), _failed("KeyError: 'answer'", "KeyError: 'answer'"))
    with pytest.raises(TrainingStopped) as stopped:
        record(_at(6), _failed("KeyError: 'answer'"))
    message = str(stopped.value)
    assert "every reward call failed or timed out in 2 steps in a row" in message
    assert "reward.fn raised KeyError: 'answer'" in message and "learning rate" not in message
    assert "--resume continues from the newest checkpoint" in message and "step_00000004" in message
    assert "diverged_" not in message and "\n" not in message
    assert (tmp_path / "checkpoints" / "step_00000004").is_dir()  # nothing set aside: the weights are sound


def test_the_stop_names_the_reward_function_the_loop_gives_and_a_timeout_as_a_timeout(tmp_path):
    record = _recorder(tmp_path / "a", 0, reward_fn="rewards.py:broken")
    record(_at(1), _failed("ValueError: no grader\nsecond line", "TypeError: b"))
    with pytest.raises(TrainingStopped, match=r"reward.fn rewards.py:broken raised ValueError: no grader \(and 1 "
                                              r"other kinds\) \(every call in .*\); fix it, then rerun "
                                              r"\(--overwrite\): no checkpoint was written$"):
        record(_at(2), _failed("ValueError: no grader\nsecond line", "TypeError: b"))
    record = _recorder(tmp_path / "b", 0, reward_fn="rewards.py:slow")
    record(_at(1), _failed("timed out after 10 s"))
    with pytest.raises(TrainingStopped, match=r"reward.fn rewards.py:slow: timed out after 10 s \(reward.timeout, "
                                              r"reward.batch_timeout\)"):
        record(_at(2), _failed("timed out after 10 s"))


@pytest.mark.slow
def test_a_job_whose_reward_always_raises_stops_with_the_exception_and_no_learning_rate_advice(tmp_path):
    (tmp_path / "rewards_that_raise.py").write_text("def broken(response, ground_truth):\n"
                                                    "    raise KeyError('answer')\n")
    argv = ["--tiny", "--steps", "4", "--prompts-per-step", "2", "--samples-per-prompt", "2", "--max-new-tokens",
            "4", "--eval-size", "2", "--train-size", "20", "--eval-every", "0", "--checkpoint-every", "1",
            "--no-progress", "--threads", "1", f"reward.fn={tmp_path / 'rewards_that_raise.py'}:broken",
            "trainer.max_failed_reward_steps=2", "--out-dir", str(tmp_path / "run")]
    with pytest.raises(TrainingStopped) as stopped:
        run_job(argv)
    message = str(stopped.value)
    assert "raised KeyError: 'answer'" in message and "learning rate" not in message, message
    assert "step_00000001" in message, message


def test_a_response_holds_its_reference_as_a_whole_token_only():
    from purerl.loop.sampling import holds_reference

    assert holds_reference("so the answer is 42.", "42") and holds_reference("#### 7", " 7 ")
    assert not holds_reference("1420", "42") and not holds_reference("3.42", "42") and not holds_reference("x", "")


def test_the_batch_reports_the_task_rewards_spread_and_how_responses_holding_their_reference_scored():
    """What the monitor's constant_reward and reward.fn checks read, from a real batch of the tiny task:
    a reward that accepts everything has no spread whatever the shaping; one that scores 0 a response
    holding its reference shows in ``health/reference_unrewarded_frac``."""
    import attrs

    from purerl.data.cursor import DataCursor
    from purerl.loop.sampling import sample_batch
    from purerl.loop.tiny import tiny_math
    from purerl.state import RngState

    tiny = tiny_math()
    tiny.engine.sync(tiny.params, 0)
    answers = [r.ground_truth for r in tiny.task.records]

    def batch_metrics(reward_fn, decode=tiny.task.decode):
        task = attrs.evolve(tiny.task, reward_fn=reward_fn, decode=decode)
        return sample_batch(tiny.engine, task, tiny.plan, DataCursor(0, 0, 0), RngState(0), 0)[2]

    always = batch_metrics(lambda response, truth: 1.0)
    assert always["health/rule_spread"] == 0.0 and always["health/rule_positive_frac"] == 1.0
    # every response "says" its reference (a decode that names every answer), and a reward that scores it 0
    says_all = " ".join(answers)
    never = batch_metrics(lambda response, truth: 0.0, decode=lambda ids: says_all)
    assert never["health/reference_held_frac"] == 1.0 and never["health/reference_unrewarded_frac"] == 1.0
    fair = batch_metrics(lambda response, truth: float(truth in response), decode=lambda ids: says_all)
    assert fair["health/reference_held_frac"] == 1.0 and fair["health/reference_unrewarded_frac"] == 0.0
