"""Tools: a name, a JSON schema of its arguments and a function; an environment that lets the
model call them and answers with their results.

:class:`ToolEnv` parses one call from the end of the model's turn, in one of two formats:

- ``tags``: ``<calc>347*829</calc>``: the tag is the tool's name, the text inside its argument
  (a JSON object for a tool of several parameters). Small models copy this from one example in
  the system prompt; the result comes back as ``<result>…</result>``.
- ``json``: ``<tool_call>{"name": "calc", "arguments": {"expression": "347*829"}}</tool_call>``,
  the Hermes/Qwen convention that chat templates with a tool format render (the tools' schemas go
  to ``apply_chat_template(tools=…)``, :attr:`ToolEnv.chat_tools`); the result comes back as is.

:func:`hermes_calls` is purerl's one parser of the Hermes/Qwen format: :func:`parse_call` reads the
call ending a turn with it, the agents' endpoint (:func:`purerl.agents.endpoint.tool_calls_of`)
every call of an answer.

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

__all__ = ["HERMES_CALL", "HermesCall", "Tool", "ToolEnv", "calculate", "hermes_calls", "parse_call",
           "tool_output"]


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


HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
"""One Hermes/Qwen tool call: the text between ``<tool_call>`` and the first ``</tool_call>`` after it."""


@attrs.frozen
class HermesCall:
    """One ``<tool_call>…</tool_call>`` of a text: its span (``text[start:end]``), the text inside
    (``raw``, stripped) and, when that is a JSON object with a ``name``, the name (as a string) and
    its ``arguments`` as decoded (``{}`` when absent). A malformed call (``raw`` not JSON, not an
    object, or without a name) has ``name`` None; it is still a call, its text kept in ``raw``."""

    start: int
    end: int
    raw: str
    name: str | None
    arguments: Any

    @property
    def arguments_json(self) -> str:
        """The arguments as OpenAI's messages carry them: JSON text (a string argument is taken to
        be JSON text already and kept as it is)."""
        return self.arguments if isinstance(self.arguments, str) else json.dumps(self.arguments)


def hermes_calls(text: str) -> list[HermesCall]:
    """Every Hermes/Qwen tool call in ``text``, in order (:data:`HERMES_CALL`; calls never overlap)."""
    calls = []
    for found in HERMES_CALL.finditer(text):
        raw = found.group(1).strip()
        try:
            call = json.loads(raw)
            name, arguments = str(call["name"]), call.get("arguments", {})
        except (json.JSONDecodeError, KeyError, TypeError):
            name, arguments = None, None
        calls.append(HermesCall(found.start(), found.end(), raw, name, arguments))
    return calls


def parse_call(text: str, names: Sequence[str], format: str) -> tuple[str, str] | None:
    """The tool call ending ``text``: ``(name, argument text)``, None when the turn calls no tool
    (only a call the turn ends with counts: a turn stops at a call's closing tag). A ``json``
    call's argument text is :attr:`HermesCall.arguments_json`; a malformed one is ``("?", its
    text)``: a call of no tool, answered with an error."""
    if format == "tags":
        pattern = "|".join(re.escape(n) for n in names)
        found = re.search(rf"<({pattern})>(.*?)</\1>\s*$", text, re.DOTALL)
        return None if found is None else (found.group(1), found.group(2).strip())
    calls = hermes_calls(text)
    if not calls or text[calls[-1].end:].strip():
        return None
    last = calls[-1]
    return ("?", last.raw) if last.name is None else (last.name, last.arguments_json)


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
