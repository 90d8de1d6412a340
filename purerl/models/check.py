"""``python3 -m purerl.models.check PATH``: what computes a model, and whether purerl's lean forward
and decoder compute what its HF module does.

For a local HF folder or a GGUF file (read through :mod:`purerl.models.gguf_cache`), one line per fact:

- ``computed by``: the lean family that computes it, or its HF module and why
  (:func:`purerl.models.families.computed_by`);
- ``logits``: the largest ``|lean − HF|`` over the response logits of :data:`SEQUENCES` random
  sequences (a fixed seed, left-padded prompts, ragged responses), against the tolerance
  :func:`logit_tolerance` (relative in float32; in bfloat16, from the HF module's own rounding);
- ``greedy``: whether the embedded engine's greedy tokens (:class:`~purerl.rollout.backends.torch.TorchEngine`)
  are HF ``generate``'s, token for token, for :data:`PROMPTS` random prompts; a row that parts
  where HF's logits of the two tokens are within the logit tolerance parted at a near tie (rounding
  picks either), not a mismatch;
- ``speed``: the lean forward's speed over the HF module's on the same batch (median of
  :data:`REPEATS`), and the decoding rates of the greedy runs;
- ``params``: the parameter count and an estimate of the memory that training it takes
  (:func:`training_bytes`).

A model that no family computes prints the ``computed by`` and ``params`` lines and skips the
lean-vs-HF ones. Exit status: 0 when the lean path computes the module's values (or there is
none), 1 on a mismatch, 2 (one line on stderr) for a path that is not a model it can load.
"""

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import torch
from torch import Tensor

from purerl.batch import Sequences

__all__ = ["PROMPTS", "REPEATS", "SEQUENCES", "check", "logit_tolerance", "main", "parser", "training_bytes"]

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


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python3 -m purerl.models.check", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("path", metavar="PATH", help="a local Hugging Face model folder or a .gguf file")
    ap.add_argument("--device", default="cpu", help="where the model computes (cpu, cuda, cuda:1, …)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="the forwards' compute dtype (float32 master weights either way)")
    ap.add_argument("--tokens", type=int, default=32, metavar="N", help="new tokens per greedy prompt")
    return ap


class _Unloadable(Exception):
    """A flag this command cannot honour, or a path holding no model it can load (exit 2)."""


def _folder(path: Path) -> Path:
    """The HF folder holding the model at ``path``: the folder itself, or a GGUF's converted one."""
    from purerl.models.gguf_cache import gguf_as_folder

    gguf = path.is_file() and path.suffix == ".gguf"
    if not (gguf or path.is_dir() and (path / "config.json").is_file()):
        raise _Unloadable(f"{path} is neither a Hugging Face model folder (with a config.json) nor a .gguf file")
    try:
        return (gguf_as_folder(path) or path) if gguf else path
    except (OSError, ValueError) as err:
        raise _Unloadable(f"{path}: not a model this can load ({err})") from None


def _context(folder: Path) -> int | None:
    """The model's context (``max_position_embeddings``) by its config, without loading its weights (None for a
    GGUF read without a cache, or a config that does not say)."""
    from transformers import AutoConfig

    if not folder.is_dir():
        return None
    try:
        config = AutoConfig.from_pretrained(folder)
    except (OSError, ValueError, KeyError) as err:
        raise _Unloadable(f"{folder}: not a model this can load ({err})") from None
    return getattr(config.get_text_config(), "max_position_embeddings", None)


def _load(path: Path, device: str) -> tuple[Any, dict[str, Tensor]]:
    from purerl.models.hf import load_causal_lm

    try:
        return load_causal_lm(path, device=device)
    except (OSError, ValueError, KeyError) as err:  # (a config.json that is not JSON is a ValueError)
        raise _Unloadable(f"{path}: not a model this can load ({err})") from None


def _median_seconds(fn: Callable[[], Any], device: torch.device) -> float:
    def timed() -> float:
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    timed()  # warm-up
    return statistics.median(timed() for _ in range(REPEATS))


def _random_sequences(vocab: int, device: torch.device) -> Sequences:
    """:data:`SEQUENCES`' batch of random ids (from 3: not the usual special tokens): prompts
    left-padded to their lengths, responses cut after theirs (the ragged rows of a rollout)."""
    b, p, t = SEQUENCES
    g = torch.Generator().manual_seed(_SEED)
    ids = torch.randint(3, vocab, (b, p + t), generator=g)
    start, end = torch.randint(0, p, (b, 1), generator=g), p + torch.randint(1, t + 1, (b, 1), generator=g)
    at = torch.arange(p + t)
    valid = (at >= start) & (at < end)
    return Sequences(torch.where(valid, ids, 0).to(device), valid.to(device), valid[:, p:].to(device))


def _special_ids(config: Any) -> tuple[int, int]:
    """The model's EOS (the first, where it lists several) and padding ids (EOS where it has none)."""
    eos = config.eos_token_id
    eos = (eos[0] if isinstance(eos, (list, tuple)) and eos else eos)
    eos = 0 if eos is None else int(eos)
    pad = config.pad_token_id
    return eos, eos if pad is None else int(pad)


def _greedy(model: Any, params: dict[str, Tensor], tokens: int, device: torch.device,
            tolerance: float) -> tuple[bool, str, float, float]:
    """Whether the engine's greedy tokens are ``generate``'s, the line saying so, and each one's
    decoding rate (tokens/s)."""
    from transformers import GenerationConfig

    from purerl.rollout.backends.torch import TorchEngine
    from purerl.rollout.sampling import SamplingParams
    from purerl.state import RngState

    vocab = model.config.vocab_size
    eos, pad = _special_ids(model.config)
    g = torch.Generator().manual_seed(_SEED + 1)
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPTS]
    engine = TorchEngine(model, eos_token_ids=[eos], pad_token_id=pad, device=device)
    engine.sync(params, 0)
    start = time.perf_counter()
    greedy = SamplingParams(max_new_tokens=tokens, temperature=0.0, n=1)
    seqs = engine.generate(prompts, greedy, RngState(_SEED)).sequences
    lean_s = time.perf_counter() - start
    prompt = seqs.input_ids[:, :-seqs.response_length]
    settings = GenerationConfig(max_new_tokens=tokens, do_sample=False, eos_token_id=eos, pad_token_id=pad,
                                output_logits=True, return_dict_in_generate=True)  # not the folder's defaults
    start = time.perf_counter()
    with torch.no_grad(), model.bind(params) as module:
        out = module.generate(input_ids=prompt, attention_mask=seqs.attention_mask[:, :prompt.shape[1]].long(),
                              generation_config=settings)
    hf_s = time.perf_counter() - start
    theirs = out.sequences[:, prompt.shape[1]:]
    ours, lengths = seqs.responses(), seqs.response_mask.sum(1).tolist()
    rates = (sum(lengths) / lean_s, theirs.numel() / hf_s)
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
            return False, (f"MISMATCH: prompt {row}'s greedy tokens part from HF generate's at new token {at} "
                           f"(engine ...{ours[row, :at + 1].tolist()[-4:]}, "
                           f"HF ...{theirs[row, :at + 1].tolist()[-4:]}, HF's margin {margin:.1e})"), *rates
        ties.append(f"prompt {row} parts at new token {at}, a near tie (HF's margin {margin:.1e})")
    same = f"the lean engine's greedy tokens are HF generate's ({len(prompts)} prompts × {tokens} new tokens"
    return True, same + (f"; {'; '.join(ties)}" if ties else "") + "): ok", *rates


def check(path: str | Path, *, device: str = "cpu", dtype: str = "float32", tokens: int = 32,
          out: Callable[[str], None] = print) -> int:
    """Run the checks on the model at ``path``, writing one line per fact through ``out``; the exit
    status (0 ok, 1 a mismatch). Raises :class:`_Unloadable` for a path holding no model."""
    from purerl.models import response_logits
    from purerl.models.families import computed_by

    compute = getattr(torch, dtype)
    folder = _folder(Path(path))
    context = _context(folder)
    if context is not None and max(PROMPTS) + tokens > context:
        raise _Unloadable(f"--tokens {tokens}: the greedy check's prompts of up to {max(PROMPTS)} tokens and "
                          f"{tokens} new tokens exceed the model's context of {context} positions "
                          f"(max_position_embeddings); at most {context - max(PROMPTS)}")
    model, params = _load(folder, device)
    where = torch.device(device)
    model = attrs.evolve(model, compute_dtype=None if compute == torch.float32 else compute)
    out(f"model: {path} ({type(model.module).__name__}), computing in {dtype} on {where}")
    out(f"computed by: {computed_by(model)}")
    count = sum(p.numel() for p in params.values())
    memory = (f"params: {count:,} parameters; training them takes about {_size(training_bytes(count, compute))} "
              f"(float32 weights + gradients + AdamW's two moments, 16 B/param"
              f"{' + a bfloat16 compute copy, 2 B/param' if compute == torch.bfloat16 else ''}; "
              "activations, the KV cache and a reference policy not included)")
    if not model.lean:
        out("lean vs HF: skipped (no lean family computes this model: its HF module is all purerl runs)")
        out(memory)
        return 0
    seqs = _random_sequences(model.config.vocab_size, where)
    hf_model = attrs.evolve(model, lean=False)
    with torch.no_grad():
        lean, hf = (response_logits(m, params, seqs)[seqs.response_mask].float() for m in (model, hf_model))
        exact = hf if compute == torch.float32 else response_logits(
            attrs.evolve(hf_model, compute_dtype=None), params, seqs)[seqs.response_mask]
    difference = float((lean - hf).abs().max())
    tolerance = logit_tolerance(float(exact.abs().max()), float((hf - exact).abs().max()))
    logits_ok = difference <= tolerance
    why = "" if compute == torch.float32 else ": twice the HF module's own bfloat16 error against its float32 logits"
    out(f"logits: max |lean - HF| = {difference:.2e} over {SEQUENCES[0]} random sequences of up to "
        f"{SEQUENCES[1] + SEQUENCES[2]} tokens (tolerance {tolerance:.1e}{why}): {'ok' if logits_ok else 'MISMATCH'}")
    greedy_ok, line, lean_rate, hf_rate = _greedy(model, params, tokens, where, tolerance)
    out(f"greedy: {line}")
    with torch.no_grad():
        lean_s, hf_s = (_median_seconds(lambda m=m: response_logits(m, params, seqs), where) for m in (model, hf_model))
    out(f"speed: the lean forward runs {hf_s / lean_s:.2f}x the HF module's speed ({lean_s * 1e3:.1f} vs "
        f"{hf_s * 1e3:.1f} ms, median of {REPEATS} on the logits' batch); decoding: lean engine {lean_rate:.0f} "
        f"tokens/s, HF generate {hf_rate:.0f} tokens/s (one greedy run each)")
    out(memory)
    return 0 if logits_ok and greedy_ok else 1


def main(argv: list[str] | None = None) -> int:
    from purerl.machine import device_problem

    args = parser().parse_args(argv)
    try:
        if args.tokens < 1:
            raise _Unloadable(f"--tokens {args.tokens}: must be at least 1")
        if (problem := device_problem(args.device)) is not None:
            raise _Unloadable(f"--device {args.device}: {problem}")
        return check(args.path, device=args.device, dtype=args.dtype, tokens=args.tokens,
                     out=lambda line: print(line, flush=True))
    except _Unloadable as err:
        print(f"purerl.models.check: {' '.join(str(err).split())}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
