"""Procedural math word problems with exact integer answers.

Each problem is a short story over random names, objects and numbers; the answer is computed,
not stored, so it is exact. Difficulty 1 is one addition or subtraction of single-digit numbers,
2 the same with numbers up to 20, 3 chains two operations, 4 adds multiplication and exact
division. Level 5 multiplies two 3-digit numbers (and adds a 3-digit one half the time): numbers
a small model cannot work out in its head, which a calculator tool can
(:mod:`purerl.episodes.calculator`). A held-out split is a different seed with every
question that also occurs in the training split removed.

Every problem keeps the expression that computes its answer (``extra["expression"]``, a calculator
call) and its worked answer as the task asks for it (``extra["answer"]``: the one-line computation,
then ``#### <answer>``; where verl's GSM8K data keeps its worked solutions): the SFT warm-up's
demonstrations (``env.sft_steps``).
"""

import random
from collections.abc import Callable

from purerl.data.records import PromptRecord

__all__ = ["DIFFICULTIES", "INSTRUCTION", "math_problem", "math_problems", "train_eval_split"]

INSTRUCTION = "Give a short answer. End with '#### <number>'."
_NAMES = ["Tom", "Ana", "Li", "Sara", "Omar", "Maya", "Ben", "Ivy", "Raj", "Zoe", "Eli", "Nia"]
_THINGS = ["apples", "marbles", "books", "pencils", "stickers", "cookies", "coins", "shells", "cards", "eggs"]


def _one_step(r: random.Random, a: int, b: int) -> tuple[str, int, str]:
    name, thing = r.choice(_NAMES), r.choice(_THINGS)
    if r.random() < 0.5:
        return (f"{name} has {a} {thing}. {name} gets {b} more {thing}. How many {thing} does {name} have now?",
                a + b, f"{a} + {b}")
    a = a + b
    return (f"{name} has {a} {thing}. {name} gives away {b} {thing}. How many {thing} does {name} have left?",
            a - b, f"{a} - {b}")


def _level1(r: random.Random) -> tuple[str, int, str]:
    return _one_step(r, r.randint(1, 9), r.randint(1, 9))


def _level2(r: random.Random) -> tuple[str, int, str]:
    return _one_step(r, r.randint(2, 20), r.randint(1, 15))


def _level3(r: random.Random) -> tuple[str, int, str]:
    name, other, thing = r.choice(_NAMES), r.choice(_NAMES), r.choice(_THINGS)
    a, b, c = r.randint(5, 30), r.randint(2, 20), r.randint(1, 10)
    if r.random() < 0.5:
        return (f"{name} has {a} {thing}. {other} gives {name} {b} more. Then {name} loses {c}. "
                f"How many {thing} does {name} have now?", a + b - c, f"{a} + {b} - {c}")
    k = r.randint(2, 5)
    return (f"{name} buys {k} bags with {c + 1} {thing} in each bag and already had {b} {thing}. "
            f"How many {thing} does {name} have in total?", k * (c + 1) + b, f"{k} * {c + 1} + {b}")


def _level4(r: random.Random) -> tuple[str, int, str]:
    name, thing = r.choice(_NAMES), r.choice(_THINGS)
    per, groups, extra = r.randint(2, 12), r.randint(2, 9), r.randint(1, 20)
    if r.random() < 0.5:
        total = per * groups
        return (f"{name} shares {total} {thing} equally among {groups} friends and then finds {extra} more "
                f"for one friend. How many {thing} does that friend have?", per + extra,
                f"{total} / {groups} + {extra}")
    extra = r.randint(1, groups * per - 1)
    return (f"{name} packs {groups} boxes with {per} {thing} each and gives away {extra} of them. "
            f"How many {thing} are left?", groups * per - extra, f"{groups} * {per} - {extra}")


def _level5(r: random.Random) -> tuple[str, int, str]:
    name, thing = r.choice(_NAMES), r.choice(_THINGS)
    boxes, per = r.randint(100, 999), r.randint(100, 999)
    if r.random() < 0.5:
        return (f"{name} packs {boxes} boxes with {per} {thing} in each box. How many {thing} are there?",
                boxes * per, f"{boxes}*{per}")
    extra = r.randint(100, 999)
    return (f"{name} has {extra} {thing} and buys {boxes} bags with {per} {thing} in each bag. "
            f"How many {thing} does {name} have now?", boxes * per + extra, f"{boxes}*{per}+{extra}")


_LEVELS: dict[int, Callable[[random.Random], tuple[str, int, str]]] = {1: _level1, 2: _level2, 3: _level3,
                                                                      4: _level4, 5: _level5}
"""Each level draws (question, answer, the Python expression that computes the answer)."""
DIFFICULTIES = tuple(sorted(_LEVELS))
"""The procedural difficulty levels."""


def math_problem(r: random.Random, difficulty: int) -> PromptRecord:
    """One problem of the given difficulty (:data:`DIFFICULTIES`) drawn from ``r``."""
    if difficulty not in _LEVELS:
        raise ValueError(f"math_problem: difficulty must be one of {sorted(_LEVELS)}, got {difficulty}")
    question, answer, expression = _LEVELS[difficulty](r)
    return PromptRecord(
        messages=({"role": "user", "content": f"{question}\n{INSTRUCTION}"},),
        ground_truth=str(answer),
        data_source=f"purerl/math_level{difficulty}",
        extra={"question": question, "expression": expression, "answer": f"{expression} = {answer}\n#### {answer}"},
    )


def math_problems(n: int, *, seed: int, difficulties: tuple[int, ...] = (1,)) -> list[PromptRecord]:
    """``n`` distinct problems, difficulties cycled in order, reproducible from ``seed``."""
    r = random.Random(seed)
    seen: set[str] = set()
    out: list[PromptRecord] = []
    attempts = 0
    while len(out) < n:
        attempts += 1
        if attempts > 50 * n + 1000:
            raise ValueError(f"math_problems: could not draw {n} distinct problems at difficulties {difficulties}")
        record = math_problem(r, difficulties[len(out) % len(difficulties)])
        if record.extra["question"] not in seen:
            seen.add(record.extra["question"])
            out.append(record)
    return out


def train_eval_split(n_train: int, n_eval: int, *, seed: int = 0,
                     difficulties: tuple[int, ...] = (1,)) -> tuple[list[PromptRecord], list[PromptRecord]]:
    """Training problems from ``seed`` and held-out problems from another seed, disjoint by question."""
    train = math_problems(n_train, seed=seed, difficulties=difficulties)
    questions = {r.extra["question"] for r in train}
    pool = math_problems(n_eval * 2 + 50, seed=seed + 1_000_003, difficulties=difficulties)
    held_out = [r for r in pool if r.extra["question"] not in questions][:n_eval]
    if len(held_out) < n_eval:
        raise ValueError("train_eval_split: not enough distinct held-out problems")
    return train, held_out
