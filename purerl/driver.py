"""The driver loops: they sequence effects and call the step function, and do no maths.

    for each step: prompts (data cursor) → rollout (engine, weights version v) → rewards (timeouts)
                   → executor.step (the step function's pure stages) → sync weights (version v+1) → log
                   → evaluate every ``eval_every`` → checkpoint every ``checkpoint_every``

:func:`train` runs that in order; :func:`purerl.asynchronous.train_async` runs the first line on a
generator thread that keeps sampling while the trainer updates.

Everything the loop needs to continue lives in the :class:`~purerl.state.TrainState` (data
cursor, RNG counter, step), so a run resumed from a checkpoint repeats exactly what the
uninterrupted run would have done (asynchronously: batches still queued are discarded, and
generation restarts from the checkpoint's cursor and weights).
"""

import signal
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

from purerl.algo.dapo import overlong_penalty, varied_groups
from purerl.batch import Rewards, Rollout
from purerl.data.cursor import DataCursor, next_indices
from purerl.data.records import PromptRecord
from purerl.executors.base import Executor
from purerl.io.checkpoint import save_checkpoint
from purerl.io.metrics import MetricsLog
from purerl.rewards import RewardFn, Scores, math_reward, score_responses
from purerl.rollout.engine import RolloutEngine
from purerl.rollout.merge import concat_rollouts
from purerl.rollout.sampling import SamplingParams
from purerl.state import RngState, TrainState
from purerl.tree import replace

__all__ = ["Interrupted", "RewardMix", "RunConfig", "StepRecorder", "StopRequest", "Task", "decode_responses", "evaluate", "rollout_batch", "rollout_rng",
           "sample_batch", "train"]

@attrs.frozen
class Task:
    """Prompts as token ids, their records (ground truths), and the reward function."""

    prompt_ids: Sequence[Sequence[int]]
    records: Sequence[PromptRecord]
    reward_fn: RewardFn

    def __attrs_post_init__(self) -> None:
        if len(self.prompt_ids) != len(self.records) or not self.records:
            raise ValueError(f"Task: {len(self.prompt_ids)} prompts for {len(self.records)} records")


@attrs.frozen
class RewardMix:
    """How a response's reward is made: ``fn_weight·fn + model_weight·model + overlong``, where
    ``fn`` is the task's reward function, ``model`` the executor's reward model (used when
    ``model_weight`` ≠ 0) and ``overlong`` DAPO's length penalty (when ``overlong_buffer`` > 0;
    :func:`~purerl.algo.dapo.overlong_penalty`)."""

    fn_weight: float = 1.0
    model_weight: float = 0.0
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0


@attrs.frozen
class RunConfig:
    """``final_checkpoint``: also checkpoint the last step (and, on a stop request, the step
    stopped after) when ``checkpoint_every`` does not fall on it. ``greedy_baseline`` (ReMax):
    also generate one greedy response per prompt and pass its reward as the rows' baseline.
    ``dynamic_sampling`` (DAPO): drop groups whose rewards are all equal and sample the next
    prompts until ``prompts_per_step`` groups are kept, in at most ``max_sampling_rounds``
    rounds (then train on what was kept, or on the last round if nothing was)."""

    steps: int
    prompts_per_step: int
    sampling: SamplingParams
    eval_every: int = 0
    checkpoint_every: int = 0
    keep_checkpoints: int = 2
    reward_timeout: float = 10.0
    reward_penalty: float = 0.0
    final_checkpoint: bool = True
    rewards: RewardMix = RewardMix()
    greedy_baseline: bool = False
    dynamic_sampling: bool = False
    max_sampling_rounds: int = 4


class Interrupted(Exception):
    """A stop was requested (:class:`StopRequest`): the loop stopped after ``step``, with its
    checkpoint at ``checkpoint`` (None when no step had been trained)."""

    def __init__(self, step: int, checkpoint: Path | None) -> None:
        super().__init__(f"interrupted after step {step}" + (f"; checkpoint {checkpoint}" if checkpoint else ""))
        self.step, self.checkpoint = step, checkpoint


class StopRequest:
    """While entered, SIGINT and SIGTERM set :attr:`event` instead of killing the process: the
    training loops finish the step in flight, checkpoint it and raise :class:`Interrupted`. A
    second signal interrupts at once (``KeyboardInterrupt``). Main thread only."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        if self.event.is_set():
            raise KeyboardInterrupt
        self.event.set()

    def __enter__(self) -> "StopRequest":
        for signum in (signal.SIGINT, signal.SIGTERM):
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)


def decode_responses(rollout: Rollout, decode: Callable[[list[int]], str]) -> list[str]:
    """The text of every response (valid tokens only)."""
    seqs = rollout.sequences
    rows, masks = seqs.responses().tolist(), seqs.response_mask.tolist()  # two conversions, not 2·b
    return [decode([t for t, keep in zip(row, mask) if keep]) for row, mask in zip(rows, masks)]


def rollout_rng(rng: RngState, step: int) -> RngState:
    """The RNG of the rollout trained on at step ``step + 1``: a stream of its own, a function of
    the seed and the step alone, so a generator running ahead of the trainer (whose step function
    advances ``rng``'s counter) draws exactly what the synchronous loop draws."""
    return RngState(rng.fold_in(_ROLLOUT_STREAM).seed, step)


_ROLLOUT_STREAM = 1


def sample_batch(engine: RolloutEngine, task: Task, run: RunConfig, decode: Callable[[list[int]], str],
                 data: DataCursor, rng: RngState, version: int, *, score: Callable[..., Scores] = score_responses,
                 score_model: Callable[..., torch.Tensor] | None = None,
                 ) -> tuple[Rollout, Rewards, dict[str, float], DataCursor]:
    """The next prompts after ``data``, sampled from ``rng`` with weights ``version`` and scored
    (``score``: :func:`~purerl.rewards.score_responses`'s signature; ``score_model``: the
    executor's reward model, for ``run.rewards.model_weight``). With ``run.greedy_baseline`` the
    rewards carry each prompt's greedy score; with ``run.dynamic_sampling``, rounds of prompts
    until enough groups have varied rewards. Returns the rollout, its rewards, metrics, and the
    cursor after its prompts."""
    sampled: dict[str, float] = {}  # sums over the sampled rounds
    baseline_s = errors = timeouts = 0.0
    kept: list[tuple[Rollout, Rewards]] = []
    groups, rounds, cursor, n = 0, 0, data, run.sampling.n
    while True:
        indices, cursor = next_indices(cursor, len(task.records), run.prompts_per_step)
        prompts = [task.prompt_ids[i] for i in indices]
        round_rng = rng if rounds == 0 else rng.fold_in(rounds)
        rollout, rewards, sums = _scored_rollout(engine, task, run, decode, indices, prompts, round_rng, version,
                                                 score, score_model, run.sampling)
        for key, value in sums.items():
            sampled[key] = sampled.get(key, 0.0) + value
        if run.greedy_baseline:
            greedy = attrs.evolve(run.sampling, temperature=0.0, top_p=1.0, top_k=0, n=1)
            _, base, cost = _scored_rollout(engine, task, run, decode, indices, prompts, RngState(0), version,
                                            score, score_model, greedy)
            baseline_s += cost["gen_s"] + cost["reward_s"]
            errors, timeouts = errors + cost["errors"], timeouts + cost["timeouts"]
            rewards = attrs.evolve(rewards, baselines=base.scores.repeat_interleave(n))
        rounds += 1
        if not run.dynamic_sampling:
            kept.append((rollout, rewards))
            break
        varied = varied_groups(rewards.scores, rollout.group)
        groups += int(varied.sum()) // n
        if varied.any():
            kept.append((rollout.rows(varied.nonzero().squeeze(1)), rewards.rows(varied.nonzero().squeeze(1))))
        if groups >= run.prompts_per_step or rounds >= run.max_sampling_rounds:
            if not kept:  # nothing varied: train on the last round (its advantages are all 0)
                kept.append((rollout, rewards))
            break
    rollout = concat_rollouts([r for r, _ in kept], pad_token_id=_pad_id(kept[0][0]))
    rewards = Rewards(*(None if parts[0] is None else torch.cat(parts)
                        for parts in zip(*((w.scores, w.baselines, w.components) for _, w in kept))))
    metrics = {"reward/errors": sampled["errors"] + errors, "reward/timeouts": sampled["timeouts"] + timeouts,
               "timing/gen_s": sampled["gen_s"], "timing/reward_s": sampled["reward_s"],
               "perf/gen_tokens_per_s": sampled["tokens"] / max(sampled["gen_s"], 1e-9)}
    if run.greedy_baseline:
        metrics["timing/baseline_s"] = baseline_s
    for name in ("model", "overlong_penalty"):  # means over every sampled response, kept or not
        if name in sampled:
            metrics[f"reward/{name}_mean"] = sampled[name] / max(sampled["rows"], 1.0)
    if run.dynamic_sampling:
        rows = min(len(rewards.scores), run.prompts_per_step * n)
        index = torch.arange(rows, device=rewards.scores.device)
        rollout, rewards = rollout.rows(index), rewards.rows(index)
        metrics["sampling/rounds"] = float(rounds)
        metrics["sampling/varied_groups"] = float(groups)
    return rollout, rewards, metrics, cursor


def _pad_id(rollout: Rollout) -> int:
    """A token id for padding re-padded rows: any id works (attention and masks hide it); reuse one
    the engine padded with."""
    ids, attention = rollout.sequences.input_ids, rollout.sequences.attention_mask
    padded = ids[~attention]
    return int(padded[0]) if len(padded) else 0


def _scored_rollout(engine: RolloutEngine, task: Task, run: RunConfig, decode: Callable[[list[int]], str],
                    indices: list[int], prompts: list, rng: RngState, version: int, score: Callable[..., Scores],
                    score_model: Callable[..., torch.Tensor] | None,
                    sampling: SamplingParams) -> tuple[Rollout, Rewards, dict[str, float]]:
    """Generate ``sampling.n`` responses per prompt and reward them (:class:`RewardMix`). Returns
    the rollout, its rewards and sums: seconds (``gen_s``, ``reward_s``), ``errors``,
    ``timeouts``, ``rows``, ``tokens`` and the summed ``model`` scores and ``overlong_penalty``.
    GDPO's components: the rule reward (with the overlong penalty) and the model's score."""
    start = time.perf_counter()
    rollout = engine.generate(prompts, sampling, rng, version=version)
    sums = {"gen_s": time.perf_counter() - start, "rows": float(len(rollout.group)),
            "tokens": float(rollout.sequences.response_mask.sum())}
    texts = decode_responses(rollout, decode)
    records = [task.records[i] for i in indices for _ in range(sampling.n)]
    start = time.perf_counter()
    mix = run.rewards
    scored = score(task.reward_fn, texts, [r.ground_truth for r in records], timeout=run.reward_timeout,
                   penalty=run.reward_penalty, data_sources=[r.data_source for r in records],
                   extra_infos=[r.extra for r in records])
    device = rollout.sequences.input_ids.device
    rule = torch.tensor(scored.values, dtype=torch.float32, device=device)
    sums.update(errors=float(scored.errors), timeouts=float(scored.timeouts))
    total, columns = mix.fn_weight * rule, [rule]
    if mix.overlong_buffer:
        lengths = rollout.sequences.response_mask.sum(-1)
        penalty = overlong_penalty(lengths, sampling.max_new_tokens, mix.overlong_buffer, mix.overlong_penalty)
        sums["overlong_penalty"] = float(penalty.sum())
        total, columns = total + penalty, [rule + penalty]
    if mix.model_weight:
        if score_model is None:
            raise ValueError("RunConfig.rewards.model_weight needs an executor with a reward model")
        learned = score_model([_prompt_text(r) for r in records], texts).to(device=device, dtype=torch.float32)
        sums["model"] = float(learned.sum())
        columns.append(learned)
        total = total + mix.model_weight * learned
    sums["reward_s"] = time.perf_counter() - start
    return rollout, Rewards(total, components=torch.stack(columns, 1) if len(columns) > 1 else None), sums


def _prompt_text(record: PromptRecord) -> str:
    """What a reward model reads as the prompt: the last user message."""
    users = [m["content"] for m in record.messages if m.get("role") == "user"]
    return users[-1] if users else record.messages[-1]["content"]


def rollout_batch(state: TrainState, engine: RolloutEngine, task: Task, run: RunConfig,
                  decode: Callable[[list[int]], str], *, score: Callable[..., Scores] = score_responses,
                  score_model: Callable[..., torch.Tensor] | None = None,
                  ) -> tuple[TrainState, Rollout, Rewards, dict[str, float]]:
    """:func:`sample_batch` from the state's cursor with weights ``state.step`` and
    :func:`rollout_rng`: the state comes back with its cursor advanced."""
    rollout, rewards, metrics, cursor = sample_batch(engine, task, run, decode, state.data,
                                                     rollout_rng(state.rng, state.step), state.step, score=score,
                                                     score_model=score_model)
    return replace(state, data=cursor), rollout, rewards, metrics


def evaluate(state: TrainState, engine: RolloutEngine, task: Task, decode: Callable[[list[int]], str], *,
             max_new_tokens: int, batch_prompts: int = 32, score: Callable[..., Scores] = score_responses,
             reward_timeout: float = 10.0) -> dict[str, float]:
    """Greedy accuracy on ``task``: ``val/accuracy`` with the task's reward (score ≥ 1 counts as
    correct) and ``val/strict_accuracy`` counting only answers written after ``####`` or boxed.
    Rewards are scored like training's (``score``, under ``reward_timeout``): an answer whose
    check hangs or fails counts as wrong (``val/reward_timeouts``, ``val/reward_errors``)."""
    sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
    texts = []
    for start in range(0, len(task.records), batch_prompts):
        ids = task.prompt_ids[start:start + batch_prompts]
        texts += decode_responses(engine.generate(ids, sampling, RngState(0), version=state.step), decode)
    truths = [record.ground_truth for record in task.records]
    lenient = score(task.reward_fn, texts, truths, timeout=reward_timeout, penalty=0.0,
                    data_sources=[r.data_source for r in task.records], extra_infos=[r.extra for r in task.records])
    strict = score(math_reward, texts, truths, timeout=reward_timeout, penalty=0.0)
    n = len(task.records)
    return {"val/accuracy": sum(v >= 1.0 for v in lenient.values) / n,
            "val/strict_accuracy": sum(v >= 1.0 for v in strict.values) / n,
            "val/reward_timeouts": float(lenient.timeouts + strict.timeouts),
            "val/reward_errors": float(lenient.errors + strict.errors)}


def train(state: TrainState, *, executor: Executor, task: Task, run: RunConfig,
          decode: Callable[[list[int]], str], run_dir: str | Path, log: MetricsLog,
          evaluate_fn: Callable[[TrainState], dict[str, float]] | None = None,
          progress: bool = True, stop: threading.Event | None = None) -> TrainState:
    """Run steps ``state.step + 1 … run.steps`` on ``executor`` (already started with ``state``);
    returns the final (driver's) state. Checkpoints hold the executor's full state. ``stop``
    (e.g. :attr:`StopRequest.event`): once set, the loop checkpoints the step it finished and
    raises :class:`Interrupted`."""
    engine = executor.engine
    engine.sync(state.policy, version=state.step)
    with StepRecorder(state, executor, run, run_dir, log, evaluate_fn, progress, stop) as record:
        record.check(state)
        while state.step < run.steps:
            step_start = time.perf_counter()
            state, rollout, scores, metrics = rollout_batch(state, engine, task, run, decode, score=executor.score,
                                                            score_model=executor.score_model)
            train_start = time.perf_counter()
            state, step_metrics = executor.step(state, rollout, scores)
            metrics.update(step_metrics)
            engine.sync(state.policy, version=state.step)
            metrics["timing/train_s"] = time.perf_counter() - train_start
            metrics["timing/step_s"] = time.perf_counter() - step_start
            record(state, metrics)
        record.finish(state)
    return state


class StepRecorder:
    """After each trained step: evaluate every ``eval_every``, log, checkpoint every
    ``checkpoint_every``, advance the progress bar; then, if ``stop`` is set, checkpoint and raise
    :class:`Interrupted`. :meth:`finish` writes the final checkpoint."""

    def __init__(self, state: TrainState, executor: Executor, run: RunConfig, run_dir: str | Path, log: MetricsLog,
                 evaluate_fn: Callable[[TrainState], dict[str, float]] | None, progress: bool,
                 stop: threading.Event | None = None) -> None:
        from tqdm.auto import tqdm

        self.executor, self.run, self.run_dir, self.log, self.evaluate_fn = executor, run, run_dir, log, evaluate_fn
        self.stop, self.saved, self.first_step = stop, None, state.step
        self.bar = tqdm(total=run.steps, initial=state.step, disable=not progress, unit="step", dynamic_ncols=True)

    def _save(self, state: TrainState) -> Path:
        if self.saved is None or self.saved[0] != state.step:
            path = save_checkpoint(Path(self.run_dir) / "checkpoints", self.executor.full_state(state),
                                   step=state.step, keep=self.run.keep_checkpoints)
            self.saved = state.step, path
        return self.saved[1]

    def check(self, state: TrainState) -> None:
        """Raise :class:`Interrupted` if a stop was requested (checkpointing a step trained here)."""
        if self.stop is not None and self.stop.is_set():
            trained = state.step > self.first_step
            raise Interrupted(state.step, self._save(state) if trained and self.run.final_checkpoint else None)

    def finish(self, state: TrainState) -> None:
        """The end of the run: the final checkpoint."""
        if self.run.final_checkpoint and state.step > self.first_step:
            self._save(state)

    def __enter__(self) -> "StepRecorder":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.bar.close()

    def __call__(self, state: TrainState, metrics: dict[str, float]) -> None:
        run = self.run
        if self.evaluate_fn is not None and run.eval_every and state.step % run.eval_every == 0:
            metrics.update(self.evaluate_fn(state))
        self.log.write(state.step, metrics)
        if run.checkpoint_every and state.step % run.checkpoint_every == 0:
            self._save(state)
        self.bar.update(1)
        self.bar.set_postfix({
            "reward": f"{metrics.get('critic/score/mean', float('nan')):.3f}",
            "kl": f"{metrics.get('actor/kl_loss', metrics.get('actor/ppo_kl', float('nan'))):.4f}",
            "entropy": f"{metrics.get('actor/entropy', float('nan')):.3f}",
            "tok/s": f"{metrics['perf/gen_tokens_per_s']:.0f}",
        })
        self.check(state)
