"""The calculator task: arithmetic word problems (``data.difficulty = [5]``: 3-digit × 3-digit
products) answered in episodes where the model may call a calculator first.

With the tool the model has to copy the operands into ``<calc>…</calc>`` and the result into its
answer; without it (``env.tools = false``, the baseline) it has to multiply in its head.
:func:`demonstration` writes the transcript of a correct episode, for the supervised warm-up
(``env.sft_steps``).
"""

import json
from collections.abc import Mapping

from purerl.data.records import PromptRecord
from purerl.episodes.codec import Message
from purerl.episodes.tools import Tool, ToolEnv, calculate
from purerl.rewards.math import RewardFn, lenient_math_reward

__all__ = ["SYSTEM_PROMPT", "calculator_env", "demonstration"]

_EXAMPLE_QUESTION = "Sam packs 12 boxes with 34 pens in each box. How many pens are there?"
SYSTEM_PROMPT = {
    "tags": ("You have a calculator: write <calc>expression</calc> and it answers <result>value</result>. "
             f"Then answer with '#### <number>'. Example:\n{_EXAMPLE_QUESTION}\n<calc>12*34</calc>\n"
             "<result>408</result>\n#### 408"),
    "json": ("You have a calculator tool named calc: write "
             '<tool_call>{"name": "calc", "arguments": {"expression": "12*34"}}</tool_call> and it answers with '
             "the value. Then answer with '#### <number>'."),
}
"""The system prompt of each tool format: the tool and one example of its use."""


def calculator_env(*, tools: bool = True, format: str = "tags", answer_fn: RewardFn = lenient_math_reward) -> ToolEnv:
    """The calculator environment (tool ``calc``), or without tools the same task answered at
    once (one turn, no system prompt)."""
    if not tools:
        return ToolEnv((), answer_fn, format)
    return ToolEnv((Tool.of(calculate, "calc"),), answer_fn, format, SYSTEM_PROMPT[format])


def demonstration(task: PromptRecord, env: ToolEnv) -> list[Message]:
    """A correct episode of ``task`` (which holds its ``expression`` in ``extra``, as level-5
    problems do) in ``env``: the first messages, then (with tools) the call and its result, then
    the answer ``#### <ground truth>``."""
    _, messages = env.reset(task, 0)
    answer: Mapping[str, str] = {"role": "assistant", "content": f"#### {task.ground_truth}"}
    if not env.tools:
        return [*messages, answer]
    expression = task.extra.get("expression")
    if expression is None:
        raise ValueError(f"demonstration: task {task.extra.get('question', task.messages)!r} has no 'expression'")
    call = (f"<calc>{expression}</calc>" if env.format == "tags" else
            f"<tool_call>{json.dumps({'name': 'calc', 'arguments': {'expression': expression}})}</tool_call>")
    result = calculate(expression)
    observation = f"<result>{result}</result>" if env.format == "tags" else result
    return [*messages, {"role": "assistant", "content": call}, {"role": env.observation_role, "content": observation},
            answer]

