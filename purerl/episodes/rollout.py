"""Episodes sampled turn by turn, token-in/token-out, and the rollout the trainer learns from.

:func:`run_episodes` steps every episode of a batch in lock-step through any rollout engine
(:class:`~purerl.rollout.engine.RolloutEngine`: the embedded one, vLLM, a Ray worker's): turn 0
samples ``n`` answers per task from the tasks' first messages (one prefill per task); each later
turn samples one continuation of every episode still running, whose context is everything so far.
After each turn the environment's ``step`` runs for the episodes under their deadline
(:mod:`purerl.episodes.stepping`); the messages it answers with are appended as delta ids
(:class:`~purerl.episodes.codec.ChatCodec`). An episode ends when the environment says so
(``answer``), after ``max_turns`` (``max_turns``), or when its ids would pass ``max_tokens``
(``context``).

:func:`episodes_rollout` turns episodes into a :class:`~purerl.batch.Rollout`: the prompt is the
first messages' ids, the response everything after, and ``response_mask`` is the *sampled* mask,
so observation tokens — tool results, the template's turn markup — attend but count in no loss,
no KL term and no advantage (GAE skips them: :mod:`purerl.algo.advantages`). The episode's score
(the environment's rewards summed, plus ``tool_bonus`` per tool call that did not fail) sits on
its last sampled token, as a single-turn score does.
"""

import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch
from torch import Tensor

from purerl.batch import FINISH_EOS, FINISH_LENGTH, Rollout, Sequences, left_pad
from purerl.data.records import PromptRecord
from purerl.episodes.codec import ChatCodec, Message
from purerl.episodes.env import Env, StepResult
from purerl.episodes.limits import EpisodeLimits
from purerl.episodes.stepping import step_envs
from purerl.rollout.engine import RolloutEngine
from purerl.rollout.sampling import SamplingParams
from purerl.state import RngState
from purerl.tree import tree_map

__all__ = ["Episode", "EpisodeLimits", "episode_metrics", "episode_of_transcript", "episode_scores", "episodes_rollout",
           "run_episodes", "turn_token_rewards"]

FINISHES = ("answer", "max_turns", "context", "env_error")
"""Why an episode ended (an environment may name others in its ``StepResult.finish``)."""


@attrs.define
class Episode:
    """One episode's record. ``ids``: every token, the first ``prompt_length`` the prompt;
    ``sampled[i]``: the model sampled ``ids[prompt_length + i]`` (``logprobs`` and ``versions``
    hold its behaviour log-prob and weights version; 0 and -1 elsewhere); ``turn_ends``: index
    (into ``ids``) of each turn's last sampled token; ``reward``: the environment's rewards summed;
    ``counts``: the steps' counts summed (``tool_calls``, ``tool_errors``, ``tool_timeouts``);
    ``actions``: each turn's text as the environment read it; ``turn_rewards``: each turn's reward;
    ``error``: why the environment's return was refused (finish ``env_error``), naming the
    environment, task, seed and turn."""

    ids: list[int]
    prompt_length: int
    sampled: list[bool] = attrs.Factory(list)
    logprobs: list[float] = attrs.Factory(list)
    versions: list[int] = attrs.Factory(list)
    turn_ends: list[int] = attrs.Factory(list)
    reward: float = 0.0
    finish: str = ""
    counts: dict[str, float] = attrs.Factory(dict)
    state: Any = None
    actions: list[str] = attrs.Factory(list)
    turn_rewards: list[float] = attrs.Factory(list)
    error: str = ""

    def append(self, ids: Sequence[int], *, sampled: bool, logprobs: Sequence[float] = (), version: int = -1) -> None:
        self.ids += ids
        self.sampled += [sampled] * len(ids)
        self.logprobs += list(logprobs) if sampled else [0.0] * len(ids)
        self.versions += [version if sampled else -1] * len(ids)
        if sampled and ids:
            self.turn_ends.append(len(self.ids) - 1)

    def add(self, result: StepResult) -> None:
        self.state, self.reward = result.state, self.reward + float(result.reward)
        self.turn_rewards.append(float(result.reward))
        for key, value in result.counts.items():
            self.counts[key] = self.counts.get(key, 0.0) + float(value)

    @property
    def successful_calls(self) -> float:
        return self.counts.get("tool_calls", 0.0) - self.counts.get("tool_errors", 0.0)


def run_episodes(engine: RolloutEngine, env: Env, codec: ChatCodec, tasks: Sequence[PromptRecord],
                 sampling: SamplingParams, rng: RngState, version: int | None, limits: EpisodeLimits, *,
                 decode: Callable[[list[int]], str], seeds: Sequence[int] | None = None,
                 template_kwargs: dict[str, Any] | None = None, batch_timeout: float | None = None,
                 timings: dict[str, float] | None = None, reuse_cache: bool = True) -> list[Episode]:
    """``sampling.n`` episodes per task (prompt-major: episodes ``i·n … i·n+n-1`` play task ``i``
    from one initial state, ``env.reset(task, seeds[i])``; seeds default to ``0, 1, …``), sampled
    with weights ``version`` from ``rng`` (turn ``k > 0`` from ``rng.fold_in(k)``), each episode on
    its own stream (task ``i``'s is ``seeds[i]``). ``decode``:
    ids → the text ``step`` reads. ``timings`` (when given) gains the seconds spent sampling
    (``gen_s``) and stepping environments (``env_s``). With ``reuse_cache``, an engine that
    offers a ``session()`` (the embedded one) keeps each episode's KV cache across its turns and
    prefills only the new ids."""
    seeds = range(len(tasks)) if seeds is None else seeds
    timings = {} if timings is None else timings
    starts = []
    for i, (task, seed) in enumerate(zip(tasks, seeds)):
        try:
            start = env.reset(task, seed)
        except Exception as err:  # a bug or a bad row: name both
            raise ValueError(f"environment {type(env).__qualname__}: reset failed on task {i} ({task.data_source}, "
                             f"seed {seed}): {type(err).__name__}: {err}") from err
        if not (isinstance(start, tuple) and len(start) == 2 and isinstance(start[1], (list, tuple))):
            raise ValueError(f"environment {type(env).__qualname__}: reset on task {i} ({task.data_source}, seed "
                             f"{seed}) returned {type(start).__name__} {str(start)[:60]!r}, not (state, messages): the "
                             "state the episode starts from and its first messages, a list of {'role', 'content'}")
        starts.append(start)
    prompts = [codec.initial_ids(messages, **(template_kwargs or {})) for _, messages in starts]
    for i, p in enumerate(prompts):
        if len(p) >= limits.max_tokens:
            raise ValueError(f"run_episodes: the first messages of task {i} take {len(p)} tokens, no fewer than the "
                             f"episode's budget of {limits.max_tokens} (env.max_tokens)")
    episodes = [Episode(list(p), len(p), state=state)
                for (state, _), p in zip(starts, prompts) for _ in range(sampling.n)]
    stop = tuple(dict.fromkeys((*sampling.stop, *env.stop)))
    active, rows_before = list(range(len(episodes))), {}
    session = engine.session() if reuse_cache and hasattr(engine, "session") else None
    for turn in range(limits.max_turns):
        room = max(limits.max_tokens - len(episodes[i].ids) for i in active)
        turn_sampling = attrs.evolve(sampling, stop=stop, max_new_tokens=min(sampling.max_new_tokens, room),
                                     n=sampling.n if turn == 0 else 1)
        asked = prompts if turn == 0 else [episodes[i].ids for i in active]
        start = time.perf_counter()
        turn_rng = rng if turn == 0 else rng.fold_in(turn)
        # a task's stream is its seed; later turns, episode j of it continues on stream seed·n + j
        streams = list(seeds) if turn == 0 else [seeds[i // sampling.n] * sampling.n + i % sampling.n
                                                 for i in active]
        if session is None:
            rollout = engine.generate(asked, turn_sampling, turn_rng, version=version, streams=streams)
        else:  # the KV cache of each episode's earlier turns is reused: only the new ids are prefilled
            rollout = session.generate(asked, turn_sampling, turn_rng, version=version, streams=streams,
                                       previous=None if turn == 0 else [rows_before[i] for i in active])
        rows_before = {i: row for row, i in enumerate(active)}
        timings["gen_s"] = timings.get("gen_s", 0.0) + time.perf_counter() - start
        tokens, masks = rollout.sequences.responses().tolist(), rollout.sequences.response_mask.tolist()
        logps = rollout.behaviour_logprobs.tolist()
        actions, cut = [], set()
        for row, i in enumerate(active):
            episode = episodes[i]
            keep = min(sum(masks[row]), limits.max_tokens - len(episode.ids))
            if keep < sum(masks[row]):
                cut.add(i)
            ids = [t for t, m in zip(tokens[row], masks[row]) if m][:keep]
            episode.append(ids, sampled=True, logprobs=[p for p, m in zip(logps[row], masks[row]) if m][:keep],
                           version=rollout.version)
            actions.append(decode(ids))
            episode.actions.append(actions[-1])
        start = time.perf_counter()
        results = step_envs(env, [episodes[i].state for i in active], actions, timeout=limits.step_timeout,
                            batch_timeout=batch_timeout)
        timings["env_s"] = timings.get("env_s", 0.0) + time.perf_counter() - start
        still = []
        for i, result in zip(active, results):
            episode = episodes[i]
            episode.add(result)
            if result.error:
                task = i // sampling.n
                episode.error = (f"environment {type(env).__qualname__}, task {task} ({tasks[task].data_source}), "
                                 f"seed {seeds[task]}, turn {turn}: {result.error}")
            if result.done:
                episode.finish = result.finish or "answer"
            elif turn + 1 == limits.max_turns:
                episode.finish = "max_turns"
            elif i in cut:
                episode.finish = "context"
            else:
                last = episode.ids[-1] if episode.turn_ends and episode.turn_ends[-1] == len(episode.ids) - 1 else None
                delta = codec.delta_ids(_cut(result.messages, limits.max_tokens * CHARS_PER_TOKEN), last_sampled=last)
                if len(episode.ids) + len(delta) >= limits.max_tokens:  # no room left to sample
                    episode.finish = "context"
                else:
                    episode.append(delta, sampled=False)
                    still.append(i)
        active = still
        if not active:
            break
    return episodes


CHARS_PER_TOKEN = 64
"""More characters than any token covers: an observation longer than the episode's token budget
times this cannot fit, and is cut to it before the tokenizer reads it (a 10 MB tool output would
otherwise be tokenised whole, ~26 s, to learn that)."""


def _cut(messages: Sequence[Message], chars: int) -> Sequence[Message]:
    """``messages`` with each content cut to its first ``chars`` characters."""
    if all(len(m["content"]) <= chars for m in messages):
        return messages
    return [{**m, "content": m["content"][:chars]} for m in messages]


def episode_of_transcript(codec: ChatCodec, messages: Sequence[Message], *, stop: Sequence[str] = (),
                          template_kwargs: dict[str, Any] | None = None) -> Episode:
    """The episode of a whole conversation (a demonstration) as sampling would have built it: the
    messages before the first assistant message are the prompt, each assistant message's content
    is "sampled" (followed by the end-of-turn token, sampled too, unless the content ends with one
    of the ``stop`` strings, where sampling stops), every other message is delta ids."""
    first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), None)
    if first is None:
        raise ValueError("episode_of_transcript: the conversation has no assistant message")
    prompt = codec.initial_ids(messages[:first], **(template_kwargs or {}))
    episode, pending = Episode(list(prompt), len(prompt)), []
    for message in messages[first:]:
        if message["role"] != "assistant":
            pending.append(message)
            continue
        if pending:
            episode.append(codec.delta_ids(pending, last_sampled=episode.ids[-1]), sampled=False)
            pending = []
        ids = codec.tokenizer.encode(message["content"], add_special_tokens=False)
        if not any(message["content"].endswith(s) for s in stop):
            ids.append(codec.turn_end_id)
        episode.append(ids, sampled=True, logprobs=[0.0] * len(ids), version=0)
    if pending:
        raise ValueError("episode_of_transcript: the conversation must end with an assistant message")
    episode.finish = "answer"
    return episode


def episode_scores(episodes: Sequence[Episode], tool_bonus: float = 0.0) -> list[float]:
    """Each episode's score: its rewards summed, plus ``tool_bonus`` per tool call that did not fail."""
    return [e.reward + tool_bonus * e.successful_calls for e in episodes]


def episodes_rollout(episodes: Sequence[Episode], group: Sequence[int], *, pad_token_id: int,
                     version: int, temperature: float, device: str | torch.device = "cpu") -> Rollout:
    """The :class:`~purerl.batch.Rollout` of ``episodes`` on ``device`` (prompts left-padded, the
    rest right-padded; ``response_mask`` the sampled mask, ``behaviour_logprobs`` 0 off it).
    ``finish_reasons``: FINISH_LENGTH for episodes cut by the context budget, FINISH_EOS otherwise;
    ``temperature``: the one the log-probs were sampled at."""
    prompt_ids, prompt_mask = left_pad([e.ids[: e.prompt_length] for e in episodes], pad_token_id)
    width = max(1, max(len(e.ids) - e.prompt_length for e in episodes))
    shape = (len(episodes), width)
    ids = torch.full(shape, pad_token_id, dtype=torch.long)
    attention, sampled = torch.zeros(shape, dtype=torch.bool), torch.zeros(shape, dtype=torch.bool)
    logprobs = torch.zeros(shape, dtype=torch.float32)
    for row, e in enumerate(episodes):
        length = len(e.ids) - e.prompt_length
        ids[row, :length] = torch.tensor(e.ids[e.prompt_length:], dtype=torch.long)
        attention[row, :length] = True
        sampled[row, :length] = torch.tensor(e.sampled, dtype=torch.bool)
        logprobs[row, :length] = torch.tensor(e.logprobs, dtype=torch.float32)
    sequences = Sequences(torch.cat([prompt_ids, ids], 1), torch.cat([prompt_mask, attention], 1), sampled)
    reasons = torch.tensor([FINISH_LENGTH if e.finish == "context" else FINISH_EOS for e in episodes])
    rollout = Rollout(sequences, logprobs, reasons, torch.as_tensor(list(group), dtype=torch.long), version,
                      temperature)
    return tree_map(lambda x: x.to(device) if isinstance(x, Tensor) else x, rollout)  # no copy on the CPU


def turn_token_rewards(episodes: Sequence[Episode], scores: Tensor, width: int) -> Tensor:
    """``[b, width]`` token rewards: each turn's reward on its last sampled token, and what the
    score holds beyond them (the tool bonus, shaping, a reward model) on the episode's last, so a
    row sums to its score (``scores[b]``)."""
    out = torch.zeros((len(episodes), width), dtype=torch.float32, device=scores.device)
    for row, e in enumerate(episodes):
        ends = [end - e.prompt_length for end in e.turn_ends]
        for end, reward in zip(ends, e.turn_rewards):
            out[row, end] += reward
        if ends:
            out[row, ends[-1]] += float(scores[row]) - sum(e.turn_rewards[: len(ends)])
    return out


def episode_metrics(episodes: Sequence[Episode], prefix: str = "episode") -> dict[str, float]:
    """``{prefix}/turns_mean``, ``tool_calls_mean``, ``tool_errors``, ``tool_timeouts``, ``env_errors``
    (sums), ``new_segments`` (of agents' episodes: histories that did not extend them; a sum),
    ``observation_token_frac`` (observation tokens over every token after the prompts) and
    ``finish/<reason>`` (fractions of episodes)."""
    n = max(len(episodes), 1)
    after_prompt = sum(len(e.sampled) for e in episodes)
    metrics = {
        f"{prefix}/turns_mean": sum(len(e.turn_ends) for e in episodes) / n,
        f"{prefix}/tool_calls_mean": sum(e.counts.get("tool_calls", 0.0) for e in episodes) / n,
        f"{prefix}/tool_errors": sum(e.counts.get("tool_errors", 0.0) for e in episodes),
        f"{prefix}/tool_timeouts": sum(e.counts.get("tool_timeouts", 0.0) for e in episodes),
        f"{prefix}/env_errors": sum(e.counts.get("env_errors", 0.0) for e in episodes),
        f"{prefix}/observation_token_frac":
            sum(len(e.sampled) - sum(e.sampled) for e in episodes) / max(after_prompt, 1),
    }
    if any("new_segments" in e.counts for e in episodes):  # agents' episodes (purerl.agents)
        metrics[f"{prefix}/new_segments"] = sum(e.counts.get("new_segments", 0.0) for e in episodes)
    for reason in sorted({*FINISHES, *(e.finish for e in episodes)}):
        metrics[f"{prefix}/finish/{reason}"] = sum(e.finish == reason for e in episodes) / n
    return metrics
