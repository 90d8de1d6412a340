"""Answer extraction, exact checking, and scoring that survives crashing or hanging reward functions."""

import os
import threading
import time

import pytest

from purerl.rewards import (
    answers_equal,
    extract_answer,
    lenient_math_reward,
    math_reward,
    math_reward_with_format,
    score_in_threads,
    score_responses,
)


@pytest.mark.parametrize(
    ("text", "strict", "expected"),
    [
        ("so the answer is 12.\n#### 12", True, "12"),
        ("#### 3 then later #### 1,234", True, "1,234"),
        ("the result is \\boxed{\\frac{1}{2}}", True, "\\frac{1}{2}"),
        ("I think it is 7 apples", True, None),
        ("I think it is 7 apples, no, 8", False, "8"),
        ("#### $-5", True, "-5"),
        ("nothing here", False, None),
    ],
)
def test_extract_answer(text, strict, expected):
    assert extract_answer(text, strict=strict) == expected


def test_answers_are_compared_as_exact_numbers():
    assert answers_equal("1,234", "1234")
    assert answers_equal("0.5", "1/2")
    assert answers_equal("12.", "12")
    assert not answers_equal("12", "13")
    assert not answers_equal("0.3333", "1/3")


def test_math_reward_and_format_bonus():
    assert math_reward("#### 8", "8") == 1.0
    assert math_reward("8", "8") == 0.0  # strict: the answer must follow '####' or be boxed
    assert math_reward_with_format("#### 7", "8", format_bonus=0.1) == pytest.approx(0.1)
    assert math_reward_with_format("#### 8", "8", format_bonus=0.1) == pytest.approx(1.1)
    assert math_reward_with_format("eight", "8") == 0.0
    assert lenient_math_reward("so 3 + 5 = 8 apples", "8") == 1.0
    assert lenient_math_reward("#### 9, not 8", "8") == 0.0  # an explicit answer wins over the last number
    assert lenient_math_reward("no idea", "8") == 0.0


def test_a_raising_or_hanging_reward_gives_a_penalty_and_the_run_goes_on():
    def flaky(response: str, truth: str) -> float:
        if response == "boom":
            raise RuntimeError("reward server down")
        if response == "hang":
            time.sleep(60)
        if response == "nan":
            return float("nan")
        return 1.0

    start = time.monotonic()
    scores = score_responses(flaky, ["ok", "boom", "hang", "nan", "ok"], ["1"] * 5, timeout=0.5, penalty=-1.0)
    assert time.monotonic() - start < 5
    assert scores.values == [1.0, -1.0, -1.0, -1.0, 1.0]
    assert scores.errors == 2 and scores.timeouts == 1
    assert any("reward server down" in m for m in scores.error_messages)
    assert any("timed out" in m for m in scores.error_messages)


def test_scoring_threads_are_reused_and_a_hung_one_is_never_handed_new_work():
    release = threading.Event()

    def reward(response: str, truth: str) -> float:
        if response == "hang":
            release.wait(30)
        return float(len(response))

    score_in_threads(reward, ["a"] * 8, ["1"] * 8)
    threads = threading.active_count()
    for _ in range(5):
        assert score_in_threads(reward, ["ab"] * 8, ["1"] * 8).values == [2.0] * 8
    assert threading.active_count() == threads

    hung = score_in_threads(reward, ["hang", "abc"], ["1", "1"], timeout=0.3, penalty=-1.0)
    assert hung.values == [-1.0, 3.0] and hung.timeouts == 1
    start = time.monotonic()
    assert score_in_threads(reward, ["a"] * 8, ["1"] * 8, timeout=5.0).values == [1.0] * 8
    assert time.monotonic() - start < 1.0  # the stuck thread was not waited for
    release.set()


def test_slow_calls_overlap_after_the_grace_period():
    # one thread takes the calls in turn; those still waiting after `grace` get threads of their own
    def slow(response: str, truth: str) -> float:
        time.sleep(0.3)
        return 1.0

    start = time.monotonic()
    scores = score_in_threads(slow, ["a"] * 8, ["1"] * 8, timeout=1.5, grace=0.05)
    assert scores.values == [1.0] * 8 and scores.timeouts == 0  # in turn, 8 calls would take 2.4 s
    assert time.monotonic() - start < 1.2


def spinning_reward(response: str, truth: str) -> float:
    """Module level, so it pickles and scores in a process; "spin" never returns (pure Python,
    holding the GIL: no thread could ever stop it)."""
    if response == "spin":
        while True:
            pass
    if response == "exit":
        os._exit(3)
    if response == "boom":
        raise RuntimeError("reward server down")
    return float(len(response))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_reward_spinning_in_pure_python_costs_one_sample_its_timeout_in_a_killed_process():
    from purerl.rewards.scoring import _PROCESSES

    score_responses(spinning_reward, ["a", "bb"], ["1", "1"])  # start the processes
    before = {p.process.pid for p in _PROCESSES.idle}
    start = time.monotonic()
    scores = score_responses(spinning_reward, ["spin", "ab", "exit", "boom", "abcd"], ["1"] * 5,
                             timeout=1.0, penalty=-1.0, first_index=10)
    assert time.monotonic() - start < 8
    assert scores.values == [-1.0, 2.0, -1.0, -1.0, 4.0]
    assert scores.timeouts == 1 and scores.errors == 2
    assert scores.error_messages[0] == "sample 10: timed out after 1 s"
    assert "sample 12: the reward process died (exit code 3)" in scores.error_messages
    assert "sample 13: RuntimeError: reward server down" in scores.error_messages
    after = {p.process.pid for p in _PROCESSES.idle}
    stopped = before - after
    assert stopped and not any(_alive(pid) for pid in stopped)  # the spinning and the exited ones are gone
    assert score_responses(spinning_reward, ["a"] * 6, ["1"] * 6).values == [1.0] * 6  # the pool goes on


def test_an_unpicklable_reward_runs_on_threads_with_a_warning(caplog):
    scores = score_responses(lambda response, truth: 2.0, ["a", "b"], ["1", "1"])
    assert scores.values == [2.0, 2.0]
    assert "does not pickle" in caplog.text and "runs on threads" in caplog.text


def test_absurd_numeric_answers_are_rejected_cheaply():
    start = time.monotonic()
    assert not answers_equal("1e999999999", "1") and not answers_equal("1" * 5000, "1")
    assert answers_equal("1e3", "1000") and answers_equal("3/4", "0.75")
    assert time.monotonic() - start < 1.0
