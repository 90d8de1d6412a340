"""The supervised warm-up before RL: ``env.sft_steps`` SFT steps on the environment's
demonstrations of the training tasks (:func:`purerl.step.sft.sft_step`), on the driver's state
before the executor starts, so every executor begins RL from the warmed-up weights."""

import time
from collections.abc import Callable
from typing import Any

from purerl.config.sections import EnvConfig
from purerl.episodes.rollout import episode_of_transcript, episodes_rollout
from purerl.loop.task import Task
from purerl.models import CausalLM
from purerl.state import TrainState
from purerl.step.settings import Batching
from purerl.step.sft import sft_step

__all__ = ["warm_up"]


def warm_up(state: TrainState, task: Task, env_config: EnvConfig, policy: CausalLM,
            demonstration: Callable[[Any], list], *, optimizer: Any, batching: Batching = Batching(),
            device: str = "cpu", progress: bool = True) -> tuple[TrainState, dict[str, Any]]:
    """``env_config.sft_steps`` steps of ``env_config.sft_rows`` demonstrations each (the training
    tasks in order, cycling; ``demonstration(record)`` writes one as messages), with ``optimizer``
    (the actor's) in ``batching``'s micro-batches. Returns the state and a report: the steps, the
    first and last loss, the seconds taken."""
    setup = task.episodes
    if setup is None:
        raise ValueError("warm_up: the task has no environment (env.name single_turn has no demonstrations)")
    start, losses = time.perf_counter(), []
    for step in range(env_config.sft_steps):
        rows = [task.records[(step * env_config.sft_rows + i) % len(task.records)] for i in range(env_config.sft_rows)]
        played = [episode_of_transcript(setup.codec, demonstration(r), stop=setup.env.stop,
                                        template_kwargs=dict(setup.template_kwargs)) for r in rows]
        sequences = episodes_rollout(played, range(len(played)), pad_token_id=setup.pad_token_id, version=0,
                                     temperature=1.0, device=device).sequences
        state, metrics = sft_step(state, sequences, policy=policy, optimizer=optimizer, batching=batching)
        losses.append(metrics["sft/loss"])
        if metrics.get("sft/diverged") or metrics.get("sft/rejected_updates"):
            raise RuntimeError(f"SFT warm-up step {step + 1}: the update was not finite ({metrics})")
        if progress and (step + 1) % 10 == 0:
            print(f"sft step {step + 1}/{env_config.sft_steps} loss {losses[-1]:.4f}", flush=True)
    return state, {"sft_steps": env_config.sft_steps, "sft_loss_first": losses[0] if losses else None,
                   "sft_loss_last": losses[-1] if losses else None, "sft_seconds": time.perf_counter() - start}
