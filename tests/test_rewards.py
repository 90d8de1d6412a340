"""Answer extraction, exact checking, and scoring that survives crashing or hanging reward functions."""

import threading
import time

import pytest

from purerl.rewards import (
    answers_equal,
    extract_answer,
    lenient_math_reward,
    math_reward,
    math_reward_with_format,
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

    score_responses(reward, ["a"] * 8, ["1"] * 8)
    threads = threading.active_count()
    for _ in range(5):
        assert score_responses(reward, ["ab"] * 8, ["1"] * 8).values == [2.0] * 8
    assert threading.active_count() == threads

    hung = score_responses(reward, ["hang", "abc"], ["1", "1"], timeout=0.3, penalty=-1.0)
    assert hung.values == [-1.0, 3.0] and hung.timeouts == 1
    start = time.monotonic()
    assert score_responses(reward, ["a"] * 8, ["1"] * 8, timeout=5.0).values == [1.0] * 8
    assert time.monotonic() - start < 1.0  # the stuck thread was not waited for
    release.set()


def test_slow_calls_overlap_after_the_grace_period():
    # one thread takes the calls in turn; those still waiting after `grace` get threads of their own
    def slow(response: str, truth: str) -> float:
        time.sleep(0.3)
        return 1.0

    start = time.monotonic()
    scores = score_responses(slow, ["a"] * 8, ["1"] * 8, timeout=1.5, grace=0.05)
    assert scores.values == [1.0] * 8 and scores.timeouts == 0  # in turn, 8 calls would take 2.4 s
    assert time.monotonic() - start < 1.2
