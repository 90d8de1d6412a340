"""What the model check measures, as values: the lean forward's logits against the HF module's, the embedded
engine's greedy tokens against HF ``generate``'s, the two forwards' speed, and what training costs in memory.
No printing here (:mod:`purerl.model_check.command` says each fact in a line)."""

import statistics
import time
from collections.abc import Callable
from typing import Any

import attrs
import torch
from torch import Tensor

from purerl.batch import Sequences
from purerl.models.special_ids import special_ids

__all__ = ["PROMPTS", "REPEATS", "SEQUENCES", "Greedy", "Logits", "Speed", "compare_greedy", "compare_logits",
           "logit_tolerance", "random_sequences", "speed_of", "training_bytes"]

SEQUENCES = (4, 12, 16)
"""The logit check's random batch: rows, prompt length, longest response (each row's is 1…16)."""
PROMPTS = (8, 5)
"""The greedy check's random prompts: their lengths (unequal, so one is left-padded)."""
REPEATS = 3
"""Timed forwards per path (after one warm-up); the speed line reports their medians' ratio."""
_SEED = 0


def logit_tolerance(scale: float, rounding: float = 0.0) -> float:
    """The largest ``|lean − HF|`` logit difference that passes. In float32, 1e-4 of ``scale`` (the
    largest |logit|, at least 1): the two forwards differ in the order of float32 sums only
    (SmolLM2-135M's by ~5e-6 of its scale). In bfloat16 the two round at different places, by as
    much as either one's own error: twice ``rounding``, the HF module's largest distance from its
    float32 logits (SmolLM2-135M's: 3.0 at scale 35, its lean forward 1.6 from the module's)."""
    return max(max(scale, 1.0) * 1e-4, 2 * rounding)


def training_bytes(params: int, dtype: torch.dtype) -> int:
    """Bytes to train ``params`` parameters with AdamW: float32 master weights, gradients and the
    two moments (16 bytes a parameter), plus a bfloat16 compute copy (2 more) where ``dtype`` is
    bfloat16; activations, the KV cache and a reference policy come on top."""
    return params * (16 + (2 if dtype == torch.bfloat16 else 0))


def random_sequences(vocab: int, device: torch.device) -> Sequences:
    """:data:`SEQUENCES`' batch of random ids (from 3: not the usual special tokens): prompts
    left-padded to their lengths, responses cut after theirs (the ragged rows of a rollout)."""
    b, p, t = SEQUENCES
    g = torch.Generator().manual_seed(_SEED)
    ids = torch.randint(3, vocab, (b, p + t), generator=g)
    start, end = torch.randint(0, p, (b, 1), generator=g), p + torch.randint(1, t + 1, (b, 1), generator=g)
    at = torch.arange(p + t)
    valid = (at >= start) & (at < end)
    return Sequences(torch.where(valid, ids, 0).to(device), valid.to(device), valid[:, p:].to(device))


@attrs.frozen
class Logits:
    """The lean forward's response logits against the HF module's: the largest difference, the tolerance it is
    held to (:func:`logit_tolerance`), and whether it is within."""

    difference: float
    tolerance: float

    @property
    def ok(self) -> bool:
        return self.difference <= self.tolerance


def compare_logits(model: Any, params: dict[str, Tensor], seqs: Sequences) -> Logits:
    """The lean forward of ``model`` (a lean :class:`~purerl.models.CausalLM`) against its HF module on ``seqs``,
    at the model's compute dtype (bfloat16: held to the HF module's own distance from its float32 logits)."""
    from purerl.models import response_logits

    hf_model = attrs.evolve(model, lean=False)
    with torch.no_grad():
        lean, hf = (response_logits(m, params, seqs)[seqs.response_mask].float() for m in (model, hf_model))
        exact = hf if model.compute_dtype is None else response_logits(
            attrs.evolve(hf_model, compute_dtype=None), params, seqs)[seqs.response_mask]
    return Logits(float((lean - hf).abs().max()), logit_tolerance(float(exact.abs().max()),
                                                                  float((hf - exact).abs().max())))


@attrs.frozen
class Greedy:
    """The engine's greedy tokens against HF ``generate``'s for :data:`PROMPTS` random prompts: ``mismatch``, the
    first row that parts beyond the tolerance (``(row, new token, engine's tail, HF's tail, HF's margin)``, None:
    none); ``ties``, the rows that part at a near tie (``(row, new token, margin)``: rounding picks either); each
    one's decoding rate (tokens/s)."""

    prompts: int
    tokens: int
    mismatch: tuple[int, int, list[int], list[int], float] | None
    ties: tuple[tuple[int, int, float], ...]
    engine_rate: float
    hf_rate: float


def compare_greedy(model: Any, params: dict[str, Tensor], tokens: int, device: torch.device,
                   tolerance: float) -> Greedy:
    """The embedded engine's greedy decoding of ``model`` against HF ``generate``'s, ``tokens`` new tokens per
    prompt; a row that parts where HF's logits of the two tokens are within ``tolerance`` parted at a near tie."""
    from transformers import GenerationConfig

    from purerl.rollout.backends.torch import TorchEngine
    from purerl.rollout.sampling import SamplingParams
    from purerl.state import RngState

    ids = special_ids(model.config)
    eos = list(ids.eos) or [0]  # a model that names no EOS: 0 stands in (the prompts' ids are from 3)
    g = torch.Generator().manual_seed(_SEED + 1)
    prompts = [torch.randint(3, model.config.vocab_size, (n,), generator=g).tolist() for n in PROMPTS]
    engine = TorchEngine(model, eos_token_ids=eos, pad_token_id=ids.pad, device=device)
    engine.sync(params, 0)
    start = time.perf_counter()
    seqs = engine.generate(prompts, SamplingParams(max_new_tokens=tokens, temperature=0.0, n=1),
                           RngState(_SEED)).sequences
    engine_s = time.perf_counter() - start
    prompt = seqs.input_ids[:, :-seqs.response_length]
    settings = GenerationConfig(max_new_tokens=tokens, do_sample=False, eos_token_id=eos,
                                pad_token_id=ids.pad, output_logits=True,
                                return_dict_in_generate=True)  # not the folder's defaults
    start = time.perf_counter()
    with torch.no_grad(), model.bind(params) as module:
        out = module.generate(input_ids=prompt, attention_mask=seqs.attention_mask[:, :prompt.shape[1]].long(),
                              generation_config=settings)
    hf_s = time.perf_counter() - start
    theirs = out.sequences[:, prompt.shape[1]:]
    ours, lengths = seqs.responses(), seqs.response_mask.sum(1).tolist()
    rates = (sum(lengths) / engine_s, theirs.numel() / hf_s)
    ties = []
    for row, n in enumerate(lengths):  # each row up to its EOS (HF pads after it)
        n = min(n, theirs.shape[1])  # (HF's batch ends when all its rows have: a shorter row parts before)
        differ = (ours[row, :n] != theirs[row, :n]).nonzero()
        if len(differ) == 0:
            continue
        at = int(differ[0])
        logits = out.logits[at][row].float()
        margin = float(logits[theirs[row, at]] - logits[ours[row, at]])
        if margin > tolerance:
            mismatch = (row, at, ours[row, :at + 1].tolist()[-4:], theirs[row, :at + 1].tolist()[-4:], margin)
            return Greedy(len(prompts), tokens, mismatch, tuple(ties), *rates)
        ties.append((row, at, margin))
    return Greedy(len(prompts), tokens, None, tuple(ties), *rates)


@attrs.frozen
class Speed:
    """The median seconds of the lean forward and of the HF module's on the logits' batch."""

    lean_seconds: float
    hf_seconds: float


def _median_seconds(fn: Callable[[], Any], device: torch.device) -> float:
    def timed() -> float:
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    timed()  # warm-up
    return statistics.median(timed() for _ in range(REPEATS))


def speed_of(model: Any, params: dict[str, Tensor], seqs: Sequences, device: torch.device) -> Speed:
    """Both forwards of ``model`` on ``seqs``, timed (the median of :data:`REPEATS`, after a warm-up)."""
    from purerl.models import response_logits

    with torch.no_grad():
        return Speed(*(_median_seconds(lambda m=m: response_logits(m, params, seqs), device)
                       for m in (model, attrs.evolve(model, lean=False))))
