"""Two environments to copy from, one per convention ``env.name`` accepts (README: Multi-turn episodes).

    python experiments/grpo_math.py --tiny --env examples/environments.py:GuessNumber --max-turns 4
    python experiments/grpo_math.py --tiny --env examples/environments.py:Counter --max-turns 3

``GuessNumber`` is purerl's ``Env``: explicit state, returned by ``reset`` and ``step``, so every
sample of a group starts from the same number. ``Counter`` is TRL's ``environment_factory``
convention: an object with ``reset(**row)``, tools as public methods (typed, with a docstring),
``get_reward()``. Both must live in an importable file (not a script's ``__main__``) so their
steps run in the reward processes under ``env.step_timeout``.
"""

import random

from purerl.episodes import StepResult


class GuessNumber:
    """Guess a number from 1 to 100, drawn per task seed; each wrong guess is answered "higher" or
    "lower". Reward 1 for the number, and 0.1 per turn closer than the one before
    (``env.per_turn_rewards`` puts each on its turn)."""

    stop = ()

    def reset(self, task, seed):
        target = random.Random(seed).randint(1, 100)
        prompt = "I am thinking of a number from 1 to 100. Guess it: answer with the number only."
        return (target, None), [{"role": "user", "content": prompt}]

    def step(self, state, action):
        target, before = state
        digits = "".join(c for c in action if c.isdigit())[:3]
        guess = int(digits) if digits else 0
        if guess == target:
            return StepResult(state, [], 1.0, True, "answer")
        closer = 0.1 if before is not None and abs(guess - target) < abs(before - target) else 0.0
        hint = "higher" if guess < target else "lower"
        return StepResult((target, guess), [{"role": "user", "content": f"{guess} is wrong: {hint}."}], closer, False)


class Counter:
    """TRL's convention: make the counter reach the task's ground truth with ``increment`` calls
    (``<increment>2</increment>`` with ``env.format = "tags"``, a ``<tool_call>`` with ``json``)."""

    def reset(self, **row):
        self.count, self.goal = 0, int(row["ground_truth"])
        return f" Use the increment tool until the counter is {self.goal}, then say done."

    def increment(self, step: int) -> int:
        """Add to the counter and return its value.

        Args:
            step: How much to add.
        """
        self.count += int(step)
        return self.count

    def get_reward(self) -> float:
        return float(self.count == self.goal)
