"""What the model wrote, as rows for ``samples.jsonl``: a few of each step's training samples and
every held-out generation of an evaluation. They travel in the metrics dict (under
:data:`~purerl.io.metrics.SAMPLE_KEYS`) from where they are sampled to the metrics sinks, which
move them out (:meth:`purerl.io.metrics.MetricsLog.write`)."""

from collections.abc import Sequence
from typing import Any

from purerl.batch import FINISH_EOS, FINISH_INTERRUPTED, FINISH_LENGTH, FINISH_STOP, Rollout

__all__ = ["FINISH_NAMES", "rollout_finishes", "sample_rows", "spread"]

FINISH_NAMES = {FINISH_EOS: "eos", FINISH_LENGTH: "length", FINISH_STOP: "stop", FINISH_INTERRUPTED: "interrupted"}
"""A rollout's finish codes by the names ``samples.jsonl`` writes."""


def spread(rows: int, k: int) -> list[int]:
    """``k`` row indices spread evenly over ``rows`` (all of them when ``k >= rows``)."""
    if k >= rows:
        return list(range(rows))
    return [i * rows // k for i in range(k)]


def sample_rows(rows: Sequence[int], *, prompts: Sequence[str], responses: Sequence[str], rewards: Sequence[float],
                lengths: Sequence[int], finishes: Sequence[str], chars: int, indices: Sequence[int],
                turns: Sequence[int] | None = None, references: Sequence[str] | None = None,
                errors: Sequence[str] | None = None, **per_row: Sequence[Any]) -> list[dict[str, Any]]:
    """One row per index in ``rows``: the prompt's and the response's last ``chars`` characters,
    the reward, the response's length (tokens) and finish reason, the task's index, the reference
    answer (``reference``: the task's ground truth), the episode's turns, an ``env_error``
    episode's message (``error``, where it has one), and any ``per_row`` fields (``correct``, …)."""
    out = []
    for r in rows:
        row = {"index": indices[r], "prompt": prompts[r][-chars:], "response": responses[r][-chars:],
               "reward": float(rewards[r]), "length": int(lengths[r]), "finish": finishes[r]}
        if references is not None:
            row["reference"] = references[r]
        if turns is not None:
            row["turns"] = int(turns[r])
        if errors is not None and errors[r]:
            row["error"] = errors[r][-chars:]
        row.update({name: values[r] for name, values in per_row.items()})
        out.append(row)
    return out


def rollout_finishes(rollout: Rollout) -> list[str]:
    """Each row's finish reason by name (``eos``, ``length``, ``stop``, ``interrupted``)."""
    return [FINISH_NAMES.get(int(c), str(int(c))) for c in rollout.finish_reasons.tolist()]
