"""A decoding step of fixed shape, replayed per token for a batch padded to a bucket of rows, the
sampler inside the step.

On a GPU a decoding step of a small model is hundreds of small kernels; captured once as a CUDA
graph it is one launch per token (``BENCHMARKS.md``: 3.8-5.8× eager at 64-512 rows). What a replay
needs does not depend on the model family, and lives here:

- :class:`BucketedDecoder`: static buffers for a batch padded up to a *bucket* of rows, the step
  captured once per bucket and replayed per token; rows that finish leave the batch (their graph
  rows go on as padding) until a smaller bucket pays for its capture;
- :class:`GraphPolicy`: which bucket a batch gets, and when decoding stays eager instead (too few
  steps to pay for a capture, too many rows), so that a graph is never the slower choice;
- :data:`Capture`, the seam: :func:`cuda_graph` on a GPU, :func:`run_eagerly` (the step itself,
  run on each call) anywhere, so the whole logic runs and is tested on a CPU;
- :class:`RowSampler` and :func:`sampled`: the draw that follows the logits, inside the captured
  step (one replay = one token and its log-prob per row) or after an eager step.

Shapes: ``b`` rows of the engine's batch, ``B`` rows of the bucket (``b ≤ B``), ``v`` vocabulary.
"""

import contextlib
import math
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any, Protocol, runtime_checkable

import attrs
import torch
from jaxtyping import Int
from torch import Tensor

from purerl.checks import at_least, in_range

__all__ = ["EXACT", "BucketedDecoder", "Capture", "GraphPolicy", "RowSampler", "SampledDecoding", "capture_for",
           "cuda_graph", "run_eagerly", "sampled"]

Outputs = tuple[Tensor, ...]
Capture = Callable[[Callable[[], Outputs]], Callable[[], Outputs]]
"""Turns a step (no arguments: it reads and writes its static buffers) into its replay, which
returns the step's outputs: a CUDA graph captured once (:func:`cuda_graph`), or the step itself,
run on each call (:func:`run_eagerly`). Either way a replay reads the tensors the step read when
captured, with the values they hold at the replay."""

Sample = Callable[[Tensor, Tensor | None, Tensor | int], tuple[Tensor, Tensor]]
"""``(logits [b, v], keys [b] | None, step) -> (token [b], log-prob [b])``, fixed-shape and free
of host reads (:class:`purerl.rollout.sampling.TokenSampler`)."""

Advance = Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]
SampledDecoding = tuple[tuple[Tensor, Tensor], Advance, Callable[[Tensor], None] | None]
"""What a sampled decoding context yields: the first sampled ``(token [b], log-prob [b])`` (from
the prompts' last logits), ``advance(token [b], position [b, 1]) -> (token, log-prob)`` of the next
step, and ``keep(rows)``, which cuts the batch down to ``rows`` (None where it never would)."""


@attrs.frozen
class RowSampler:
    """How a batch's rows are sampled: ``sample`` (:data:`Sample`) with the rows' ``keys`` (None:
    greedy), the first token at step ``start`` and each later one at the next step."""

    sample: Sample
    keys: Int[Tensor, " b"] | None
    start: int = 0


@contextlib.contextmanager
def sampled(decoding: AbstractContextManager[Any], sampler: RowSampler) -> Iterator[SampledDecoding]:
    """A decoding of logits (``(logits, advance, keep)``, :data:`purerl.models.families.Decoding`)
    sampled eagerly after each step: the same draws as a captured step with the sampler inside."""
    with decoding as (logits, advance, keep):
        keys, step = sampler.keys, sampler.start

        def advance_sampled(token: Tensor, position: Tensor) -> tuple[Tensor, Tensor]:
            nonlocal step
            step += 1
            return sampler.sample(advance(token, position), keys, step)

        def keep_rows(rows: Tensor) -> None:
            nonlocal keys
            keep(rows)
            keys = None if keys is None else keys[rows]

        yield sampler.sample(logits, keys, step), advance_sampled, None if keep is None else keep_rows


def run_eagerly(step: Callable[[], Outputs]) -> Callable[[], Outputs]:
    """The :data:`Capture` that captures nothing: each replay runs ``step`` (a CPU, or a compiled
    step without a graph)."""
    return step


_CAPTURE_LOCK = threading.Lock()


def cuda_graph(step: Callable[[], Outputs], *, warmup: int = 2) -> Callable[[], Outputs]:
    """``step`` captured in a CUDA graph (after ``warmup`` eager runs on the capture's stream,
    which also compile a compiled step) and replayed by the returned function.

    Several generators (threads) decode beside the trainer on one GPU: a capture must not forbid
    their CUDA calls (the default "global" mode fails them and invalidates the capture), and
    captures run one at a time, each on its own stream."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with _CAPTURE_LOCK, torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
        outputs = step()

    def replay() -> Outputs:
        graph.replay()
        return outputs

    return replay


def capture_for(device: torch.device) -> Capture | None:
    """The capture decoding on ``device`` replays its steps with: CUDA graphs on a GPU, none elsewhere."""
    return cuda_graph if device.type == "cuda" else None


def _ascending(instance: Any, attribute: attrs.Attribute, value: tuple[int, ...]) -> None:
    if any(s < 1 for s in value) or list(value) != sorted(set(value)):
        raise ValueError(f"GraphPolicy.{attribute.name}: positive sizes in ascending order, got {value}")


@attrs.frozen
class GraphPolicy:
    """Which bucket of rows a batch's graph gets, and when decoding stays eager.

    A batch of ``b`` rows is padded up to the smallest of ``sizes`` that holds it, past the largest
    to a multiple of ``multiple``; above ``max_rows`` (None: no bound) it decodes eagerly. Padding
    rows cost little where a step reads its weights more than it computes (a GPU at these batch
    sizes: ``BENCHMARKS.md`` puts a 64-row step at 80 % of a 256-row one), and the buckets bound
    how many shapes a compiled step sees. A capture costs about three eager steps (two warm-up
    runs and the capture), so a call with fewer than ``min_steps`` steps left decodes eagerly: a
    graph is never the slower choice. When rows finish, the batch moves to a smaller bucket (a new
    capture) only if that bucket has at most ``shrink_ratio`` of the rows and ``shrink_steps``
    steps are left to repay it; until then finished rows go on in the graph as padding.
    """

    sizes: tuple[int, ...] = attrs.field(default=(8, 16, 32, 64), converter=tuple, validator=_ascending)
    multiple: int = attrs.field(default=64, validator=at_least(1))
    max_rows: int | None = 4096
    min_steps: int = attrs.field(default=8, validator=at_least(1))
    shrink_steps: int = attrs.field(default=64, validator=at_least(1))
    shrink_ratio: float = attrs.field(default=0.5, validator=in_range(0, 1, open_low=True))

    def bucket(self, rows: int) -> int | None:
        """The rows of the bucket that holds ``rows``; None above ``max_rows``."""
        if self.max_rows is not None and rows > self.max_rows:
            return None
        fits = [s for s in self.sizes if s >= rows]
        return fits[0] if fits else max([self.multiple * math.ceil(rows / self.multiple), *self.sizes[-1:]])

    def start(self, rows: int, steps: int) -> int | None:
        """The bucket to capture for ``rows`` rows and at most ``steps`` steps; None: decode eagerly."""
        return None if steps < self.min_steps else self.bucket(rows)

    def can_shrink(self, steps: int) -> bool:
        """Whether a call of ``steps`` steps could ever move to a smaller bucket (else its rows
        never need to leave the batch)."""
        return steps > self.shrink_steps

    def shrink(self, bucket: int, rows: int, steps: int) -> int | None:
        """The smaller bucket a graph of ``bucket`` rows moves to, ``rows`` of them still open and
        ``steps`` steps left; None: stay."""
        smaller = self.bucket(rows)
        if steps < self.shrink_steps or smaller is None or smaller >= bucket or smaller > bucket * self.shrink_ratio:
            return None
        return smaller


EXACT = GraphPolicy(sizes=(), multiple=1, max_rows=None, min_steps=1, shrink_steps=1, shrink_ratio=1.0)
"""Every batch its own size and no eager fallback: steps run eagerly anyway (:func:`run_eagerly`,
a compiled step on a CPU), so a bucket is never padded and finished rows leave at once."""


@runtime_checkable
class RowCache(Protocol):
    """A KV cache of fixed shape: ``valid [B, t]`` marks written slots; ``length`` slots are
    written; ``select_rows`` copies rows (:class:`purerl.models.families.kv_cache.StaticCache`)."""

    valid: Tensor
    length: int

    def select_rows(self, rows: Tensor) -> "RowCache": ...


Fused = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor | None, Any], Outputs]
"""``fused(token [B, 1], position [B, 1], index [1], step [1], keys [B] | None, cache) -> outputs``:
one decoding step of fixed shape (the token's keys and values to cache slot ``index``), then, with
a sampler, its draw at ``step``; outputs have ``B`` rows."""


def _padded(rows: Int[Tensor, " b"], bucket: int) -> Int[Tensor, " B"]:
    """``rows``, then copies of its last up to ``bucket`` entries: padding rows that decode a real
    row's tokens (no empty attention, no NaN), their outputs never read."""
    return torch.cat((rows, rows[-1:].expand(bucket - len(rows))))


class BucketedDecoder:
    """A :data:`Fused` step replayed per token for ``rows`` rows of ``cache`` padded up to
    ``bucket`` rows (a copy of the cache when padded).

    ``advance(token [b], position [b, 1])`` writes cache slot ``cache.length`` of every row,
    advances it, and returns the step's outputs for the batch's rows; the draws use ``keys`` at
    step ``step``, then the next. ``keep(rows)`` cuts the batch down to ``rows``: their graph rows
    stay where they are (the others go on as padding) unless ``policy`` moves them to a smaller
    bucket, copied and captured anew. ``steps``: how many steps the call has left at most.
    """

    def __init__(self, fused: Fused, cache: RowCache, keys: Int[Tensor, " b"] | None, *, step: int, steps: int,
                 policy: GraphPolicy, capture: Capture, bucket: int) -> None:
        self.fused, self.policy, self.capture = fused, policy, capture
        self.rows = cache.valid.shape[0]
        self.step, self.steps = step, steps
        self.live: Tensor | None = None
        """The graph rows of the batch's rows, in order; None: the first ``rows``."""
        self.captures: list[int] = []
        """The bucket of each capture, in order."""
        self._build(cache, keys, bucket, None)

    def _build(self, cache: RowCache, keys: Tensor | None, bucket: int, rows: Tensor | None) -> None:
        """Static buffers for ``bucket`` rows (``rows`` of ``cache`` and ``keys``, None: all,
        padded) and their step captured."""
        if rows is not None or bucket != cache.valid.shape[0]:
            index = _padded(torch.arange(self.rows, device=cache.valid.device) if rows is None else rows, bucket)
            cache, keys = cache.select_rows(index), None if keys is None else keys[index]
        device = cache.valid.device
        token, position = (torch.zeros((bucket, 1), dtype=torch.long, device=device) for _ in range(2))
        index = torch.full((1,), cache.length, dtype=torch.long, device=device)
        step = torch.zeros_like(index)
        self.cache, self.keys, self.bucket = cache, keys, bucket
        self.token, self.position, self.index, self.step_tensor = token, position, index, step
        valid = cache.valid.clone()  # warm-up runs write slot `index`: undone after the capture
        fused = self.fused
        self.replay = self.capture(lambda: fused(token, position, index, step, keys, cache))
        cache.valid.copy_(valid)
        self.captures.append(bucket)

    def advance(self, token: Int[Tensor, " b"], position: Int[Tensor, "b 1"]) -> Outputs:
        if self.live is None:
            self.token[: self.rows].copy_(token[:, None])
            self.position[: self.rows].copy_(position)
        else:  # index_copy_: no host read (a boolean mask or index_put_ may sync)
            self.token.index_copy_(0, self.live, token[:, None])
            self.position.index_copy_(0, self.live, position)
        self.index.fill_(self.cache.length)
        self.step_tensor.fill_(self.step)
        outputs = self.replay()
        self.cache.length += 1
        self.step, self.steps = self.step + 1, self.steps - 1
        if self.live is None:  # copies: the next replay overwrites the graph's outputs
            return tuple(o[: self.rows].clone() for o in outputs)
        return tuple(o.index_select(0, self.live) for o in outputs)

    def keep(self, rows: Int[Tensor, " r"]) -> None:
        live = rows if self.live is None else self.live[rows]
        self.rows = len(rows)
        smaller = self.policy.shrink(self.bucket, self.rows, self.steps)
        if smaller is None:
            self.live = live
            return
        self.live = None
        self._build(self.cache, self.keys, smaller, live)

    def kept_cache(self) -> RowCache:
        """The cache of the batch's rows only, in order (itself when nothing was padded or cut)."""
        if self.live is None and self.rows == self.bucket:
            return self.cache
        rows = self.live if self.live is not None else torch.arange(self.rows, device=self.cache.valid.device)
        return self.cache.select_rows(rows)

