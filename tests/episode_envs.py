"""Environments and tools for the episode tests, at module level so the reward processes that run
environment steps can import them."""

import os
import random
import time

from purerl.episodes import StepResult


def hang(x: str) -> str:
    time.sleep(60)
    return x


def crash(x: str) -> str:
    raise RuntimeError("the tool broke")


def die(x: str) -> str:
    os._exit(3)


def slow(x: str) -> str:
    time.sleep(0.5)
    return f"slow {x}"


class GuessEnv:
    """Guess a number from 1 to 100 drawn per seed; the reply says higher or lower."""

    stop = ()

    def reset(self, task, seed):
        target = random.Random(seed).randint(1, 100)
        return target, [{"role": "user", "content": f"Guess my number ({task.ground_truth})."}]

    def step(self, state, action):
        digits = "".join(c for c in action if c.isdigit())
        guess = int(digits) if digits else 0
        if guess == state:
            return state, [], 1.0, True
        return StepResult(state, [{"role": "user", "content": "higher" if guess < state else "lower"}], 0.0, False)


class Counter:
    """TRL's environment_factory convention: reset(**row), tools as public methods, get_reward()."""

    def reset(self, **row):
        self.count = 0
        return f" Reach {row['ground_truth']}."

    def increment(self, step: int) -> int:
        """Add to the counter.

        Args:
            step: How much to add.
        """
        self.count += step
        return self.count

    def get_reward(self) -> float:
        return float(self.count == 3)


class Broken:
    """reset fails on a row without 'size'; step returns a bare reward."""

    stop = ()

    def reset(self, task, seed):
        return task.extra["size"], list(task.messages)

    def step(self, state, action):
        return 1.0


class _Returns:
    """One turn that returns ``self.result(state)``: an environment that breaks the protocol."""

    stop = ()

    def reset(self, task, seed):
        return seed, list(task.messages)

    def step(self, state, action):
        return self.result(state)


class NoneReward(_Returns):
    def result(self, state):
        return StepResult(state, [], None, True, "answer")


class StringReward(_Returns):
    def result(self, state):
        return StepResult(state, [], "good", True, "answer")


class NaNReward(_Returns):
    def result(self, state):
        return state, [], float("nan"), True


class StringMessages(_Returns):
    def result(self, state):
        return StepResult(state, "just a string", 0.0, False)


class RoleLessMessage(_Returns):
    def result(self, state):
        return StepResult(state, [{"content": "no role"}], 0.0, False)


class DictResult(_Returns):
    def result(self, state):
        return {"state": state, "reward": 1.0}


class NoReward(Counter):
    """TRL's convention, with a get_reward that returns None."""

    def get_reward(self):
        return None


class HugeObservation(_Returns):
    """A tool that answers with 10 MB of text."""

    def result(self, state):
        return StepResult(state, [{"role": "tool", "content": "0123456789" * 1_000_000}], 0.0, False)


class LockedState:
    """A state holding a lock: it neither pickles nor copies."""

    stop = ()

    def reset(self, task, seed):
        import threading

        return (threading.Lock(), seed), list(task.messages)

    def step(self, state, action):
        return StepResult(state, [], 1.0, True, "answer")


class StringReset(_Returns):
    """``reset`` returns the first message's text instead of ``(state, messages)``."""

    def reset(self, task, seed):
        return task.messages[0]["content"]

    def result(self, state):
        return StepResult(state, [], 1.0, True, "answer")
