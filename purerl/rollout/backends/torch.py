"""The embedded engine: batched prefill and KV-cache decoding in the trainer's process, CPU or one GPU.

The rollout engine of kind ``torch`` (:data:`purerl.rollout.engines.ENGINES`). Models of a family with a lean
decoder (:mod:`purerl.models.families`) decode through it (a static KV cache, CUDA graphs on GPU); every other
model through its HF module and a dynamic cache.
"""

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from purerl.batch import FINISH_EOS, FINISH_INTERRUPTED, FINISH_LENGTH, FINISH_STOP, Rollout, left_pad, rollout_of
from purerl.models import CausalLM, Params, cast_floating
from purerl.models.families import Decoding
from purerl.models.families.decode_graph import GraphPolicy, RowSampler, SampledDecoding, sampled
from purerl.models.families.kv_cache import StaticCache
from purerl.models.families.moe import has_experts
from purerl.rollout.engine import check_weights
from purerl.rollout.engines import ENGINES
from purerl.rollout.sampling import SamplingParams, TokenSampler, sample_keys
from purerl.state import RngState

__all__ = ["EngineSession", "TorchEngine", "left_pad"]


class TorchEngine:
    """The embedded engine: prefill + KV-cache decode with the policy's own skeleton.

    Colocated with the trainer: :meth:`sync` keeps a reference to the params (no copy), so the
    donated optimizer update and the engine share buffers; the version tag records which update
    they hold (a LoRA policy's adapters are merged into a copy of the base once per version
    instead: decoding then costs what the base's does). ``decode`` (token ids → text) is needed
    only for stop strings. Models of a family with a lean decoder (``model.family``: Llama, Qwen2,
    SmolLM2, Qwen3, Gemma 3) decode through it (a static KV cache, no module dispatch); ``lean=False`` forces the
    HF module path, which every other model takes. On CUDA the lean decoding step and the sampler
    after it are captured as one CUDA graph per generate call and bucket of rows, and replayed
    once per token (``cuda_graphs=False`` turns that off; ``graphs``: the buckets, and when a call
    decodes eagerly instead,
    :class:`~purerl.models.families.decode_graph.GraphPolicy`). ``compile_decode``: that
    fixed-shape step, sampler included, compiled by ``torch.compile`` (inside the graph on CUDA;
    on a CPU it replaces the sliced step and oneDNN's products). Rows that finish early leave the
    decoding batch (``drop_finished=False`` keeps them; in a CUDA graph they go on as padding until
    a smaller bucket pays). The decoding loop writes each step's tokens and log-probs into
    buffers allocated once and reads the device's state on the host only every
    ``host_check_every`` steps (a GPU: 8).
    ``dtype`` (e.g. ``"bfloat16"``; default the model's ``compute_dtype``, else the params' own):
    decode with the weights cast to it, a copy per version (on a
    CPU with bfloat16 instructions, decoding's skinny products read half the bytes and run ~3×
    faster); the log-probs are then the cast model's, so the trainer recomputes its own
    (``actor.recompute_old_logprobs``) and the off-policy correction sees the difference.
    ``onednn``: on a CPU, the lean decoder's projections run oneDNN's products on weights
    prepacked once per version (:class:`~purerl.models.families.onednn.OneDNNLinear`;
    ~2x the decoding rate of ``torch.mm`` here, the same float32 to rounding; a copy of the
    weights per version), where the build has oneDNN.
    """

    kind = ENGINES["torch"]

    def __init__(self, model: CausalLM, *, eos_token_ids: Sequence[int], pad_token_id: int,
                 decode: Callable[[list[int]], str] | None = None, device: str | torch.device = "cpu",
                 lean: bool = True, cuda_graphs: bool = True, drop_finished: bool = True,
                 dtype: str | torch.dtype | None = None, onednn: bool = True,
                 host_check_every: int | None = None, compile_decode: bool = False,
                 graphs: GraphPolicy = GraphPolicy()) -> None:
        if not eos_token_ids:
            raise ValueError("TorchEngine: at least one EOS token id is needed")
        self.model = model
        self.eos = torch.tensor(sorted(set(eos_token_ids)), dtype=torch.long, device=device)
        self.pad_token_id = pad_token_id
        self.decode = decode
        self.device = torch.device(device)
        self._params: Params | None = None
        self._decoder: Any = None  # what the lean decoder reads (the family's decoder_weights of the params)
        self.version: int | None = None
        self.lean = lean and model.family is not None
        """True when decoding runs the model family's lean decoder (not the HF module)."""
        self.records_routing = self.lean and has_experts(model.config)
        """True when rollouts carry the experts each token went to (:attr:`purerl.batch.Sequences.routing`):
        a mixture-of-experts model on the lean decoder."""
        self.cuda_graphs = cuda_graphs
        self.graphs = graphs
        self.compile_decode = compile_decode and self.lean
        self.onednn = onednn and not self.compile_decode  # the compiled step reads plain weights
        self.drop_finished = drop_finished
        self.host_check_every = host_check_every
        """Decoding steps between the host's reads of how many rows are still open (each a device
        sync on a GPU; there rows cannot leave a CUDA graph's batch anyway). None: every step on a
        CPU (where finished rows leave the batch as soon as it pays), every 8 on a GPU."""
        self.dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        if self.dtype is not None and not self.dtype.is_floating_point:
            raise ValueError(f"TorchEngine: dtype {dtype!r} is not a floating-point type")
        if self.dtype is not None and not self.lean:
            raise ValueError("TorchEngine: dtype needs the lean decoder (a model of a lean family, lean=True); the HF "
                             "module decodes in the model's own dtype")

    def sync(self, params: Params, version: int) -> None:
        params = self.model.merged(params)  # a LoRA policy decodes merged: at the base's speed
        if self.lean:  # the HF module path casts per call (CausalLM.bound)
            params = cast_floating(params, self.dtype or self.model.compute_dtype)
        self._params, self._decoder = params, None  # the previous version's copy goes before the next is made
        self._decoder = self.model.family.decoder_weights(self.model, params, onednn=self.onednn) if self.lean else None
        self.version = version

    def release(self) -> None:
        """Drop the prepared copy of the weights (the lean decoder's prepacked matrices) and the params it holds."""
        self._params, self._decoder, self.version = None, None, None

    close = release  # the trainer's params and a prepared copy

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, rng: RngState,
                 *, version: int | None = None, streams: Sequence[int] | None = None,
                 interrupt: Callable[[], bool] | None = None, samples: Sequence[int] | None = None,
                 start: int = 0) -> Rollout:
        return self._generate(prompts, sampling, rng, version, streams=streams, interrupt=interrupt,
                              samples=samples, start=start)

    def session(self) -> "EngineSession":
        """Generate calls that continue one another (the turns of episodes): see :class:`EngineSession`."""
        return EngineSession(self)

    def _generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, rng: RngState,
                  version: int | None, continuing: "_Continuation | None" = None,
                  streams: Sequence[int] | None = None, interrupt: Callable[[], bool] | None = None,
                  samples: Sequence[int] | None = None, start: int = 0) -> Rollout:
        check_weights("TorchEngine", self._params is not None, self.version, version)
        if sampling.stop and self.decode is None:
            raise ValueError("TorchEngine: stop strings need a decode function")
        prompt_ids, prompt_mask = (x.to(self.device) for x in left_pad(prompts, self.pad_token_id))
        # inference mode: ~10 % less overhead per op than no_grad; its tensors are cloned out of
        # it, as autograd may not save them
        with torch.inference_mode():
            streams = range(len(prompts)) if streams is None else streams
            if continuing is None:
                decoded = self._decode(prompt_ids, prompt_mask, sampling, rng, streams, interrupt=interrupt,
                                       samples=samples, start=start)
            else:
                decoded = self._decode(*continuing.new_ids, sampling, rng, streams, positions=continuing.positions,
                                       context=functools.partial(continuing.context, self, sampling), drop=False,
                                       samples=samples)
        tokens, logprobs, alive, reasons = (x.clone() for x in decoded[:4])
        routing = None if decoded[4] is None else tuple(x.clone() for x in decoded[4])
        return rollout_of(prompt_ids, prompt_mask, tokens, logprobs, alive, reasons, sampling.n, self.version,
                          sampling.logprob_temperature, routing)

    def _decode(self, ids: Tensor, mask: Tensor, sampling: SamplingParams, rng: RngState, streams: Sequence[int], *,
                positions: Tensor | None = None,
                context: Callable[[RowSampler], contextlib.AbstractContextManager[SampledDecoding]] | None = None,
                drop: bool | None = None, interrupt: Callable[[], bool] | None = None,
                samples: Sequence[int] | None = None, start: int = 0):
        """Sample ``sampling.n`` responses for each of the ``[g, P]`` left-padded prompts: rows
        ``i·n … i·n+n-1`` continue prompt ``i``, whose prefill runs once for all of them.

        Rows that finish stop costing compute: once a quarter of the rows still in the batch have
        finished, the batch (and its KV cache) is cut down to the open rows (unless ``drop`` is
        False). ``context``: the sampled decoding to run, given the sampler (default: prefill
        ``ids`` at ``positions``, which default to the attended positions). ``interrupt``: polled
        after each step; once True, the open rows end with ``FINISH_INTERRUPTED``. ``samples`` /
        ``start``: the draws of :func:`~purerl.rollout.sampling.sample_uniforms` (continued rows).
        Returns the tokens, their log-probs, the alive mask, the finish reasons and, where the engine
        records routing (and ``context`` is None), the prompts' ``[g, P, l, k]`` and the responses'
        ``[rows, t, l, k]`` experts (None otherwise).
        """
        rows = ids.shape[0] * sampling.n
        # one uniform draw per output row and step, whether or not the row is still in the batch: a
        # function of (rng, the row's stream and sample index, the step) only, drawn where the step
        # is sampled (inside a CUDA graph, on the device)
        keys = None if sampling.greedy else sample_keys(rng, streams, sampling.n, samples=samples).to(self.device)
        sampler = RowSampler(TokenSampler.of(sampling), keys, start)
        eos = int(self.eos[0]) if len(self.eos) == 1 else self.eos
        if positions is None:
            positions = (mask.long().cumsum(-1) - 1).clamp_min(0)
        drop_finished = self.drop_finished if drop is None else drop
        active = torch.arange(rows, device=self.device)  # the batch's rows, as rows of the output
        batch = rows  # len(active)
        finished = torch.zeros(rows, dtype=torch.bool, device=self.device)  # of the batch's rows
        ended = torch.zeros(rows, dtype=torch.bool, device=self.device)  # of the output rows, once dropped
        stopped = torch.zeros(rows, dtype=torch.bool, device=self.device)  # by a stop string (rows never drop)
        interrupted = False
        # what each step samples, written in place (no per-step tensors to assemble afterwards)
        shape = (rows, sampling.max_new_tokens)
        tokens = torch.full(shape, self.pad_token_id, dtype=torch.long, device=self.device)
        logps = torch.zeros(shape, dtype=torch.float32, device=self.device)
        alive = torch.zeros(shape, dtype=torch.bool, device=self.device)
        check_every = self.host_check_every or (1 if self.device.type == "cpu" else 8)
        capacity = ids.shape[1] + sampling.max_new_tokens
        routed: list[Tensor] | None = [] if self.records_routing and context is None else None
        decoding = (self._model_steps(ids, mask, positions, sampling.n, capacity, sampler, routed) if context is None
                    else context(sampler))
        with decoding as ((token, logp), advance, keep):
            position = positions[:, -1:].repeat_interleave(sampling.n, 0) + 1
            if routed is not None:  # the prefill's; then each step's routing of the token it ran
                prompt_routes = routed.pop()
                routes = prompt_routes.new_full((rows, sampling.max_new_tokens, *prompt_routes.shape[2:]), -1)
            for step in range(sampling.max_new_tokens):
                live = ~finished  # a finished row's later tokens are padding, EOS or not
                at = (slice(None) if batch == rows else active, step)
                alive[at] = live
                tokens[at] = torch.where(live, token, self.pad_token_id)
                logps[at] = torch.where(live, logp, 0.0)
                hit = token == eos if isinstance(eos, int) else torch.isin(token, eos)
                if sampling.stop:
                    now = self._stop_hits(tokens[:, max(0, step - 31): step + 1], finished | hit, sampling.stop)
                    stopped, hit = stopped | now, hit | now
                finished = finished | hit
                if step + 1 == sampling.max_new_tokens:
                    break
                if interrupt is not None and interrupt():
                    interrupted = True
                    break
                # the host reads the batch's state only every check_every steps (a device sync on a GPU)
                if (step + 1) % check_every == 0 or sampling.stop:
                    still_open = batch - int(finished.sum())
                    if still_open == 0:
                        break
                    if (drop_finished and keep is not None and not sampling.stop
                            and still_open <= 0.75 * batch):
                        kept = (~finished).nonzero().squeeze(-1)
                        ended[active] = finished
                        active, finished, batch = active[kept], finished[kept], still_open
                        token, position = token[kept], position[kept]
                        keep(kept)
                token, logp = advance(token, position)
                if routed is not None:  # the step ran this step's tokens: their routing
                    routes[slice(None) if batch == rows else active, step] = routed.pop()[:, 0]
                position = position + 1
        ended[active] = finished
        reasons = torch.where(stopped, FINISH_STOP, torch.where(ended, FINISH_EOS, FINISH_LENGTH))
        if interrupted:
            reasons = torch.where(ended, reasons, FINISH_INTERRUPTED)
        # the steps some row was still open at (between host reads, all rows may have finished earlier)
        taken = int(alive[:, : step + 1].any(0).sum())
        routing = None if routed is None else (prompt_routes, routes[:, :taken])
        return tokens[:, :taken], logps[:, :taken], alive[:, :taken], reasons, routing

    def _model_steps(self, ids: Tensor, mask: Tensor, positions: Tensor, n: int, capacity: int,
                     sampler: RowSampler, routed: list[Tensor] | None = None,
                     ) -> contextlib.AbstractContextManager[SampledDecoding]:
        """Prefill the ``[g, P]`` prompts and decode ``n`` rows from each, sampled by ``sampler``
        (:data:`~purerl.models.families.decode_graph.SampledDecoding`): the family's lean decoder,
        or the HF module with its dynamic cache. ``routed``: where each forward's routing is appended."""
        if self.lean:
            options = self._decoding_options(sampler)
            if routed is not None:
                options["routes"] = routed.append
            return self.model.family.decoding(self.model, self._decoder, ids, mask, positions, n, capacity, **options)
        return sampled(_module_decoding(self.model, self._params, ids, mask, positions, n), sampler)

    def _decoding_options(self, sampler: RowSampler) -> dict[str, Any]:
        """The lean decoder's keywords: the sampler, CUDA graphs and their buckets, compilation."""
        return dict(sampler=sampler, cuda_graphs=self.cuda_graphs, graphs=self.graphs, compile=self.compile_decode)

    def _stop_hits(self, window: Tensor, finished: Tensor, stop: tuple[str, ...]) -> Tensor:
        """Rows (not yet finished) whose response text now contains a stop string; ``window``: the
        rows' last (up to 32) sampled tokens."""
        window = window.tolist()
        longest = max(len(s) for s in stop)
        hits = torch.zeros_like(finished)
        for row in (~finished).nonzero().flatten().tolist():
            last = self.decode(window[row][-1:])
            text = self.decode(window[row])
            # only a match that the newest token completed: the tail ending at this token
            tail = text[-(longest + len(last)):]
            if any(s in tail and s not in tail[: len(tail) - len(last)] for s in stop):
                hits[row] = True
        return hits


@contextlib.contextmanager
def _module_decoding(model: CausalLM, params: Params, ids: Tensor, mask: Tensor, positions: Tensor,
                     n: int) -> Iterator[Decoding]:
    """:data:`~purerl.models.families.Decoding` through the HF module and its dynamic cache (any causal LM)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    attention = mask.long().repeat_interleave(n, 0)
    with model.bind(params) as module:
        def step(token: Tensor, position: Tensor) -> Tensor:
            nonlocal attention
            attention = torch.cat([attention, torch.ones_like(attention[:, :1])], 1)
            return module(input_ids=token[:, None], attention_mask=attention, position_ids=position,
                          **model.cache_arguments(cache)).logits[:, -1]

        def keep(rows: Tensor) -> None:
            nonlocal attention
            attention = attention[rows]
            cache.batch_select_indices(rows)

        out = module(input_ids=ids, attention_mask=mask.long(), position_ids=positions, logits_to_keep=1,
                     **model.cache_arguments(cache))
        if n > 1:
            cache.batch_repeat_interleave(n)
        yield out.logits[:, -1].repeat_interleave(n, 0), step, keep


class EngineSession:
    """Generate calls of one engine that continue one another, as the turns of episodes do: a
    prompt that extends a row of the previous call's output (its prompt, its sampled ids, then new
    ids) reuses that row's KV cache and prefills only the new ids, instead of the whole context.

    ``generate(prompts, sampling, rng, version=…, previous=rows, streams=…, samples=…)``:
    ``previous[k]`` is the row of the previous call's output that ``prompts[k]`` extends
    (``samples``: as the engine's). Where the cache cannot serve (the first call, a prompt that
    does not extend its row, ``n > 1``, a model without a lean decoder) the call prefills in full;
    either way the result is the engine's ``generate``'s, up to float rounding
    (``tests/test_episodes.py``). Rows do not leave the batch when they finish here, so the cache
    keeps every row for the next turn.
    """

    def __init__(self, engine: TorchEngine) -> None:
        self.engine = engine
        self._cache: StaticCache | None = None
        self._ids: list[list[int]] = []  # per output row of the last call: the ids its cache holds
        self.prefilled_tokens = 0
        """New ids prefilled over the session's calls (prompts in full, or only their new ids)."""

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, rng: RngState, *,
                 version: int | None = None, previous: Sequence[int] | None = None,
                 streams: Sequence[int] | None = None, samples: Sequence[int] | None = None) -> Rollout:
        engine = self.engine
        if not engine.lean:
            self.prefilled_tokens += sum(len(p) for p in prompts)
            return engine.generate(prompts, sampling, rng, version=version, streams=streams, samples=samples)
        continuing = None
        if (previous is not None and self._cache is not None and sampling.n == 1 and len(previous) == len(prompts)
                and all(len(p) > len(self._ids[j]) and list(p[: len(self._ids[j])]) == self._ids[j]
                        for p, j in zip(prompts, previous))):
            continuing = _Continuation(self._cache, list(previous), [list(p[len(self._ids[j]):]) for p, j in
                                                                     zip(prompts, previous)],
                                       [len(self._ids[j]) for j in previous], engine)
        kept: list[StaticCache] = []
        self._cache, self._ids = None, []
        if continuing is None:
            continuing = _Continuation(None, None, [list(p) for p in prompts], [0] * len(prompts), engine)
        continuing.keep_cache = kept.append
        self.prefilled_tokens += sum(len(ids) for ids in continuing.new)
        rollout = engine._generate(prompts, sampling, rng, version, continuing, streams, samples=samples)
        with torch.inference_mode():
            self._remember(kept[0], prompts, sampling.n, rollout)
        return rollout

    def _remember(self, cache: StaticCache, prompts: Sequence[Sequence[int]], n: int, rollout: Rollout) -> None:
        """Keep ``cache`` for the next call, its slots of each row's tokens past its end (a finished
        row went on decoding padding) marked invalid, and the ids each row's valid slots hold."""
        alive = rollout.sequences.response_mask
        fed = alive.shape[1] - 1  # the last sampled token was never fed through the model
        start = cache.length - fed
        lengths = alive.sum(-1).clamp_max(fed)
        slots = torch.arange(fed, device=alive.device)
        cache.valid[:, start: start + fed] &= slots[None] < lengths[:, None]
        tokens = rollout.sequences.responses().tolist()
        self._cache = cache
        self._ids = [list(prompts[row // n]) + tokens[row][: int(lengths[row])] for row in range(len(tokens))]


class _Continuation:
    """A decoding that continues ``past`` (rows ``rows`` of it; None: a fresh prefill) with the
    ``new`` ids of each row, whose first sits at position ``starts[row]``."""

    def __init__(self, past: StaticCache | None, rows: list[int] | None, new: list[list[int]], starts: list[int],
                 engine: TorchEngine) -> None:
        self.past, self.rows, self.new = past, rows, new
        device = engine.device
        ids, mask = left_pad(new, engine.pad_token_id)
        self.new_ids = (ids.to(device), mask.to(device))
        offsets = (self.new_ids[1].long().cumsum(-1) - 1).clamp_min(0)
        self.positions = offsets + torch.tensor(starts, device=device)[:, None]
        self.keep_cache: Callable[[StaticCache], None] | None = None

    def context(self, engine: TorchEngine, sampling: SamplingParams,
                sampler: RowSampler) -> contextlib.AbstractContextManager[SampledDecoding]:
        past = None if self.past is None else self.past.select_rows(torch.tensor(self.rows, device=engine.device))
        length = 0 if past is None else past.length
        capacity = length + self.new_ids[0].shape[1] + sampling.max_new_tokens
        return engine.model.family.decoding(engine.model, engine._decoder, *self.new_ids, self.positions, sampling.n,
                                            capacity, past=past, keep_cache=self.keep_cache,
                                            **engine._decoding_options(sampler))
