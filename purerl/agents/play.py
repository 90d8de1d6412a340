"""Agent functions as environments: ``run(client, task) -> score``, played against the endpoint.

An agent written for an OpenAI-style client trains unchanged: ``env.name = my_agent.py:run``
names a function of two parameters, ``client`` (an ``openai.OpenAI``, or ``openai.AsyncOpenAI``
for an ``async def``) and ``task`` (the row: ``prompt`` (its messages), ``ground_truth``,
``data_source``, ``seed`` and the row's other fields). It may call the client as often as it likes
(at most ``env.max_turns`` calls, within ``env.max_tokens``), with any tools, and returns the
episode's score — or None, and the job's reward function scores its last answer. Which objects
are agent functions (:func:`is_agent_function`) is the ``agent_function`` kind's record in
:mod:`purerl.environments`.

:func:`run_agents` plays ``n`` episodes per task, every agent at once, each with a client whose
calls name its episode; the endpoint batches their calls into engine calls and stitches each
episode's ids (:mod:`purerl.agents.traces`). An episode becomes the row of its last segment
(the one holding the answer: a batch keeps ``n`` rows per task, GRPO's groups); a history the
agent edited is counted in ``new_segments``, and the segments before it are not trained on. An
agent's own time between an answer and its next call (or its return) is bounded by
``env.step_timeout``, as an environment step is; an agent that raises, overruns, makes no call
or returns no number ends its episode with finish ``env_error``, scored ``reward.penalty``, its
message kept.
"""

import asyncio
import inspect
import queue
import threading
import time
import traceback
import zlib
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import attrs

from purerl.agents.batching import EngineBatcher
from purerl.agents.endpoint import Endpoint
from purerl.agents.traces import EPISODE_HEADER, AgentEpisode, EpisodeTraces
from purerl.data.records import PromptRecord
from purerl.episodes.codec import ChatCodec
from purerl.episodes.limits import EpisodeLimits
from purerl.episodes.rollout import Episode
from purerl.rewards.math import RewardFn
from purerl.rollout.engine import RolloutEngine
from purerl.rollout.sampling import SamplingParams
from purerl.sandbox.forms import call_form, checked_reward, reward_value
from purerl.state import RngState

__all__ = ["AgentEnv", "is_agent_function", "run_agents"]


@attrs.frozen
class AgentEnv:
    """A plain agent function played as an environment (module docstring). ``answer_fn`` scores
    an episode whose agent returns None; ``window_s``: the endpoint collects calls into one engine
    call while they arrive within this of each other (:mod:`purerl.agents.batching`);
    ``max_agents``: how many run at once."""

    fn: Callable[..., Any]
    answer_fn: RewardFn
    window_s: float = 0.05
    max_agents: int = 64
    stop: tuple[str, ...] = ()


def is_agent_function(value: Any) -> bool:
    """A function of exactly two required parameters (``client``, ``task``)."""
    if not inspect.isfunction(value):
        return False
    required = [p for p in inspect.signature(value).parameters.values()
                if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(required) == 2


def _row(task: PromptRecord, seed: int) -> dict[str, Any]:
    return {**task.extra, "prompt": [dict(m) for m in task.messages], "ground_truth": task.ground_truth,
            "data_source": task.data_source, "seed": seed}


def run_agents(engine: RolloutEngine, env: AgentEnv, codec: ChatCodec, tasks: Sequence[PromptRecord],
               sampling: SamplingParams, rng: RngState, version: int | None, limits: EpisodeLimits, *,
               decode: Callable[[list[int]], str], seeds: Sequence[int] | None = None,
               template_kwargs: dict[str, Any] | None = None, batch_timeout: float | None = None,
               timings: dict[str, float] | None = None, reuse_cache: bool = True) -> list[Episode]:
    """``sampling.n`` episodes per task, prompt-major, as
    :func:`~purerl.episodes.rollout.run_episodes` plays an environment's (its arguments; draws
    alike: call ``k`` of episode ``j`` of task ``i`` samples as that episode's turn ``k`` would;
    ``reuse_cache``: KV caches kept across calls, :mod:`purerl.agents.batching`). ``timings``
    gains ``gen_s``, the wall time of the whole."""
    import openai

    seeds = list(range(len(tasks)) if seeds is None else seeds)
    n = sampling.n
    names = [f"{i}/{j}" for i in range(len(tasks)) for j in range(n)]
    where = {name: (seeds[k // n], k % n) for k, name in enumerate(names)}

    def stream_of(name: str, turn: int, asked: int) -> tuple[int, int]:
        if name not in where:
            return zlib.crc32(name.encode()) & 0x7FFF_FFFF, 0
        seed, j = where[name]
        if asked > 1:  # several choices: a stream of their own
            return 2**40 + (seed * n + j) * 1024 + turn, 0
        return (seed, j) if turn == 0 else (seed * n + j, 0)

    start = time.perf_counter()
    traces = EpisodeTraces(codec, max_turns=limits.max_turns, max_tokens=limits.max_tokens)
    is_async = inspect.iscoroutinefunction(env.fn)
    running = _Running(len(names), len(names) if is_async else env.max_agents)
    batcher = EngineBatcher(engine, rng, version, window_s=env.window_s, live=running.count, reuse_cache=reuse_cache)

    def token_text(t: int) -> str:
        return codec.tokenizer.decode([t])

    rows = [_row(tasks[k // n], seeds[k // n]) for k in range(len(names))]
    endpoint = Endpoint(batcher, traces, decode=decode, token_text=token_text, sampling=attrs.evolve(sampling, n=1),
                        stream_of=stream_of)
    try:
        def client(kind: Any, http: Any, name: str) -> Any:
            return kind(base_url=endpoint.url, api_key=endpoint.token, default_headers={EPISODE_HEADER: name},
                        max_retries=0, timeout=None, http_client=http)

        for name in names:
            traces.start(name)
        if is_async:
            outcomes = _run_async(running.wrap_async(env.fn), lambda http, name: client(openai.AsyncOpenAI, http, name),
                                  names, rows)
        else:
            outcomes, http = _run_threads(running.wrap(env.fn), lambda http, name: client(openai.OpenAI, http, name),
                                          names, rows, env.max_agents)
        waiting = _Outcomes(outcomes, names, traces, limits.step_timeout, running)
        batcher.serve(until=waiting.all_known, every=waiting.check, poll_s=0.02)  # the engine on this thread
        results = waiting.results
        if not is_async:
            http.close()
    finally:
        endpoint.close(wait=False)  # uvicorn takes ~0.1 s to notice: not waited for
    batcher.close()
    if timings is not None:
        timings["gen_s"] = timings.get("gen_s", 0.0) + time.perf_counter() - start
    episodes = [_episode(traces.pop(name), result, codec, tasks[k // n], env, template_kwargs)
                for k, (name, result) in enumerate(zip(names, results))]
    for name, episode in zip(names, episodes):
        if episode.error:
            i = int(name.split("/")[0])
            episode.error = (f"agent {getattr(env.fn, '__qualname__', env.fn)}, task {i} ({tasks[i].data_source}), "
                             f"seed {seeds[i]}, episode {name}: {episode.error}")
    return episodes


class _Running:
    """How many agents may call now: those not yet returned (nor abandoned), at most ``workers``
    (the batcher's ``live``: once that many calls wait, no other can come)."""

    def __init__(self, agents: int, workers: int) -> None:
        self._left, self._workers, self._lock = agents, workers, threading.Lock()

    def count(self) -> int:
        return min(self._left, self._workers)

    def done(self) -> None:
        with self._lock:
            self._left -= 1

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def running(*args: Any) -> Any:
            try:
                return fn(*args)
            finally:
                self.done()
        return running

    def wrap_async(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        async def running(*args: Any) -> Any:
            try:
                return await fn(*args)
            finally:
                self.done()
        return running


def _run_threads(fn: Callable[..., Any], client: Callable[[Any, str], Any], names: list[str],
                 rows: list[dict[str, Any]], workers: int) -> tuple[list[Future], Any]:
    """Each agent on a thread (``workers`` at once), its client sharing one connection pool. The
    threads are daemons: an agent that overruns is abandoned, and never holds the process at exit
    (a ``ThreadPoolExecutor``'s threads are joined then, so a hung agent kept the job from ending)."""
    import httpx

    http = httpx.Client(timeout=None, limits=httpx.Limits(max_connections=None, max_keepalive_connections=workers))
    futures: list[Future] = [Future() for _ in rows]
    work: queue.SimpleQueue = queue.SimpleQueue()
    for future, name, row in zip(futures, names, rows):
        work.put((future, client(http, name), row))

    def serve() -> None:
        while True:
            try:
                future, agent_client, row = work.get_nowait()
            except queue.Empty:
                return
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(agent_client, row))
                except BaseException as err:  # noqa: BLE001 - the episode's error, not the run's
                    future.set_exception(err)

    for k in range(max(1, min(workers, len(rows)))):
        threading.Thread(target=serve, name=f"purerl-agent-{k}", daemon=True).start()
    return futures, http


def _run_async(fn: Callable[..., Any], client: Callable[[Any, str], Any], names: list[str],
               rows: list[dict[str, Any]]) -> list[Future]:
    """Every agent as a coroutine on one event loop of its own thread, their clients sharing one
    connection pool."""
    futures: list[Future] = [Future() for _ in rows]

    async def one(c: Any, row: dict[str, Any], future: Future) -> None:
        try:
            future.set_result(await fn(c, row))
        except BaseException as err:  # noqa: BLE001 - the episode's error, not the run's
            future.set_exception(err)

    async def every() -> None:
        import httpx

        async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=None)) as http:
            await asyncio.gather(*(one(client(http, name), row, f) for name, row, f in zip(names, rows, futures)))

    threading.Thread(target=lambda: asyncio.run(every()), name="purerl-agents", daemon=True).start()
    return futures


class _Outcomes:
    """Each agent's outcome as it becomes known: ``("score", value)``, ``("error", message)`` or
    ``("timeout", message)`` (an agent idle past ``timeout`` seconds of its own)."""

    def __init__(self, futures: list[Future], names: list[str], traces: EpisodeTraces, timeout: float,
                 running: _Running) -> None:
        self.futures, self.names, self.traces, self.timeout, self.running = futures, names, traces, timeout, running
        self.results: list[Any] = [None] * len(futures)
        self.open = set(range(len(futures)))

    def all_known(self) -> bool:
        return not self.open

    def check(self) -> None:
        for k in [k for k in self.open if self.futures[k].done()]:
            self.open.discard(k)
            err = self.futures[k].exception()
            self.results[k] = ("score", self.futures[k].result()) if err is None else (
                "error", f"{type(err).__name__}: {err}" + _where(err))
        for name in self.traces.stop_idle([self.names[k] for k in self.open], self.timeout):
            k = self.names.index(name)
            self.open.discard(k)
            self.running.done()  # abandoned: the batcher no longer waits for its calls
            self.results[k] = ("timeout", f"the agent ran {self.timeout:g} s of its own without a call or a "
                                          "return (env.step_timeout)")


def _where(err: BaseException) -> str:
    frames = traceback.extract_tb(err.__traceback__)
    return f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""


def _episode(record: AgentEpisode, result: tuple[str, Any], codec: ChatCodec, task: PromptRecord, env: AgentEnv,
             template_kwargs: dict[str, Any] | None) -> Episode:
    """The row of an agent's episode: its last segment, scored (module docstring)."""
    if record.segments:
        episode = record.segments[-1]
    else:
        prompt = codec.initial_ids(task.messages, **(template_kwargs or {}))
        episode = Episode(list(prompt), len(prompt))
    episode.counts = {"new_segments": float(record.new_segments), "agent_calls": float(record.calls)}
    outcome, value = result
    if outcome == "score" and not episode.turn_ends:
        outcome, value = "error", "the agent made no call to the endpoint"
    if outcome == "score":
        try:
            if value is None:
                value = reward_value(env.answer_fn, call_form(env.answer_fn), episode.actions[-1],
                                     task.ground_truth, task.data_source, task.extra)
            reward = checked_reward(value)
        except ValueError as err:
            outcome, value = "error", f"it returned a bad score: {err}"
        else:
            episode.finish = record.finish or "answer"
            episode.reward = reward
            episode.turn_rewards = [0.0] * (len(episode.turn_ends) - 1) + [reward]
            return episode
    if outcome == "error" and record.finish in ("max_turns", "context"):  # the agent failed at a limit
        episode.finish = record.finish
        episode.turn_rewards = [0.0] * len(episode.turn_ends)
        return episode
    episode.finish, episode.error = "env_error", value
    episode.counts["env_errors"] = 1.0
    episode.turn_rewards = [0.0] * len(episode.turn_ends)
    return episode
