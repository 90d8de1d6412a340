"""An OpenAI-compatible endpoint over the rollout engine, on loopback, for agent code.

``/v1/chat/completions``, ``/v1/completions`` and ``/v1/models`` (FastAPI, served by uvicorn on
a thread of its own at ``127.0.0.1``, a free port). Every request must come from a loopback
address and carry ``Authorization: Bearer <token>``, a random token made per endpoint and handed
to the agents' clients: the endpoint samples from the policy being trained, so nothing else on
the machine may use it.

A chat request is rendered by the chat template (``tools``: JSON schemas, through the template),
continued by the engine at the weights version being trained (:mod:`purerl.agents.batching`:
concurrent requests share engine calls) and recorded in its episode
(:mod:`purerl.agents.traces`). It honours ``n``, ``temperature`` (default: the job's),
``top_p``, ``max_tokens`` / ``max_completion_tokens`` (at most the job's ``max_new_tokens`` and
the episode's token budget), ``stop`` (cut from the returned text, as OpenAI does; the sampled
ids keep it) and ``logprobs`` (each sampled token's behaviour log-prob; ``top_logprobs`` is
empty). Tool calls are parsed from the text (Hermes/Qwen ``<tool_call>{"name", "arguments"}
</tool_call>``) when the request offers ``tools``. Each choice also carries ``token_ids``, the
sampled ids, and the response ``prompt_token_ids``: what the trainer will see.
"""

import asyncio
import hashlib
import ipaddress
import json
import re
import secrets
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from purerl.agents.batching import EngineBatcher, Request, Sampled
from purerl.agents.traces import EPISODE_HEADER, ContextError, EpisodeTraces
from purerl.agents.traces import Choice as TraceChoice
from purerl.batch import FINISH_LENGTH
from purerl.rollout.sampling import SamplingParams

__all__ = ["Endpoint", "StreamOf", "tool_calls_of"]

StreamOf = Callable[[str, int, int], tuple[int, int]]
"""``(episode, call index, n) -> (stream, first sample)``: where a call's draws come from."""

_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def tool_calls_of(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """The content before the first Hermes/Qwen tool call in ``text`` (None when empty) and the
    calls, in OpenAI's form; a call whose JSON does not parse stays in the content."""
    calls, first = [], None
    for found in _CALL.finditer(text):
        try:
            call = json.loads(found.group(1))
            name, arguments = str(call["name"]), call.get("arguments", {})
        except (json.JSONDecodeError, KeyError, TypeError):
            continue
        first = found.start() if first is None else first
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": name, "arguments": arguments if isinstance(arguments, str)
                                   else json.dumps(arguments)}})
    if not calls:
        return text, []
    content = text[:first].strip()
    return content or None, calls


def _error(status: int, message: str, code: str) -> Any:
    """An OpenAI-style error response."""
    from fastapi.responses import JSONResponse

    return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "code": code}},
                        status_code=status)


def _hash_stream(name: str) -> int:
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=4).digest(), "little") & 0x7FFF_FFFF


class Endpoint:
    """The endpoint (module docstring), started at construction; a context manager. ``url``: its
    ``/v1`` base URL; ``token``: the bearer token; ``batcher``: the engine behind it;
    ``traces``: the episodes recorded (a request names its episode by :data:`EPISODE_HEADER` or
    ``user``; one that names none is served and not recorded). ``stream_of``: where an episode's
    calls draw (default: a stream hashed from its name). ``decode``: ids → text."""

    def __init__(self, batcher: EngineBatcher, traces: EpisodeTraces, *, decode: Callable[[list[int]], str],
                 token_text: Callable[[int], str], sampling: SamplingParams, stream_of: StreamOf | None = None,
                 model: str = "policy") -> None:
        import uvicorn

        self.batcher, self.traces, self.decode, self.token_text = batcher, traces, decode, token_text
        self.sampling, self.model = sampling, model
        self.stream_of = stream_of or (lambda name, turn, n: (_hash_stream(f"{name}/{turn}"), 0))
        self.token = secrets.token_urlsafe(32)
        self.refused = 0
        config = uvicorn.Config(self._app(), host="127.0.0.1", port=0, log_level="warning", lifespan="off",
                                access_log=False)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="purerl-endpoint", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the agents' endpoint did not start on 127.0.0.1")
            time.sleep(0.005)
        port = self._server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}/v1"

    def close(self, wait: bool = True) -> None:
        """Stop serving; ``wait``: until the server's thread has ended (uvicorn notices within
        ~0.1 s), else return at once."""
        self._server.should_exit = True
        if wait:
            self._thread.join()

    def __enter__(self) -> "Endpoint":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _app(self) -> Any:
        from fastapi import FastAPI, Request

        app = FastAPI(title="purerl agents' endpoint", docs_url=None, redoc_url=None, openapi_url=None)

        @app.middleware("http")
        async def guard(request: Request, call_next: Any) -> Any:
            host = request.client.host if request.client else ""
            try:
                loopback = ipaddress.ip_address(host).is_loopback
            except ValueError:
                loopback = False
            if not loopback:
                self.refused += 1
                return _error(403, f"the endpoint serves loopback only, not {host}", "forbidden")
            if not secrets.compare_digest(request.headers.get("authorization", ""), f"Bearer {self.token}"):
                self.refused += 1
                return _error(401, "a bearer token is required: the one the job handed to the agent", "unauthorized")
            return await call_next(request)

        @app.get("/v1/models")
        async def models() -> dict[str, Any]:
            return {"object": "list", "data": [{"id": self.model, "object": "model", "owned_by": "purerl"}]}

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> Any:
            body = await request.json()
            episode = request.headers.get(EPISODE_HEADER) or body.get("user")
            return await self._answer(body, episode, chat=True)

        @app.post("/v1/completions")
        async def completions(request: Request) -> Any:
            body = await request.json()
            return await self._answer(body, None, chat=False)

        return app

    def _sampling(self, body: Mapping[str, Any], room: int) -> SamplingParams:
        stop = body.get("stop") or ()
        stop = (stop,) if isinstance(stop, str) else tuple(stop)
        asked = body.get("max_completion_tokens") or body.get("max_tokens") or self.sampling.max_new_tokens
        temperature = body.get("temperature")
        return SamplingParams(max_new_tokens=max(1, min(int(asked), self.sampling.max_new_tokens, room)),
                              temperature=self.sampling.temperature if temperature is None else float(temperature),
                              top_p=float(body.get("top_p") or 1.0), top_k=self.sampling.top_k,
                              n=int(body.get("n") or 1), stop=stop)

    async def _answer(self, body: Mapping[str, Any], episode: str | None, *, chat: bool) -> Any:
        try:
            if chat:
                messages, tools = body.get("messages"), body.get("tools") or None
                if not isinstance(messages, list) or not messages:
                    return _error(400, "messages: a non-empty list is required", "invalid_messages")
                record = episode is not None
                name = episode if record else f"unrecorded-{uuid.uuid4().hex}"
                call = self.traces.open_call(name, messages, tools)
                ids, turn = call.ids, call.turn
                room = call.room
            else:
                tools, record = None, False
                prompt = body.get("prompt")
                ids = list(prompt) if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt) else None
                if ids is None:
                    if not isinstance(prompt, str):
                        return _error(400, "prompt: a string or a list of token ids is required", "invalid_prompt")
                    ids = self.traces.codec.tokenizer.encode(prompt, add_special_tokens=False)
                name, turn, room = f"completion-{uuid.uuid4().hex}", 0, self.traces.max_tokens - len(ids)
            sampling = self._sampling(body, room)
        except ContextError as err:
            return _error(400, str(err), err.finish)
        except (TypeError, ValueError) as err:
            return _error(400, f"{type(err).__name__}: {err}", "invalid_request")
        stream, sample = self.stream_of(name, turn, sampling.n)
        future = self.batcher.submit(Request(ids, sampling, turn, stream, sample, name if record else None))
        samples: list[Sampled] = await asyncio.wrap_future(future)
        choices, recorded = [], []
        for index, s in enumerate(samples):
            text = self.decode(s.ids)
            finish = "length" if s.finish == FINISH_LENGTH else "stop"
            for stop in sampling.stop:  # OpenAI's text ends before the stop string
                at = text.find(stop)
                text = text if at < 0 else text[:at]
            choice: dict[str, Any] = {"index": index, "finish_reason": finish, "token_ids": s.ids}
            if body.get("logprobs"):
                content = [{"token": self.token_text(t), "logprob": p, "bytes": list(self.token_text(t).encode()),
                            "top_logprobs": []} for t, p in zip(s.ids, s.logprobs)]
                choice["logprobs"] = {"content": content} if chat else {
                    "tokens": [c["token"] for c in content], "token_logprobs": s.logprobs}
            if chat:
                content_text, calls = tool_calls_of(text) if tools else (text, [])
                message: dict[str, Any] = {"role": "assistant", "content": content_text}
                if calls:
                    message["tool_calls"], choice["finish_reason"] = calls, "tool_calls"
                choice["message"] = message
                recorded.append(TraceChoice(list(s.ids), list(s.logprobs), s.version, message))
            else:
                choice["text"] = text
            choices.append(choice)
        if chat:
            if record:
                self.traces.close_call(call, recorded)
            else:
                self.traces.pop(name)
        completion = sum(len(s.ids) for s in samples)
        return {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
                "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": body.get("model") or self.model, "choices": choices, "prompt_token_ids": list(ids),
                "usage": {"prompt_tokens": len(ids), "completion_tokens": completion,
                          "total_tokens": len(ids) + completion}}

