"""Held-out evaluation: greedy answers to a task's prompts (of a multi-turn task: greedy episodes,
their last turn the answer), scored like training's rewards."""

import math
from collections.abc import Callable
from typing import Any

from purerl.episodes.rollout import episode_metrics
from purerl.loop.samples import rollout_finishes, sample_rows
from purerl.loop.sampling import decode_responses
from purerl.loop.task import Task
from purerl.rewards import Scores, score_responses
from purerl.rollout.engine import RolloutEngine
from purerl.rollout.sampling import SamplingParams
from purerl.state import RngState

__all__ = ["evaluate"]


def evaluate(engine: RolloutEngine, task: Task, *, version: int, max_new_tokens: int, reward_timeout: float,
             batch_timeout: float | None = None, score: Callable[..., Scores] = score_responses,
             batch_prompts: int = 32, sample_chars: int | None = None, stop: tuple[str, ...] = ()) -> dict[str, Any]:
    """Greedy answers with weights ``version`` (ended by EOS, ``max_new_tokens`` or, as in training, the
    ``stop`` strings); ``val/<name>`` for each of ``task.eval_fns``: the
    fraction scored ≥ 1 (of a multi-turn task: the last turn of each episode that ended with an
    answer; an episode cut short by its limits counts as wrong; ``val/episode/*``: the episode
    metrics). Answers are scored like training's (``score``, under ``reward_timeout``):
    an answer whose check hangs or fails counts as wrong (``val/reward_timeouts``,
    ``val/reward_errors``; their messages under ``val/reward_error_messages`` when there are any).
    With ``sample_chars``, every answer as a row of ``samples.jsonl`` under ``val/samples``
    (:mod:`purerl.loop.samples`; ``correct``: scored ≥ 1 by the first of ``eval_fns``, so the rows'
    mean is ``val/<that name>``). ``val/nonfinite_logprobs`` counts the answers' tokens whose
    log-prob under these weights is not finite (broken weights: the run stops on any)."""
    sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, n=1, stop=tuple(stop))
    texts, played, lengths, finishes, nonfinite = [], [], [], [], 0
    for start in range(0, len(task.records), batch_prompts):
        if task.episodes is not None:
            setup = task.episodes
            played += setup.play(engine, setup.env, setup.codec, task.records[start:start + batch_prompts], sampling,
                                 RngState(0), version, setup.limits, decode=task.decode,
                                 seeds=range(start, min(start + batch_prompts, len(task.records))),
                                 template_kwargs=dict(setup.template_kwargs), batch_timeout=batch_timeout)
            continue
        ids = task.prompt_ids[start:start + batch_prompts]
        rollout = engine.generate(ids, sampling, RngState(0), version=version)
        texts += decode_responses(rollout, task.decode)
        lengths += rollout.sequences.response_mask.sum(-1).tolist()
        nonfinite += int((rollout.sequences.response_mask & ~rollout.behaviour_logprobs.isfinite()).sum())
        finishes += rollout_finishes(rollout)
    records = task.records
    metrics: dict[str, Any] = episode_metrics(played, "val/episode") if played else {}
    nonfinite += sum(not math.isfinite(p) for e in played for p in e.logprobs)
    metrics["val/nonfinite_logprobs"] = float(nonfinite)  # the weights evaluated: the driver stops on any
    if played:  # an episode's answer is its last turn, when the environment took it as the answer
        texts = [e.actions[-1] if e.finish == "answer" else "" for e in played]
    timeouts, errors, messages, values = 0, 0, [], {}
    for name, fn in task.eval_fns.items():
        scored = score(fn, texts, [r.ground_truth for r in records], timeout=reward_timeout, penalty=0.0,
                       data_sources=[r.data_source for r in records], extra_infos=[r.extra for r in records],
                       batch_timeout=batch_timeout)
        values[name] = scored.values
        metrics[f"val/{name}"] = sum(v >= 1.0 for v in scored.values) / len(records)
        timeouts, errors = timeouts + scored.timeouts, errors + scored.errors
        messages += [f"{name}: {m}" for m in scored.error_messages]
    metrics.update({"val/reward_timeouts": float(timeouts), "val/reward_errors": float(errors)})
    if messages:
        metrics["val/reward_error_messages"] = messages
    if sample_chars is not None:
        first = values[next(iter(task.eval_fns))]
        if played:
            prompts = [task.decode(e.ids[: e.prompt_length]) for e in played]
            answers = [task.decode(e.ids[e.prompt_length:]) for e in played]
            lengths, finishes = [len(e.ids) - e.prompt_length for e in played], [e.finish for e in played]
        else:
            prompts, answers = [task.decode(list(ids)) for ids in task.prompt_ids], texts
        metrics["val/samples"] = sample_rows(
            range(len(records)), prompts=prompts, responses=answers, rewards=first, lengths=lengths, finishes=finishes,
            chars=sample_chars, indices=range(len(records)),
            turns=[len(e.turn_ends) for e in played] if played else None,
            references=[r.ground_truth for r in records], errors=[e.error for e in played] if played else None,
            correct=[v >= 1.0 for v in first],
            scores=[{n: v[i] for n, v in values.items()} for i in range(len(records))])
    return metrics
