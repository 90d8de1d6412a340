"""The driver loop: it sequences effects and calls the step function, and does no maths.

    for each step: prompts (data cursor) → rollout (engine, weights version v) → rewards (timeouts)
                   → executor.step (the step function's pure stages) → sync weights (version v+1) → log
                   → evaluate every ``eval_every`` → checkpoint every ``checkpoint_every``

Everything the loop needs to continue lives in the :class:`~purerl.state.TrainState` (data
cursor, RNG counter, step), so a run resumed from a checkpoint repeats exactly what the
uninterrupted run would have done.
"""

import time
from collections.abc import Callable, Sequence
from pathlib import Path

import attrs
import torch

from purerl.batch import Rollout
from purerl.checkpoint import save_checkpoint
from purerl.data.cursor import next_indices
from purerl.data.records import PromptRecord
from purerl.executors.local import Executor
from purerl.metrics_log import MetricsLog
from purerl.rewards import RewardFn, Scores, math_reward, score_responses
from purerl.rollout.engine import RolloutEngine
from purerl.rollout.sampling import SamplingParams
from purerl.state import RngState, TrainState
from purerl.tree import replace

__all__ = ["Task", "RunConfig", "rollout_batch", "decode_responses", "evaluate", "train"]

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
class RunConfig:
    steps: int
    prompts_per_step: int
    sampling: SamplingParams
    eval_every: int = 0
    checkpoint_every: int = 0
    keep_checkpoints: int = 2
    reward_timeout: float = 10.0
    reward_penalty: float = 0.0


def decode_responses(rollout: Rollout, decode: Callable[[list[int]], str]) -> list[str]:
    """The text of every response (valid tokens only)."""
    seqs = rollout.sequences
    rows, masks = seqs.responses().tolist(), seqs.response_mask.tolist()  # two conversions, not 2·b
    return [decode([t for t, keep in zip(row, mask) if keep]) for row, mask in zip(rows, masks)]


def rollout_batch(state: TrainState, engine: RolloutEngine, task: Task, run: RunConfig,
                  decode: Callable[[list[int]], str], *, score: Callable[..., Scores] = score_responses,
                  ) -> tuple[TrainState, Rollout, torch.Tensor, dict[str, float]]:
    """Draw the next prompts, sample, and score (with ``score``, :func:`~purerl.rewards.score_responses`'s
    signature): the state comes back with cursor and RNG advanced."""
    indices, cursor = next_indices(state.data, len(task.records), run.prompts_per_step)
    start = time.perf_counter()
    rollout = engine.generate([task.prompt_ids[i] for i in indices], run.sampling, state.rng, version=state.step)
    gen_seconds = time.perf_counter() - start
    texts = decode_responses(rollout, decode)
    truths = [task.records[i].ground_truth for i in indices for _ in range(run.sampling.n)]
    start = time.perf_counter()
    scores = score(task.reward_fn, texts, truths, timeout=run.reward_timeout, penalty=run.reward_penalty)
    tokens = int(rollout.sequences.response_mask.sum())
    metrics = {
        "reward/errors": float(scores.errors),
        "reward/timeouts": float(scores.timeouts),
        "timing/gen_s": gen_seconds,
        "timing/reward_s": time.perf_counter() - start,
        "perf/gen_tokens_per_s": tokens / max(gen_seconds, 1e-9),
    }
    state = replace(state, data=cursor, rng=state.rng.next())
    device = rollout.sequences.input_ids.device
    return state, rollout, torch.tensor(scores.values, dtype=torch.float32, device=device), metrics


def evaluate(state: TrainState, engine: RolloutEngine, task: Task, decode: Callable[[list[int]], str], *,
             max_new_tokens: int, batch_prompts: int = 32) -> dict[str, float]:
    """Greedy accuracy on ``task``: ``val/accuracy`` with the task's reward (score ≥ 1 counts as
    correct) and ``val/strict_accuracy`` counting only answers written after ``####`` or boxed."""
    sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
    correct = strict = 0
    for start in range(0, len(task.records), batch_prompts):
        ids = task.prompt_ids[start:start + batch_prompts]
        rollout = engine.generate(ids, sampling, RngState(0), version=state.step)
        for text, record in zip(decode_responses(rollout, decode), task.records[start:start + batch_prompts]):
            correct += task.reward_fn(text, record.ground_truth) >= 1.0
            strict += math_reward(text, record.ground_truth) >= 1.0
    n = len(task.records)
    return {"val/accuracy": correct / n, "val/strict_accuracy": strict / n}


def train(state: TrainState, *, executor: Executor, task: Task, run: RunConfig,
          decode: Callable[[list[int]], str], run_dir: str | Path, log: MetricsLog,
          evaluate_fn: Callable[[TrainState], dict[str, float]] | None = None,
          progress: bool = True) -> TrainState:
    """Run steps ``state.step + 1 … run.steps`` on ``executor`` (already started with ``state``);
    returns the final (driver's) state. Checkpoints hold the executor's full state."""
    from tqdm.auto import tqdm

    engine = executor.engine
    engine.sync(state.policy, version=state.step)
    bar = tqdm(total=run.steps, initial=state.step, disable=not progress, unit="step", dynamic_ncols=True)
    try:
        while state.step < run.steps:
            step_start = time.perf_counter()
            state, rollout, scores, metrics = rollout_batch(state, engine, task, run, decode, score=executor.score)
            train_start = time.perf_counter()
            state, step_metrics = executor.step(state, rollout, scores)
            metrics.update(step_metrics)
            engine.sync(state.policy, version=state.step)
            metrics["timing/train_s"] = time.perf_counter() - train_start
            metrics["timing/step_s"] = time.perf_counter() - step_start
            if evaluate_fn is not None and run.eval_every and state.step % run.eval_every == 0:
                metrics.update(evaluate_fn(state))
            log.write(state.step, metrics)
            if run.checkpoint_every and state.step % run.checkpoint_every == 0:
                save_checkpoint(Path(run_dir) / "checkpoints", executor.full_state(state), step=state.step,
                                keep=run.keep_checkpoints)
            bar.update(1)
            bar.set_postfix({
                "reward": f"{metrics.get('critic/score/mean', float('nan')):.3f}",
                "kl": f"{metrics.get('actor/kl_loss', metrics.get('actor/ppo_kl', float('nan'))):.4f}",
                "entropy": f"{metrics.get('actor/entropy', float('nan')):.3f}",
                "tok/s": f"{metrics['perf/gen_tokens_per_s']:.0f}",
            })
    finally:
        bar.close()
    return state
