"""The panel's tasks: four kinds a 135M model can learn at some setting, none of them the main job's.

Each task is a generator of ``(question, answer)`` pairs from a ``random.Random``; :func:`task_records`
turns them into verl-format rows (``prompt`` as chat messages, ``reward_model.ground_truth``,
``data_source``) with held-out questions disjoint from the training ones, so a panel run trains on
its own data exactly as a user's task would (``--data``/``--eval-data``):

- ``sums``: two numbers of 1–2 digits added (``What is 23 + 45?``), the default reward;
- ``count``: the items of a short list counted (``How many items are in this list: …``), the default reward;
- ``reverse``: a few words in reverse order (a string task), scored by :func:`reverse_reward`;
- ``ages``: a one-step word problem about ages and years, unlike the main job's objects, the default reward;
- ``young_ages``: the same problems about children (ages 2–9, 1–5 years), which SmolLM2-135M starts
  inside the 2–30 % band (7.8 % held out), where ``ages`` starts at 0 %.

The numeric tasks end with the main job's instruction (``#### <number>``), which the default reward
(``lenient``: the last number) reads; ``reverse`` asks for ``#### <words>``.
"""

import random
import re
from collections.abc import Callable

__all__ = ["TASKS", "reverse_reward", "task_records"]

_NUMBER = "Give a short answer. End with '#### <number>'."
_WORDS = "Give a short answer. End with '#### <words>'."
_NOUNS = ["cat", "dog", "sun", "tree", "book", "cup", "fish", "bird", "lamp", "door", "rain", "star", "milk",
          "shoe", "hat", "boat", "cake", "ring", "bell", "leaf"]
_NAMES = ["Tom", "Ana", "Li", "Sara", "Omar", "Maya", "Ben", "Ivy", "Raj", "Zoe", "Eli", "Nia"]


def _sums(r: random.Random) -> tuple[str, str]:
    a, b = r.randint(1, 99), r.randint(1, 99)
    return f"What is {a} + {b}? {_NUMBER}", str(a + b)


def _count(r: random.Random) -> tuple[str, str]:
    items = r.sample(_NOUNS, r.randint(3, 8))
    return f"How many items are in this list: {', '.join(items)}? {_NUMBER}", str(len(items))


def _reverse(r: random.Random) -> tuple[str, str]:
    words = r.sample(_NOUNS, r.randint(2, 4))
    return f"Write these words in reverse order: {' '.join(words)}. {_WORDS}", " ".join(reversed(words))


def _ages(r: random.Random, ages: tuple[int, int] = (3, 40), spans: tuple[int, int] = (1, 20)) -> tuple[str, str]:
    name, age, years = r.choice(_NAMES), r.randint(*ages), r.randint(*spans)
    if r.random() < 0.5:
        return f"{name} is {age} years old. How old will {name} be in {years} years? {_NUMBER}", str(age + years)
    age += years
    return f"{name} is {age} years old. How old was {name} {years} years ago? {_NUMBER}", str(age - years)


def _young_ages(r: random.Random) -> tuple[str, str]:
    return _ages(r, ages=(2, 9), spans=(1, 5))


TASKS: dict[str, tuple[Callable[[random.Random], tuple[str, str]], str | None]] = {
    "sums": (_sums, None),
    "count": (_count, None),
    "reverse": (_reverse, "reverse_reward"),
    "ages": (_ages, None),
    "young_ages": (_young_ages, None),
}
"""Each task's generator and its reward function in this file (None: the job's default reward)."""


def task_records(task: str, train: int, held_out: int, *, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """``train`` and ``held_out`` verl-format rows of ``task``, drawn from ``seed``; no held-out
    question is also a training one (the held-out rows are drawn first, from another stream)."""
    generate, _ = TASKS[task]
    held: dict[str, str] = {}
    r = random.Random(f"{task}/held_out/{seed}")
    for _ in range(held_out * 50):
        if len(held) == held_out:
            break
        question, answer = generate(r)
        held.setdefault(question, answer)
    rows: list[tuple[str, str]] = []
    r = random.Random(f"{task}/train/{seed}")
    for _ in range(train * 50):
        if len(rows) == train:
            break
        question, answer = generate(r)
        if question not in held:
            rows.append((question, answer))
    if len(held) < held_out or len(rows) < train:
        raise ValueError(f"panel task {task}: only {len(held)} held-out and {len(rows)} training questions exist")

    def row(question: str, answer: str) -> dict:
        return {"data_source": f"panel/{task}", "prompt": [{"role": "user", "content": question}],
                "reward_model": {"style": "rule", "ground_truth": answer}}

    return [row(*pair) for pair in rows], [row(*pair) for pair in held.items()]


def _final_words(response: str) -> str:
    """What a response answers: the text after its last ``####`` (else its last non-empty line), in
    lower case, with punctuation and repeated spaces gone."""
    text = response.rsplit("####", 1)[1] if "####" in response else (response.strip().splitlines() or [""])[-1]
    return " ".join(re.sub(r"[^\w\s]", " ", text.lower()).split())


def reverse_reward(response: str, ground_truth: str) -> float:
    """1 when the response's answer is the words of ``ground_truth`` in that order, else 0."""
    return float(_final_words(response) == " ".join(ground_truth.lower().split()))
