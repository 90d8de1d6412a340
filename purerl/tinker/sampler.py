"""Sampler weights as numbered immutable snapshots, sampled by purerl's embedded engine.

A snapshot is a copy of a training model's trained leaves (the adapters, or every weight under full
fine-tuning) taken when ``save_weights_for_sampler`` runs, so later optimizer steps (which update
the params in place) never reach it; number 0 is the base model. One
:class:`~purerl.rollout.backends.torch.TorchEngine` over the base model serves every snapshot (per
set of stop tokens): it is synced to a snapshot's merged weights (:func:`purerl.tinker.trainer.sampler_params`)
when a request for another snapshot than the last comes.

Sampling settings: ``temperature`` (0: greedy), ``top_p``, ``top_k`` (-1: no limit), ``seed``
(none: a fresh one per request), ``max_tokens`` (none: the room left in the model's context, at
most the sampler's ``max_new_tokens``),
``stop`` (strings: generation ends once the text contains one, the token completing it kept; token
ids: they replace EOS as the tokens that end a sample, and are kept; ``[]``: only ``max_tokens``
ends a sample). The returned log-probs are those of the distribution each token was drawn from:
``log_softmax(logits / temperature)`` restricted by top-k/top-p and renormalised (greedy: the
untempered model's). They equal ``forward``'s learner log-probs only at temperature 1 without
truncation, so importance ratios of samples drawn at another temperature start away from 1.
"""

import secrets
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import attrs
import torch

from purerl.batch import FINISH_LENGTH
from purerl.models import CausalLM, Params
from purerl.rollout.backends.torch import TorchEngine
from purerl.rollout.sampling import SamplingParams
from purerl.state import RngState
from purerl.tinker.trainer import Trainable, sampler_params
from purerl.tree import tree_clone

__all__ = ["Sample", "Sampler", "Snapshot", "SamplingRequest"]

_NO_STOP = -1  # an id no sampled token has: the engine then stops rows at max_tokens only


@attrs.frozen(eq=False)
class Snapshot:
    """Sampler weights: ``number`` (0: the base), the ``trainable`` they belong to (None: the base)
    and a copy of its trained ``params``; ``path``: the ``tinker://`` name they were saved under."""

    number: int
    trainable: Trainable | None
    params: Params
    path: str | None = None

    @staticmethod
    def of(number: int, trainable: Trainable, params: Params, path: str | None = None) -> "Snapshot":
        return Snapshot(number, trainable, tree_clone(params), path)


@attrs.frozen
class SamplingRequest:
    """One ``asample`` request's settings, checked (see the module docstring)."""

    max_tokens: int | None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop_strings: tuple[str, ...] = ()
    stop_ids: tuple[int, ...] | None = None


@attrs.frozen
class Sample:
    """A sampled sequence: its token ids, their log-probs and whether it hit ``max_tokens`` (``length``)."""

    ids: list[int]
    logprobs: list[float]
    length: bool


class Sampler:
    """Samples snapshots of models over ``base`` (``base_params``) with its tokenizer's ``decode``
    (stop strings) and EOS ids; keeps up to ``engines`` engines (one per set of stop ids); an engine
    call samples at most ``max_rows`` rows; ``max_tokens`` None samples the room left in the
    ``context``, at most ``max_new_tokens`` (None: no cap)."""

    def __init__(self, base: CausalLM, base_params: Params, *, eos_ids: Sequence[int], decode: Any,
                 pad_id: int, context: int, device: torch.device, engines: int = 4, max_rows: int = 256,
                 max_new_tokens: int | None = None) -> None:
        self.base, self.base_params, self.eos_ids, self.decode = base, base_params, tuple(eos_ids), decode
        self.pad_id, self.context, self.device, self._limit, self.max_rows = pad_id, context, device, engines, max_rows
        self.max_new_tokens = max_new_tokens
        self._engines: OrderedDict[tuple[int, ...], TorchEngine] = OrderedDict()

    def _engine(self, stop_ids: tuple[int, ...]) -> TorchEngine:
        engine = self._engines.pop(stop_ids, None)
        if engine is None:
            engine = TorchEngine(self.base, eos_token_ids=stop_ids or (_NO_STOP,), pad_token_id=self.pad_id,
                                 decode=self.decode, device=self.device)
            while len(self._engines) >= self._limit:
                self._engines.popitem(last=False)[1].close()
        self._engines[stop_ids] = engine
        return engine

    def _weights(self, snapshot: Snapshot) -> Params:
        if snapshot.trainable is None:
            return self.base_params
        return sampler_params(snapshot.trainable, snapshot.params)

    def sample(self, snapshot: Snapshot, prompt: Sequence[int], n: int, request: SamplingRequest) -> list[Sample]:
        """``n`` samples continuing ``prompt`` from ``snapshot`` (``ValueError`` in one line for
        settings that cannot be honoured)."""
        (result,) = self.sample_many(snapshot, [prompt], n, request)
        if isinstance(result, ValueError):
            raise result
        return result

    def sample_many(self, snapshot: Snapshot, prompts: Sequence[Sequence[int]], n: int,
                    request: SamplingRequest) -> list[list[Sample] | ValueError]:
        """``n`` samples continuing each of ``prompts`` from ``snapshot``, all in engine calls of at most
        ``max_rows`` rows (each prompt is prefilled once for its ``n`` rows): per prompt, its samples,
        or the ``ValueError`` that refuses it (the others are sampled all the same)."""
        self._check(n, request)
        results: list[list[Sample] | ValueError] = [self._refusal(prompt, request) or [] for prompt in prompts]
        todo = [i for i, r in enumerate(results) if not isinstance(r, ValueError)]
        if not todo:
            return results
        engine = self._engine(self.eos_ids if request.stop_ids is None else tuple(sorted(set(request.stop_ids))))
        if engine.version != snapshot.number:
            engine.sync(self._weights(snapshot), snapshot.number)
        seed = secrets.randbits(62) if request.seed is None else request.seed % (2**62)
        limits: dict[int, list[int]] = {}  # max_tokens (None: each prompt's room) -> the prompts sampled with it
        for i in todo:
            limits.setdefault(self._max_tokens(prompts[i], request), []).append(i)
        per_call = max(1, self.max_rows // n)
        calls = [(limit, same[at:at + per_call]) for limit, same in limits.items()
                 for at in range(0, len(same), per_call)]
        for call, (max_tokens, chunk) in enumerate(calls):
            params = SamplingParams(max_new_tokens=max_tokens, temperature=request.temperature, top_p=request.top_p,
                                    top_k=max(request.top_k, 0), n=n, stop=request.stop_strings)
            rng = RngState(seed) if call == 0 else RngState(seed).fold_in(call)
            rollout = engine.generate([list(prompts[i]) for i in chunk], params, rng, version=snapshot.number)
            responses, mask = rollout.sequences.responses().cpu(), rollout.sequences.response_mask.cpu()
            logprobs, reasons = rollout.behaviour_logprobs.cpu(), rollout.finish_reasons.cpu()
            for k, i in enumerate(chunk):
                results[i] = [Sample(responses[r][mask[r]].tolist(), logprobs[r][mask[r]].tolist(),
                                     int(reasons[r]) == FINISH_LENGTH) for r in range(k * n, (k + 1) * n)]
        return results

    def _check(self, n: int, request: SamplingRequest) -> None:
        vocab = self.base.config.vocab_size
        if n < 1:
            raise ValueError(f"num_samples must be at least 1, got {n}")
        if request.top_k == 0 or request.top_k < -1:
            raise ValueError(f"top_k must be -1 (no limit) or at least 1, got {request.top_k}")
        if request.stop_ids is not None and any(not 0 <= t < vocab for t in request.stop_ids):
            raise ValueError(f"stop: token ids must be in the vocabulary [0, {vocab})")

    def _refusal(self, prompt: Sequence[int], request: SamplingRequest) -> ValueError | None:
        """Why ``prompt`` cannot be sampled with ``request`` (None: it can)."""
        vocab = self.base.config.vocab_size
        if not prompt or min(prompt) < 0 or max(prompt) >= vocab:
            return ValueError(f"prompt: needs at least one token, each in the vocabulary [0, {vocab})")
        room = self.context - len(prompt)
        max_tokens = self._max_tokens(prompt, request)
        if not 1 <= max_tokens <= room:
            return ValueError(f"max_tokens {max_tokens}: the prompt ({len(prompt)} tokens) leaves room for 1 to "
                              f"{room} in the model's context ({self.context})")
        return None

    def _max_tokens(self, prompt: Sequence[int], request: SamplingRequest) -> int:
        """The request's ``max_tokens`` for ``prompt`` (None: the room left, at most ``max_new_tokens``)."""
        if request.max_tokens is not None:
            return request.max_tokens
        room = self.context - len(prompt)
        return room if self.max_new_tokens is None else min(room, self.max_new_tokens)
