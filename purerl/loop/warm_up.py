"""The supervised warm-up before RL: ``env.sft_steps`` SFT steps on demonstrations of the training
tasks (:func:`purerl.step.sft.sft_step`), on the driver's state before the executor starts, so every
executor begins RL from the warmed-up weights. A demonstration is an environment's
(:mod:`purerl.environments`) or, for a single-turn task, the record's worked answer (``extra["answer"]``,
where verl's GSM8K data keeps its solutions and the procedural math problems write theirs)."""

import time
from collections.abc import Callable, Sequence
from typing import Any

from purerl.config.environment import EnvConfig
from purerl.data.demonstrations import Demonstration
from purerl.data.records import DataError
from purerl.episodes.rollout import Episode, episode_of_transcript, episodes_rollout
from purerl.loop.task import Task
from purerl.models import CausalLM
from purerl.state import TrainState
from purerl.step.settings import Batching
from purerl.step.sft import sft_step

__all__ = ["demonstrations", "file_demonstrations", "warm_up"]


def demonstrations(task: Task, encode: Callable[[str], list[int]], end_id: int) -> Callable[[int], Episode]:
    """The ``i``-th training task's demonstration as sampling would have built its episode: an environment's
    transcript (``task.episodes.demonstration``) through its chat codec; single-turn, the prompt's ids, then the
    record's worked answer encoded (``encode``) and ``end_id``, every answer token a target. Raises
    ``DataError`` naming the first record without a worked answer, before any step."""
    setup = task.episodes
    if setup is not None:
        if setup.demonstration is None:
            raise DataError(f"env.sft_steps: environment {type(setup.env).__name__} writes no demonstrations")
        return lambda i: episode_of_transcript(setup.codec, setup.demonstration(task.records[i]),
                                               stop=setup.env.stop, template_kwargs=dict(setup.template_kwargs))
    missing = next((i for i, r in enumerate(task.records) if not isinstance(r.extra.get("answer"), str)), None)
    if missing is not None:
        record = task.records[missing]
        asked = " ".join(m["content"] for m in record.messages if m["role"] == "user")[:60]
        raise DataError(f"env.sft_steps: training row {missing} ({record.data_source}: {asked!r}) has no worked "
                        "answer (extra_info.answer, where verl's GSM8K data keeps it): a single-turn warm-up "
                        "learns from it")

    return lambda i: _answered(list(task.prompt_ids[i]), [*encode(task.records[i].extra["answer"]), end_id])


def file_demonstrations(rows: Sequence[Demonstration], render: Callable[[Sequence[dict[str, str]]], list[int]],
                        encode: Callable[[str], list[int]], end_id: int) -> Callable[[int], Episode]:
    """The ``i``-th row of a user's SFT files as an episode: its prompt messages rendered as the RL prompts are
    (``render``: the job's prompt format), then its response encoded and ``end_id``, every response token a
    target."""
    return lambda i: _answered(render(rows[i].messages), [*encode(rows[i].response), end_id])


def _answered(prompt: list[int], answer: list[int]) -> Episode:
    out = Episode(prompt, len(prompt))
    out.append(answer, sampled=True, logprobs=[0.0] * len(answer), version=0)
    return out


def warm_up(state: TrainState, count: int, env_config: EnvConfig, policy: CausalLM,
            demonstration: Callable[[int], Episode], *, optimizer: Any, pad_token_id: int,
            batching: Batching = Batching(), device: str = "cpu",
            progress: bool = True) -> tuple[TrainState, dict[str, Any]]:
    """``env_config.sft_steps`` steps of ``env_config.sft_rows`` demonstrations each (the ``count``
    demonstrations in order, cycling; ``demonstration(i)`` is the ``i``-th one's episode,
    :func:`demonstrations` or :func:`file_demonstrations`), with ``optimizer`` (the actor's) in ``batching``'s
    micro-batches. Returns the state and a report: the steps, the demonstrations, the first and last loss, each
    step's loss, the seconds taken."""
    start, losses = time.perf_counter(), []
    for step in range(env_config.sft_steps):
        rows = [(step * env_config.sft_rows + i) % count for i in range(env_config.sft_rows)]
        played = [demonstration(i) for i in rows]
        sequences = episodes_rollout(played, range(len(played)), pad_token_id=pad_token_id, version=0,
                                     temperature=1.0, device=device).sequences
        state, metrics = sft_step(state, sequences, policy=policy, optimizer=optimizer, batching=batching)
        losses.append(metrics["sft/loss"])
        if metrics.get("sft/diverged") or metrics.get("sft/rejected_updates"):
            raise RuntimeError(f"SFT warm-up step {step + 1}: the update was not finite ({metrics})")
        if progress and (step + 1) % 10 == 0:
            print(f"sft step {step + 1}/{env_config.sft_steps} loss {losses[-1]:.4f}", flush=True)
    return state, {"sft_steps": env_config.sft_steps, "sft_demonstrations": count,
                   "sft_loss_first": losses[0] if losses else None, "sft_loss_last": losses[-1] if losses else None,
                   "sft_losses": losses, "sft_seconds": time.perf_counter() - start}
