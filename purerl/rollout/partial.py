"""Interruptible rollouts: a generator stops mid-generation when newer weights are published,
keeps what it sampled, loads the new weights and continues the unfinished rows.

    generate (version v, interrupt = "a newer version is out")
      → rows still open stop with FINISH_INTERRUPTED after k tokens
    load version v' → generate each open row again: its prompt + its k tokens as the prompt, its
      own sample stream from decoding step k on (one row per prompt) → splice → repeat

Every token keeps the behaviour log-prob of the weights that sampled it, so the off-policy
correction stays exact; the rollout carries the oldest version (staleness counts from the oldest
token). Without a weights change in between, a continued row draws exactly the numbers of an
uninterrupted one (:func:`~purerl.rollout.sampling.sample_uniforms` with ``samples`` and ``start``).
"""

from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch

from purerl.batch import FINISH_INTERRUPTED, Rollout, Sequences
from purerl.rollout.engine import RolloutEngine, release
from purerl.rollout.engines import ENGINES
from purerl.rollout.queue import Weights
from purerl.rollout.sampling import SamplingParams
from purerl.state import RngState

__all__ = ["Interruptible", "spliced"]


class Interruptible:
    """A rollout engine whose ``generate`` gives way to newer weights: ``newer(version)`` returns
    weights newer than ``version`` (or None), ``load(weights)`` puts them into ``engine``.
    ``interruptions`` counts the times it did, ``continued_rows`` the rows it continued."""

    def __init__(self, engine: RolloutEngine, newer: Callable[[int], Weights | None],
                 load: Callable[[Weights], None]) -> None:
        if not engine.kind.interruptible:
            able = ", ".join(name for name in ENGINES.names() if ENGINES[name].interruptible)
            raise ValueError(f"{type(engine).__name__} ({engine.kind.name}) cannot be interrupted "
                             f"(asynchronous.interruptible needs an engine that can: {able})")
        self.engine, self.newer, self.load = engine, newer, load
        # its own generate takes no ``interrupt``: it gives way to newer weights by itself
        self.kind = attrs.evolve(engine.kind, interruptible=False)
        self.pad_token_id, self.device = engine.pad_token_id, engine.device
        self.interruptions = self.continued_rows = 0

    @property
    def version(self) -> int | None:
        return self.engine.version

    def sync(self, params: Any, version: int) -> None:
        self.engine.sync(params, version)

    def release(self) -> None:
        release(self.engine)

    def close(self) -> None:
        """The engine is its owner's to close."""

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, rng: RngState, *,
                 version: int | None = None, streams: Sequence[int] | None = None) -> Rollout:
        """:meth:`RolloutEngine.generate`, continued on newer weights whenever they appear."""
        version = self.engine.version if version is None else version
        streams = list(range(len(prompts)) if streams is None else streams)
        seen: list[Weights] = []  # the newer weights that interrupted the last call

        def interrupt(held: int) -> bool:
            weights = self.newer(held)
            if weights is not None:
                seen[:] = [weights]
            return weights is not None

        rollout = self.engine.generate(prompts, sampling, rng, version=version, streams=streams,
                                       interrupt=lambda: interrupt(version))
        while True:
            open_rows = (rollout.finish_reasons == FINISH_INTERRUPTED).nonzero().squeeze(-1).tolist()
            if not open_rows:
                return rollout
            self.load(seen.pop())
            now = self.engine.version
            seqs = rollout.sequences
            done = seqs.response_mask.sum(-1).tolist()  # an open row's tokens are all alive
            ids, attention = seqs.input_ids.tolist(), seqs.attention_mask.tolist()
            self.interruptions += 1
            self.continued_rows += len(open_rows)
            for k in sorted({done[r] for r in open_rows}):  # shards of several workers stop at different steps
                rows = [r for r in open_rows if done[r] == k]
                more = self.engine.generate(
                    [[t for t, keep in zip(ids[r], attention[r]) if keep] for r in rows],
                    attrs.evolve(sampling, n=1, max_new_tokens=sampling.max_new_tokens - k), rng, version=now,
                    streams=[streams[r // sampling.n] for r in rows], samples=[r % sampling.n for r in rows],
                    start=k, interrupt=lambda: interrupt(now))
                rollout = spliced(rollout, rows, more, self.pad_token_id)


def spliced(rollout: Rollout, rows: Sequence[int], more: Rollout, pad_token_id: int) -> Rollout:
    """``rollout`` with rows ``rows`` (interrupted: their ``k`` response tokens all alive) continued
    by ``more``'s rows (one each, in order, their prompts those rows' prompt + response): each
    continuation goes right after its row's ``k`` tokens, with its log-probs, mask, finish reason
    and routing (the continuation's prefill also routed the row's ``k``-th token, which the
    interrupted call sampled but never ran); the version is the oldest of the two."""
    seqs, extra = rollout.sequences, more.sequences
    t, w = seqs.response_length, extra.response_length
    done = seqs.response_mask.sum(-1).tolist()
    width = max(t, max(done[r] for r in rows) + w)
    pad = lambda x, value: torch.nn.functional.pad(x, (0, width - t), value=value)  # noqa: E731
    tokens, alive = pad(seqs.responses(), pad_token_id), pad(seqs.response_mask, False)
    logprobs, reasons = pad(rollout.behaviour_logprobs, 0.0), rollout.finish_reasons.clone()
    continued = extra.responses()
    prompt, extra_prompt = seqs.input_ids.shape[1] - t, extra.input_ids.shape[1] - w
    routing = None
    if seqs.routing is not None and extra.routing is not None:
        routing = torch.nn.functional.pad(seqs.routing, (0, 0, 0, 0, 0, width - t), value=-1)
    for i, r in enumerate(rows):
        k = done[r]
        tokens[r, k:k + w], alive[r, k:k + w] = continued[i], extra.response_mask[i]
        logprobs[r, k:k + w], reasons[r] = more.behaviour_logprobs[i], more.finish_reasons[i]
        if routing is not None:
            routing[r, prompt + k - 1:prompt + k + w] = extra.routing[i, extra_prompt - 1:]
    return Rollout(Sequences(torch.cat([seqs.input_ids[:, :prompt], tokens], 1),
                             torch.cat([seqs.attention_mask[:, :prompt], alive], 1), alive, routing),
                   logprobs, reasons, rollout.group, min(rollout.version, more.version), rollout.temperature)
