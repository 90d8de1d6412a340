"""Agents' calls stitched into episodes, token-in/token-out.

An agent talks to the endpoint in messages; the trainer learns from token ids. Each call names
its episode (:data:`EPISODE_HEADER`, or the request's ``user`` field). The first call of an
episode renders its messages with the chat template (:meth:`ChatCodec.initial_ids`): the
segment's prompt. A later call whose messages *extend* what the episode has seen — the earlier
messages unchanged, then the assistant message the endpoint returned, then new non-assistant
messages (tool results, a user's reply) — appends only the new messages' delta ids
(:meth:`ChatCodec.delta_ids`, observation tokens, out of every loss) to the ids the model
sampled, which stay exactly as sampled. A call whose history does not extend the episode (the
agent edited, dropped or wrote an assistant message itself, or changed its tools) starts a new
*segment*, rendered afresh: it is never silently re-tokenised into the old one. Every segment
is an :class:`~purerl.episodes.rollout.Episode` record; ``new_segments`` counts the splits.
"""

import json
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from purerl.episodes.codec import ChatCodec
from purerl.episodes.rollout import Episode

__all__ = ["EPISODE_HEADER", "AgentEpisode", "Call", "Choice", "ContextError", "EpisodeTraces", "same_messages"]

EPISODE_HEADER = "X-Episode-Id"
"""The header that names a call's episode (else the request's ``user`` field)."""


class ContextError(ValueError):
    """A call the episode's limits do not allow (its turns or its token budget are spent)."""

    def __init__(self, message: str, finish: str) -> None:
        super().__init__(message)
        self.finish = finish


@attrs.frozen
class Call:
    """One call's context: ``ids`` (what the engine continues), the episode and the call's index
    in it (``turn``: 0 for the episode's first call), and ``room``, the tokens the episode's budget
    leaves to sample."""

    episode: str
    turn: int
    ids: list[int]
    room: int


def _tool_calls(message: Mapping[str, Any]) -> list[tuple[str, Any]]:
    calls = []
    for call in message.get("tool_calls") or ():
        function = call.get("function", call) if isinstance(call, Mapping) else {}
        arguments = function.get("arguments", "")
        try:
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        except json.JSONDecodeError:
            pass
        calls.append((function.get("name", ""), arguments))
    return calls


def _normal(message: Mapping[str, Any]) -> tuple[Any, ...]:
    """What of a message the template can render: role, content (None as ''), tool calls (name and
    parsed arguments) and the tool call a result answers; a client's extra fields (``refusal``,
    ``annotations``, call ids) do not count."""
    content = message.get("content")
    if isinstance(content, list):  # content parts: their text
        content = "".join(p.get("text", "") for p in content if isinstance(p, Mapping))
    return message.get("role"), content or "", _tool_calls(message), message.get("name")


def same_messages(a: Sequence[Mapping[str, Any]], b: Sequence[Mapping[str, Any]]) -> bool:
    """Whether two message lists render alike (:func:`_normal`)."""
    return len(a) == len(b) and all(_normal(x) == _normal(y) for x, y in zip(a, b))


@attrs.frozen
class Choice:
    """One sampled answer of a call: its ids, their log-probs, the weights version, and the
    assistant message the endpoint returned for it."""

    ids: list[int]
    logprobs: list[float]
    version: int
    answer: Mapping[str, Any]


@attrs.define
class AgentEpisode:
    """An agent episode's record: its segments (the last one open), the messages the open segment
    has seen before the last call's answers, those answers (``pending``: one per choice, until
    the next call shows which the agent kept; the first when none does), the tools it was rendered
    with, the calls made."""

    segments: list[Episode] = attrs.Factory(list)
    messages: list[Mapping[str, Any]] = attrs.Factory(list)
    pending: list[Choice] = attrs.Factory(list)
    tools: Any = None
    calls: int = 0
    new_segments: int = 0
    finish: str = ""
    in_call: bool = False
    since: float = attrs.Factory(time.monotonic)
    """When the agent last got an answer (or started): its own time runs from then."""

    def commit(self, choice: Choice) -> None:
        """Append ``choice``'s sampled ids to the open segment."""
        segment = self.segments[-1]
        segment.append(choice.ids, sampled=True, logprobs=choice.logprobs, version=choice.version)
        segment.actions.append(str(choice.answer.get("content") or ""))
        self.messages.append(dict(choice.answer))
        self.pending = []


class EpisodeTraces:
    """Every agent episode's ids, grown call by call (this module's docstring); thread-safe.
    ``max_turns`` calls and ``max_tokens`` ids per segment; a call past either raises
    :class:`ContextError` (its ``finish``: ``max_turns`` or ``context``)."""

    def __init__(self, codec: ChatCodec, *, max_turns: int, max_tokens: int) -> None:
        self.codec, self.max_turns, self.max_tokens = codec, max_turns, max_tokens
        self._episodes: dict[str, AgentEpisode] = {}
        self._lock = threading.Lock()

    def open_call(self, name: str, messages: Sequence[Mapping[str, Any]], tools: Any = None) -> Call:
        """The context of a call of episode ``name`` with ``messages`` (and ``tools``, JSON schemas)."""
        messages = [dict(m) for m in messages]
        with self._lock:
            record = self._episodes.setdefault(name, AgentEpisode())
            if record.finish:
                raise ContextError(f"episode {name!r} has ended ({record.finish})", record.finish)
            if record.calls >= self.max_turns:
                record.finish = "max_turns"
                raise ContextError(f"episode {name!r} has made its {self.max_turns} calls (env.max_turns)", "max_turns")
            delta = self._extension(record, messages, tools)
            if delta is None:  # a new segment
                if record.pending:
                    record.commit(record.pending[0])
                if record.segments:
                    record.new_segments += 1
                prompt = self.codec.initial_ids(messages, **({"tools": tools} if tools else {}))
                record.segments.append(Episode(list(prompt), len(prompt)))
                record.tools = tools
            else:
                record.segments[-1].append(delta, sampled=False)
            segment = record.segments[-1]
            room = self.max_tokens - len(segment.ids)
            if room <= 0:
                record.finish = "context"
                raise ContextError(f"episode {name!r}: its context of {len(segment.ids)} tokens leaves no room in "
                                   f"env.max_tokens {self.max_tokens}", "context")
            record.messages = messages
            record.calls, record.in_call = record.calls + 1, True
            return Call(name, record.calls - 1, list(segment.ids), room)

    def _extension(self, record: AgentEpisode, messages: list[dict[str, Any]], tools: Any) -> list[int] | None:
        """The delta ids that extend the open segment to ``messages`` (committing the answer the
        agent kept); None when they do not extend it."""
        seen = record.messages
        if not record.segments or not record.pending or tools != record.tools or len(messages) <= len(seen) + 1:
            return None
        kept = next((c for c in record.pending if same_messages([messages[len(seen)]], [c.answer])), None)
        new = messages[len(seen) + 1:]
        if kept is None or not same_messages(messages[: len(seen)], seen) \
                or any(m.get("role") == "assistant" for m in new):  # an assistant turn the model did not sample
            return None
        record.commit(kept)
        return self.codec.delta_ids(new, last_sampled=record.segments[-1].ids[-1])

    def close_call(self, call: Call, choices: Sequence[Choice]) -> None:
        """Record the answers the engine sampled for ``call``."""
        with self._lock:
            record = self._episodes[call.episode]
            record.pending, record.in_call, record.since = list(choices), False, time.monotonic()

    def start(self, name: str) -> None:
        """Episode ``name``'s agent starts now (its own time counts from here)."""
        with self._lock:
            self._episodes.setdefault(name, AgentEpisode()).since = time.monotonic()

    def stop_idle(self, names: Sequence[str], timeout: float) -> list[str]:
        """Of ``names``, the episodes whose agent has spent more than ``timeout`` seconds of its
        own (not waiting for the engine) since its last answer: ended (finish ``timeout``; a later
        call is refused) and returned."""
        now, stopped = time.monotonic(), []
        with self._lock:
            for name in names:
                record = self._episodes.setdefault(name, AgentEpisode())
                if not record.finish and not record.in_call and now - record.since > timeout:
                    record.finish = "timeout"
                    stopped.append(name)
        return stopped

    def pop(self, name: str) -> AgentEpisode:
        """Episode ``name``'s record, its last answer committed, forgotten here (an empty record
        if it made no call)."""
        with self._lock:
            record = self._episodes.pop(name, AgentEpisode())
            if record.pending:
                record.commit(record.pending[0])
            return record
