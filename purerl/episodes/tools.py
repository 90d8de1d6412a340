"""Tools: a name, a JSON schema of its arguments and a function; an environment that lets the
model call them and answers with their results.

:class:`ToolEnv` parses one call from the end of the model's turn, in one of two formats:

- ``tags``: ``<calc>347*829</calc>``: the tag is the tool's name, the text inside its argument
  (a JSON object for a tool of several parameters). Small models copy this from one example in
  the system prompt; the result comes back as ``<result>…</result>``.
- ``json``: ``<tool_call>{"name": "calc", "arguments": {"expression": "347*829"}}</tool_call>``,
  the Hermes/Qwen convention that chat templates with a tool format render (the tools' schemas go
  to ``apply_chat_template(tools=…)``, :attr:`ToolEnv.chat_tools`); the result comes back as is.

A turn without a call is the final answer, scored by ``answer_fn`` against the task's ground
truth. A tool that raises or gets arguments it cannot take answers ``error: …`` (a counted
``tool_errors``) and the episode goes on; one that hangs or kills its process is stopped by the
step's deadline (:mod:`purerl.episodes.stepping`, a counted ``tool_timeouts``).
"""

import ast
import json
import operator
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from purerl.data.records import PromptRecord
from purerl.episodes.codec import Message
from purerl.episodes.env import StepResult
from purerl.rewards.math import RewardFn
from purerl.sandbox.forms import call_form, reward_value

__all__ = ["Tool", "ToolEnv", "calculate", "parse_call", "tool_output"]


@attrs.frozen
class Tool:
    """``fn`` callable by the model as ``name``; ``schema``: the OpenAI-style function schema
    (``{"name", "description", "parameters"}``) that chat templates render."""

    name: str
    fn: Callable[..., Any]
    schema: Mapping[str, Any]

    @staticmethod
    def of(fn: Callable[..., Any], name: str | None = None) -> "Tool":
        """The tool of a typed function with a Google-style docstring (``Args:`` naming each
        parameter), its schema by ``transformers.utils.get_json_schema``."""
        from transformers.utils import get_json_schema

        schema = dict(get_json_schema(fn)["function"])
        if name is not None:
            schema["name"] = name
        return Tool(schema["name"], fn, schema)

    @property
    def parameters(self) -> list[str]:
        return list(self.schema.get("parameters", {}).get("properties", {}))


def parse_call(text: str, names: Sequence[str], format: str) -> tuple[str, str] | None:
    """The tool call ending ``text``: ``(name, argument text)``, None when the turn calls no tool
    (only a call the turn ends with counts: a turn stops at a call's closing tag)."""
    if format == "tags":
        pattern = "|".join(re.escape(n) for n in names)
        found = re.search(rf"<({pattern})>(.*?)</\1>\s*$", text, re.S)
        return None if found is None else (found.group(1), found.group(2).strip())
    found = re.search(r"<tool_call>(.*?)</tool_call>\s*$", text, re.S)
    if found is None:
        return None
    try:
        call = json.loads(found.group(1))
        return str(call["name"]), json.dumps(call.get("arguments", {}))
    except (json.JSONDecodeError, KeyError, TypeError):
        return "?", found.group(1).strip()


def _arguments(tool: Tool, text: str, format: str) -> dict[str, Any]:
    """The keyword arguments of a call: a JSON object, or (tags) the text as the one parameter."""
    if format == "json" or (text.startswith("{") and len(tool.parameters) != 1):
        arguments = json.loads(text)
        if not isinstance(arguments, dict):
            raise ValueError(f"arguments must be a JSON object, got {text[:60]!r}")
        return arguments
    if len(tool.parameters) != 1:
        raise ValueError(f"{tool.name} takes {len(tool.parameters)} arguments: give them as a JSON object")
    return {tool.parameters[0]: text}


def tool_output(name: str, names: Sequence[str], invoke: Callable[[], Any]) -> tuple[str, float]:
    """What the model reads back from its call of tool ``name``: ``str(invoke())``, or ``error: …``
    when no tool has that name or the call raises (the episode goes on); and the call's error
    count, 0 or 1."""
    try:
        if name not in names:
            raise ValueError(f"no tool named {name!r} (tools: {', '.join(names)})")
        return str(invoke()), 0.0
    except Exception as err:  # noqa: BLE001 - the model sees the error and the episode goes on
        return f"error: {type(err).__name__}: {err}", 1.0


@attrs.frozen
class ToolEnv:
    """Episodes of tool calls ending in an answer. ``system_prompt`` (one example of the call
    format helps small models) comes first; ``observation_role``: the role of tool results
    (``tool``; ``user`` for templates without one)."""

    tools: tuple[Tool, ...]
    answer_fn: RewardFn
    format: str = attrs.field(default="tags", validator=attrs.validators.in_(("tags", "json")))
    system_prompt: str | None = None
    observation_role: str = "tool"

    @property
    def stop(self) -> tuple[str, ...]:
        return tuple(f"</{t.name}>" for t in self.tools) if self.format == "tags" else ("</tool_call>",)

    @property
    def chat_tools(self) -> list[Mapping[str, Any]]:
        """The tools' schemas as ``apply_chat_template(tools=…)`` takes them."""
        return [{"type": "function", "function": t.schema} for t in self.tools]

    def reset(self, task: PromptRecord, seed: int) -> tuple[PromptRecord, list[Message]]:
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return task, [*system, *task.messages]

    def step(self, state: PromptRecord, action: str) -> StepResult:
        by_name = {t.name: t for t in self.tools}
        call = parse_call(action, list(by_name), self.format) if self.tools else None
        if call is None:
            reward = reward_value(self.answer_fn, call_form(self.answer_fn), action, state.ground_truth,
                                  state.data_source, state.extra)
            return StepResult(state, (), reward, True, "answer")
        name, text = call
        output, errors = tool_output(name, list(by_name),
                                     lambda: by_name[name].fn(**_arguments(by_name[name], text, self.format)))
        content = f"<result>{output}</result>" if self.format == "tags" else output
        return StepResult(state, ({"role": self.observation_role, "content": content},), 0.0, False, "",
                          {"tool_calls": 1.0, "tool_errors": errors})


_OPERATORS: dict[type, Callable[..., Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.USub: operator.neg, ast.UAdd: operator.pos,
}


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: Numbers with + - * / // % and parentheses, e.g. "347*829".
    """
    def value(node: ast.AST) -> Any:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            right = value(node.right)
            if isinstance(node.op, ast.Pow) or abs(right) > 1e12:
                raise ValueError("number too large")
            return _OPERATORS[type(node.op)](value(node.left), right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.operand))
        raise ValueError(f"not arithmetic: {ast.dump(node)[:60]}")

    if len(expression) > 200:
        raise ValueError("expression longer than 200 characters")
    result = value(ast.parse(expression.replace(",", "").replace("×", "*").strip(), mode="eval").body)
    if isinstance(result, float) and result.is_integer():
        result = int(result)
    return str(round(result, 6) if isinstance(result, float) else result)
