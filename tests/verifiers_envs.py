"""verifiers environments defined here (nothing downloaded), for tests/test_agents.py: the
classic API's SingleTurnEnv and a MultiTurnEnv, with rubrics."""

import verifiers as vf
from datasets import Dataset

_DATA = Dataset.from_list([{"prompt": [{"role": "user", "content": "What is 2+2?"}], "answer": "4"}])


def _ends_with_answer(completion, answer, **kwargs) -> float:
    return float(completion[-1]["content"].strip().endswith(answer))


def _has_a_digit(completion, **kwargs) -> float:
    return float(any(c.isdigit() for c in completion[-1]["content"]))


def load_environment():
    """A SingleTurnEnv: one answer, its last characters the answer (weight 1), a digit in it (0.5)."""
    return vf.SingleTurnEnv(dataset=_DATA, system_prompt="Answer with a number.",
                            rubric=vf.Rubric(funcs=[_ends_with_answer, _has_a_digit], weights=[1.0, 0.5]))


class Again(vf.MultiTurnEnv):
    """Every answer is met with "Try again."; three turns."""

    async def env_response(self, messages, state, **kwargs):
        return [vf.UserMessage(content="Try again.")]


def load_multi_turn():
    return Again(dataset=_DATA, rubric=vf.Rubric(funcs=[_has_a_digit]), max_turns=3)


multi_turn = load_multi_turn()


def square(x: int) -> str:
    """Square a number.

    Args:
        x: The number.
    """
    return str(x * x)


def load_tool_env():
    """A ToolEnv with one tool; its rubric: the last answer ends with the answer."""
    return vf.ToolEnv(dataset=_DATA, tools=[square], rubric=vf.Rubric(funcs=[_ends_with_answer]), max_turns=3)


tool_env = load_tool_env()
