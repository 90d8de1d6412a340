"""Sampling a step's batch: the next prompts, their responses from a rollout engine, their rewards.

:func:`sample_batch` is the one sampling path of both training loops: it generates ``sampling.n``
responses per prompt, scores them (the task's reward function under its deadline, the executor's
reward model, DAPO's overlong shaping: :func:`~purerl.rewards.mix.mixed_rewards`), and, as its
:class:`BatchPlan` asks, adds ReMax's greedy baselines or samples further rounds of prompts until
enough groups have varied rewards (DAPO's dynamic sampling).
"""

import re
import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch
from jaxtyping import Float, Int
from torch import Tensor

from purerl.algo.dapo import varied_groups
from purerl.batch import Rewards, Rollout
from purerl.config.sections import RewardConfig
from purerl.data.cursor import DataCursor, next_indices
from purerl.data.records import PromptRecord
from purerl.episodes.rollout import (
    Episode,
    episode_metrics,
    episode_scores,
    episodes_rollout,
    turn_token_rewards,
)
from purerl.loop.samples import rollout_finishes, sample_rows, spread
from purerl.loop.task import Episodes, Task
from purerl.rewards import Scores, score_responses
from purerl.rewards.mix import mixed_rewards, uses_reward_model
from purerl.rollout.engine import RolloutEngine
from purerl.rollout.merge import concat_rewards, concat_rollouts
from purerl.rollout.sampling import SamplingParams
from purerl.state import RngState, TrainState
from purerl.tree import replace

__all__ = ["BatchPlan", "SampledPart", "decode_responses", "joined_batch", "prompt_text", "rollout_batch",
           "rollout_rng", "sample_batch", "sample_part"]


@attrs.frozen
class BatchPlan:
    """How a step's batch is sampled and scored, bound once: ``prompts_per_step`` prompts, each
    sampled ``sampling.n`` times, scored as the ``reward`` section says; ``greedy_baselines``:
    each prompt's greedy response scored too (ReMax); ``dynamic_sampling`` (DAPO): rounds of
    prompts, at most ``max_sampling_rounds``, until enough groups have varied rewards;
    ``samples_per_step`` rows of ``samples.jsonl``, texts cut to ``sample_chars`` characters."""

    sampling: SamplingParams = SamplingParams()
    prompts_per_step: int = 8
    reward: RewardConfig = RewardConfig()
    greedy_baselines: bool = False
    dynamic_sampling: bool = False
    max_sampling_rounds: int = 4
    samples_per_step: int = 4
    sample_chars: int = 1000


def decode_responses(rollout: Rollout, decode: Callable[[list[int]], str]) -> list[str]:
    """The text of every response (valid tokens only)."""
    seqs = rollout.sequences
    rows, masks = seqs.responses().tolist(), seqs.response_mask.tolist()  # two conversions, not 2·b
    return [decode([t for t, keep in zip(row, mask) if keep]) for row, mask in zip(rows, masks)]


def prompt_text(record: PromptRecord) -> str:
    """What a reward model reads as the prompt: the last user message."""
    users = [m["content"] for m in record.messages if m.get("role") == "user"]
    return users[-1] if users else record.messages[-1]["content"]


_ROLLOUT_STREAM = 1


def rollout_rng(rng: RngState, step: int) -> RngState:
    """The RNG of the rollout trained on at step ``step + 1``: a stream of its own, a function of
    the seed and the step alone, so a generator running ahead of the trainer (whose step function
    advances ``rng``'s counter) draws exactly what the synchronous loop draws."""
    return RngState(rng.fold_in(_ROLLOUT_STREAM).seed, step)


Score = Callable[..., Scores]
ScoreModel = Callable[[Sequence[str], Sequence[str]], torch.Tensor]


@attrs.frozen(eq=False)
class SampledPart:
    """Some consecutive prompts of a batch, sampled and scored: ``sums`` are what the batch's
    metrics are made of (added over parts: seconds, counts, rows, tokens; ``episodes`` and
    ``messages`` joined), ``data`` the cursor after its prompts."""

    rollout: Rollout
    rewards: Rewards
    sums: dict[str, Any]
    data: DataCursor


def sample_batch(engine: RolloutEngine, task: Task, plan: BatchPlan, data: DataCursor, rng: RngState,
                 version: int, *, score: Score = score_responses,
                 score_model: ScoreModel | None = None) -> tuple[Rollout, Rewards, dict[str, float], DataCursor]:
    """The next ``data.prompts_per_step`` prompts after ``data``, sampled from ``rng`` with weights
    ``version`` and scored (``score``: :func:`~purerl.rewards.score_responses`'s signature;
    ``score_model``: the executor's reward model, when ``reward.model`` is used). With an
    estimator that needs baselines, the rewards carry each prompt's greedy score; with
    ``algorithm.dynamic_sampling``, rounds of prompts until enough groups have varied rewards.
    Returns the rollout, its rewards, metrics (with the failed calls' messages under
    ``reward/error_messages`` when there are any, and ``reward/all_failed`` when no call
    succeeded), and the cursor after its prompts."""
    part = sample_part(engine, task, plan, data, rng, version, score=score, score_model=score_model)
    return (*joined_batch([part], plan), part.data)


def sample_part(engine: RolloutEngine, task: Task, plan: BatchPlan, data: DataCursor, rng: RngState,
                version: int, *, prompts: int | None = None, score: Score = score_responses,
                score_model: ScoreModel | None = None) -> SampledPart:
    """The next ``prompts`` prompts after ``data`` (default: a whole step's), as
    :func:`sample_batch` samples them. A part's samples do not depend on how a batch is cut
    into parts: every sample draws from its own stream (its prompt's index, its sample index).
    Dynamic sampling's rounds need the whole batch in one part."""
    sampling, prompts_per_step = plan.sampling, plan.prompts_per_step
    n = sampling.n
    prompts = prompts_per_step if prompts is None else prompts
    if plan.dynamic_sampling and prompts != prompts_per_step:
        raise ValueError(f"sample_part: dynamic sampling samples whole batches ({prompts_per_step} prompts), "
                         f"not {prompts}")
    baselines = plan.greedy_baselines
    sampled: dict[str, Any] = {"messages": [], "baseline_s": 0.0, "baseline_rows": 0.0}  # sums over the rounds
    kept: list[tuple[Rollout, Rewards]] = []
    groups, rounds, cursor = 0, 0, data
    while True:
        indices, cursor = next_indices(cursor, len(task.records), prompts)
        round_rng = rng if rounds == 0 else rng.fold_in(rounds)
        rollout, rewards, sums, failed = _scored_rollout(engine, task, plan, indices, round_rng, version, score,
                                                         score_model, sampling)
        sampled["messages"] += failed
        for key, value in sums.items():
            sampled[key] = sampled.get(key, [] if isinstance(value, list) else 0.0) + value
        if baselines:
            greedy = attrs.evolve(sampling, temperature=0.0, top_p=1.0, top_k=0, n=1)
            _, base, cost, failed = _scored_rollout(engine, task, plan, indices, RngState(0), version, score,
                                                    score_model, greedy)
            sampled["messages"] += failed
            sampled["baseline_rows"] += cost["rows"]
            sampled["baseline_s"] += cost["gen_s"] + cost["reward_s"]
            sampled["errors"] += cost["errors"]
            sampled["timeouts"] += cost["timeouts"]
            sampled["rule_failed"] += cost["rule_failed"]
            rewards = attrs.evolve(rewards, baselines=base.scores.repeat_interleave(n))
        rounds += 1
        if not plan.dynamic_sampling:
            kept.append((rollout, rewards))
            break
        varied = varied_groups(rewards.scores, rollout.group)
        groups += int(varied.sum()) // n
        if varied.any():
            kept.append((rollout.rows(varied.nonzero().squeeze(1)), rewards.rows(varied.nonzero().squeeze(1))))
        if groups >= prompts_per_step or rounds >= plan.max_sampling_rounds:
            if not kept:  # nothing varied: train on the last round (its advantages are all 0)
                kept.append((rollout, rewards))
            break
    rollout = concat_rollouts([r for r, _ in kept], pad_token_id=_pad_id(kept[0][0]))
    rewards = concat_rewards([w for _, w in kept], rollout.sequences.response_length)
    if plan.dynamic_sampling:
        rows = min(len(rewards.scores), prompts_per_step * n)
        index = torch.arange(rows, device=rewards.scores.device)
        rollout, rewards = rollout.rows(index), rewards.rows(index)
        sampled["sampling/rounds"], sampled["sampling/varied_groups"] = float(rounds), float(groups)
    return SampledPart(rollout, rewards, sampled, cursor)


def joined_batch(parts: Sequence[SampledPart], plan: BatchPlan) -> tuple[Rollout, Rewards, dict[str, Any]]:
    """One batch of ``parts`` (consecutive, in prompt order): the joined rollout (its version the
    oldest part's: staleness counts from it) and rewards, and the batch's metrics."""
    rollout = concat_rollouts([p.rollout for p in parts], pad_token_id=_pad_id(parts[0].rollout),
                              mixed_versions=True)
    rewards = concat_rewards([p.rewards for p in parts], rollout.sequences.response_length)
    sampled: dict[str, Any] = {}
    for part in parts:
        for key, value in part.sums.items():
            sampled[key] = sampled[key] + value if key in sampled else value
    metrics: dict[str, Any] = {
        "reward/errors": sampled["errors"], "reward/timeouts": sampled["timeouts"], "timing/gen_s": sampled["gen_s"],
        "timing/reward_s": sampled["reward_s"],
        "perf/gen_tokens_per_s": sampled["tokens"] / max(sampled["gen_s"], 1e-9)}
    if plan.greedy_baselines:
        metrics["timing/baseline_s"] = sampled["baseline_s"]
    if "episodes" in sampled:
        metrics.update(episode_metrics(sampled["episodes"]))
        metrics["timing/env_s"] = sampled["env_s"]
    if sampled.get("samples"):  # taken out before logging, into samples.jsonl (purerl.io.metrics)
        metrics["samples/train"] = sampled["samples"][: plan.samples_per_step]
    if sampled["messages"]:  # only when some call failed: taken out before logging (purerl.loop.recording)
        metrics["reward/error_messages"] = sampled["messages"]
        if sampled["rule_failed"] >= sampled["rows"] + sampled["baseline_rows"]:  # a failing judge alone is not
            metrics["reward/all_failed"] = 1.0
    for name in ("model", "judge", "overlong_penalty"):  # means over every sampled response, kept or not
        if name in sampled:
            metrics[f"reward/{name}_mean"] = sampled[name] / max(sampled["rows"], 1.0)
    for name in ("sampling/rounds", "sampling/varied_groups"):
        if name in sampled:
            metrics[name] = sampled[name]
    metrics.update(signal_metrics(rewards.scores, rollout.group, sampled["rule_positive"], sampled["rows"]))
    rule = sampled["rule_values"]
    metrics["health/rule_spread"] = float(max(rule) - min(rule)) if rule else 0.0
    if "reference_held" in sampled:
        metrics["health/reference_held_frac"] = sampled["reference_held"] / max(sampled["rows"], 1.0)
        metrics["health/reference_unrewarded_frac"] = (sampled["reference_unrewarded"]
                                                       / max(sampled["reference_held"], 1.0))
    return rollout, rewards, metrics


def holds_reference(text: str, reference: str) -> bool:
    """Whether ``text`` contains ``reference`` as a whole token (not inside a longer number or word):
    a response the task's reward may be expected to credit (the health monitor's ``reward.fn`` check)."""
    reference = reference.strip()
    return bool(reference) and re.search(rf"(?<![\w.]){re.escape(reference)}(?!\w)", text) is not None


def signal_metrics(scores: Float[Tensor, " b"], group: Int[Tensor, " b"], rule_positive: float,
                   rows: float) -> dict[str, float]:
    """What the health monitor (:mod:`purerl.health`) reads beyond the step's own metrics: the
    fraction of the batch's groups whose rewards are all equal (``health/no_signal_frac``: their
    advantages are 0), the spread of its rewards (``health/reward_spread``, max − min) and the fraction
    of every sampled response whose task reward was above 0 (``health/rule_positive_frac``,
    ``rule_positive`` of ``rows``)."""
    varied = varied_groups(scores, group)
    groups = torch.unique(group)
    varied_count = torch.unique(group[varied]).numel()
    spread = float(scores.max() - scores.min()) if scores.numel() else 0.0
    return {"health/no_signal_frac": 1.0 - varied_count / max(groups.numel(), 1), "health/reward_spread": spread,
            "health/rule_positive_frac": rule_positive / max(rows, 1.0)}


def _pad_id(rollout: Rollout) -> int:
    """A token id for padding re-padded rows: any id works (attention and masks hide it); reuse one
    the engine padded with."""
    ids, attention = rollout.sequences.input_ids, rollout.sequences.attention_mask
    padded = ids[~attention]
    return int(padded[0]) if len(padded) else 0


def _scored_rollout(engine: RolloutEngine, task: Task, plan: BatchPlan, indices: list[int], rng: RngState,
                    version: int, score: Score, score_model: ScoreModel | None,
                    sampling: SamplingParams) -> tuple[Rollout, Rewards, dict[str, float], list[str]]:
    """Generate ``sampling.n`` responses per prompt and reward them. Returns the rollout, its
    rewards, sums (seconds ``gen_s`` and ``reward_s``, ``errors``, ``timeouts``, ``rows``,
    ``tokens``, the summed ``model`` scores and ``overlong_penalty``) and the failed calls' messages."""
    reward = plan.reward
    if task.episodes is not None:
        rollout, scored, sums = _episode_rollout(engine, task, task.episodes, indices, rng, version, sampling,
                                                 reward.batch_timeout, reward.penalty)
        texts = [episode.actions[-1] if episode.actions else "" for episode in sums["episodes"]]
    else:
        start = time.perf_counter()
        rollout = engine.generate([task.prompt_ids[i] for i in indices], sampling, rng, version=version,
                                  streams=indices)
        sums = {"gen_s": time.perf_counter() - start}
        texts = decode_responses(rollout, task.decode)
    sums.update(rows=float(len(rollout.group)), tokens=float(rollout.sequences.response_mask.sum()))
    records = [task.records[i] for i in indices for _ in range(sampling.n)]
    start = time.perf_counter()
    if task.episodes is None:
        scored = score(task.reward_fn, texts, [r.ground_truth for r in records], timeout=reward.timeout,
                       penalty=reward.penalty, data_sources=[r.data_source for r in records],
                       extra_infos=[r.extra for r in records], batch_timeout=reward.batch_timeout)
    device = rollout.sequences.input_ids.device
    rule = torch.tensor(scored.values, dtype=torch.float32, device=device)
    rule_failed = float(scored.errors + scored.timeouts)  # the task's own reward calls: the judge's apart
    judged = None
    if task.judge is not None:
        verdicts = task.judge([prompt_text(r) for r in records], texts, [r.ground_truth for r in records])
        judged = torch.tensor(verdicts.values, dtype=torch.float32, device=device)
        scored = Scores(scored.values, scored.errors + verdicts.errors, scored.timeouts + verdicts.timeouts,
                        [*scored.error_messages, *verdicts.error_messages])
    sums.update(errors=float(scored.errors), timeouts=float(scored.timeouts), rule_failed=rule_failed,
                rule_positive=float((rule > 0).sum()), rule_values=scored.values)
    if task.episodes is None:
        held = [holds_reference(text, r.ground_truth) for text, r in zip(texts, records)]
        sums.update(reference_held=float(sum(held)),
                    reference_unrewarded=float(sum(h and v <= 0 for h, v in zip(held, scored.values))))
    learned = None
    if uses_reward_model(reward):
        if score_model is None:
            raise ValueError("reward.model is used, but the executor has no reward model")
        learned = score_model([prompt_text(r) for r in records], texts).to(device=device, dtype=torch.float32)
    rewards, parts = mixed_rewards(rule, rollout.sequences.response_mask.sum(-1), learned, reward=reward,
                                   max_new_tokens=sampling.max_new_tokens, judged=judged)
    if task.episodes is not None and task.episodes.limits.per_turn_rewards:
        rewards = attrs.evolve(rewards, token_rewards=turn_token_rewards(sums["episodes"], rewards.scores,
                                                                         rollout.sequences.response_length))
    sums.update(parts)
    sums["reward_s"] = time.perf_counter() - start
    if plan.samples_per_step:
        sums["samples"] = _training_samples(task, indices, sampling.n, rollout, texts, rewards.scores.tolist(),
                                            sums.get("episodes"), plan)
    return rollout, rewards, sums, scored.error_messages


def _training_samples(task: Task, indices: list[int], n: int, rollout: Rollout, texts: list[str],
                      scores: list[float], episodes: list[Episode] | None, plan: BatchPlan) -> list[dict[str, Any]]:
    """``trainer.samples_per_step`` rows of ``samples.jsonl``, spread over the batch (an episode's
    response: everything after its prompt, observations included)."""
    rows = spread(len(texts), plan.samples_per_step)
    prompts, responses = [""] * len(texts), list(texts)
    for r in rows:
        if episodes is None:
            prompts[r] = task.decode(list(task.prompt_ids[indices[r // n]]))
        else:
            prompts[r] = task.decode(episodes[r].ids[: episodes[r].prompt_length])
            responses[r] = task.decode(episodes[r].ids[episodes[r].prompt_length:])
    finishes = rollout_finishes(rollout) if episodes is None else [e.finish for e in episodes]
    return sample_rows(rows, prompts=prompts, responses=responses, rewards=scores,
                       lengths=rollout.sequences.response_mask.sum(-1).tolist(), finishes=finishes,
                       chars=plan.sample_chars, indices=[indices[r // n] for r in range(len(texts))],
                       turns=None if episodes is None else [len(e.turn_ends) for e in episodes],
                       references=[task.records[indices[r // n]].ground_truth for r in range(len(texts))],
                       errors=None if episodes is None else [e.error for e in episodes])


def _episode_rollout(engine: RolloutEngine, task: Task, episodes: Episodes, indices: list[int], rng: RngState,
                     version: int, sampling: SamplingParams, batch_timeout: float | None,
                     penalty: float) -> tuple[Rollout, Scores, dict[str, Any]]:
    """``sampling.n`` episodes per prompt (played by ``episodes.play``, the environment kind's; task
    ``i`` resets with seed ``i``, so a prompt's episodes replay), their rollout and scores (the
    environment's rewards with the tool bonus; ``penalty`` for an episode whose environment
    returned a bad reward or messages, counted and its message kept as a reward error's), and
    sums: ``gen_s`` (sampling and stepping), ``env_s`` and the ``episodes``."""
    timings: dict[str, float] = {}
    played = episodes.play(engine, episodes.env, episodes.codec, [task.records[i] for i in indices], sampling, rng,
                           version, episodes.limits, decode=task.decode, seeds=indices,
                           template_kwargs=dict(episodes.template_kwargs), batch_timeout=batch_timeout, timings=timings)
    group = [j for j in range(len(indices)) for _ in range(sampling.n)]
    rollout = episodes_rollout(played, group, pad_token_id=episodes.pad_token_id, version=version,
                               temperature=sampling.logprob_temperature, device=engine.device)
    values = [penalty if e.error else v for e, v in zip(played, episode_scores(played, episodes.limits.tool_bonus))]
    failed = [e.error for e in played if e.error]
    scores = Scores(values, len(failed), 0, failed)
    return rollout, scores, {"gen_s": timings.get("gen_s", 0.0) + timings.get("env_s", 0.0),
                             "env_s": timings.get("env_s", 0.0), "episodes": played}


def rollout_batch(state: TrainState, engine: RolloutEngine, task: Task, plan: BatchPlan, *,
                  score: Score = score_responses, score_model: ScoreModel | None = None,
                  ) -> tuple[TrainState, Rollout, Rewards, dict[str, float]]:
    """:func:`sample_batch` from the state's cursor with weights ``state.step`` and
    :func:`rollout_rng`: the state comes back with its cursor advanced."""
    rollout, rewards, metrics, cursor = sample_batch(engine, task, plan, state.data,
                                                     rollout_rng(state.rng, state.step), state.step, score=score,
                                                     score_model=score_model)
    return replace(state, data=cursor), rollout, rewards, metrics
