"""The model check's command line: load the model, say each fact in a line (:mod:`purerl.model_check`), and
exit 0, 1 (a mismatch) or 2 (one line: a flag it cannot honour, a path holding no model it can load)."""

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import torch
from torch import Tensor

from purerl.model_check.comparisons import (
    PROMPTS,
    REPEATS,
    SEQUENCES,
    Greedy,
    compare_greedy,
    compare_logits,
    random_sequences,
    speed_of,
    training_bytes,
)

__all__ = ["check", "main", "parser"]

PROG = "python3 -m purerl.model_check"


def parser() -> argparse.ArgumentParser:
    from purerl import model_check

    ap = argparse.ArgumentParser(prog=PROG, description=model_check.__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("path", metavar="PATH", help="a local Hugging Face model folder or a .gguf file")
    ap.add_argument("--device", default="cpu", help="where the model computes (cpu, cuda, cuda:1, …)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="the forwards' compute dtype (float32 master weights either way)")
    ap.add_argument("--tokens", type=int, default=32, metavar="N", help="new tokens per greedy prompt")
    return ap


class Refused(Exception):
    """A flag this command cannot honour, or a path holding no model it can load (exit 2)."""


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError


def _folder(path: Path) -> Path:
    """The HF folder holding the model at ``path``: the folder itself, or a GGUF's converted one."""
    from purerl.models.gguf_cache import gguf_as_folder

    gguf = path.is_file() and path.suffix == ".gguf"
    if not (gguf or path.is_dir() and (path / "config.json").is_file()):
        raise Refused(f"{path} is neither a Hugging Face model folder (with a config.json) nor a .gguf file")
    try:
        return (gguf_as_folder(path) or path) if gguf else path
    except (OSError, ValueError) as err:
        raise Refused(f"{path}: not a model this can load ({err})") from None


def _context(folder: Path) -> int | None:
    """The model's context (``max_position_embeddings``) by its config, without loading its weights (None for a
    GGUF read without a cache, or a config that does not say)."""
    from transformers import AutoConfig

    if not folder.is_dir():
        return None
    try:
        config = AutoConfig.from_pretrained(folder)
    except (OSError, ValueError, KeyError) as err:
        raise Refused(f"{folder}: not a model this can load ({err})") from None
    return getattr(config.get_text_config(), "max_position_embeddings", None)


def _load(path: Path, device: str) -> tuple[Any, dict[str, Tensor]]:
    from purerl.models.hf import load_causal_lm

    try:
        return load_causal_lm(path, device=device)
    except (OSError, ValueError, KeyError) as err:  # (a config.json that is not JSON is a ValueError)
        raise Refused(f"{path}: not a model this can load ({err})") from None


def _greedy_line(greedy: Greedy) -> str:
    if greedy.mismatch is not None:
        row, at, ours, theirs, margin = greedy.mismatch
        return (f"MISMATCH: prompt {row}'s greedy tokens part from HF generate's at new token {at} (engine ...{ours}, "
                f"HF ...{theirs}, HF's margin {margin:.1e})")
    ties = "".join(f"; prompt {row} parts at new token {at}, a near tie (HF's margin {margin:.1e})"
                   for row, at, margin in greedy.ties)
    return f"the lean engine's greedy tokens are HF generate's ({greedy.prompts} prompts × {greedy.tokens} new tokens" \
           f"{ties}): ok"


def check(path: str | Path, *, device: str = "cpu", dtype: str = "float32", tokens: int = 32,
          out: Callable[[str], None] = print) -> int:
    """Run the checks on the model at ``path``, writing one line per fact through ``out``; the exit
    status (0 ok, 1 a mismatch). Raises :class:`Refused` for a path holding no model, or ``tokens`` past its
    context."""
    from purerl.models.families import computed_by

    compute = getattr(torch, dtype)
    folder = _folder(Path(path))
    context = _context(folder)
    if context is not None and max(PROMPTS) + tokens > context:
        raise Refused(f"--tokens {tokens}: the greedy check's prompts of up to {max(PROMPTS)} tokens and "
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
    seqs = random_sequences(model.config.vocab_size, where)
    logits = compare_logits(model, params, seqs)
    why = "" if compute == torch.float32 else ": twice the HF module's own bfloat16 error against its float32 logits"
    out(f"logits: max |lean - HF| = {logits.difference:.2e} over {SEQUENCES[0]} random sequences of up to "
        f"{SEQUENCES[1] + SEQUENCES[2]} tokens (tolerance {logits.tolerance:.1e}{why}): "
        f"{'ok' if logits.ok else 'MISMATCH'}")
    greedy = compare_greedy(model, params, tokens, where, logits.tolerance)
    out(f"greedy: {_greedy_line(greedy)}")
    speed = speed_of(model, params, seqs, where)
    out(f"speed: the lean forward runs {speed.hf_seconds / speed.lean_seconds:.2f}x the HF module's speed "
        f"({speed.lean_seconds * 1e3:.1f} vs {speed.hf_seconds * 1e3:.1f} ms, median of {REPEATS} on the logits' "
        f"batch); decoding: lean engine {greedy.engine_rate:.0f} tokens/s, HF generate {greedy.hf_rate:.0f} tokens/s "
        "(one greedy run each)")
    out(memory)
    return 0 if logits.ok and greedy.mismatch is None else 1


def main(argv: list[str] | None = None) -> int:
    from purerl.machine import device_problem

    args = parser().parse_args(argv)
    try:
        if args.tokens < 1:
            raise Refused(f"--tokens {args.tokens}: must be at least 1")
        if (problem := device_problem(args.device)) is not None:
            raise Refused(f"--device {args.device}: {problem}")
        return check(args.path, device=args.device, dtype=args.dtype, tokens=args.tokens,
                     out=lambda line: print(line, flush=True))
    except Refused as err:
        print(f"{PROG.split()[-1]}: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
