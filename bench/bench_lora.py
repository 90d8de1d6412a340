"""LoRA against full fine-tuning on the same model: update time, update memory, decoding speed,
state and checkpoint size.

One update = a GRPO-style policy-gradient loss over a batch of sequences, its gradients, global-norm
clipping and the fused AdamW step (purerl's path: ``value_and_grad`` + the donated optimizer). Full
fine-tuning differentiates and steps every weight; LoRA the adapters only. Update times are medians
of interleaved runs in this process (noise hits both alike), printed with their ratio. Peak memory
is measured in a fresh process per variant, after a warm-up update: the resident set held between
updates (model, optimizer state, batch) and the high-water mark of the next update (reset first),
with glibc returning freed tensors to the system (``MALLOC_MMAP_THRESHOLD_``), so that the resident
set follows the live tensors.
Decoding: the embedded engine on the same prompts, the base weights against the LoRA policy, which
it decodes with the adapters merged once per version (the merge timed apart).

    python bench/bench_lora.py                       # SmolLM2-135M-Instruct (the GGUF), CPU
    python bench/bench_lora.py --tiny --iters 3      # a tiny random model, seconds
    python bench/bench_lora.py --smoke               # --tiny at the smallest sizes: not a measurement
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from peak_memory import held_and_peak, in_fresh_process  # noqa: E402

from purerl.algo.aggregation import aggregate_loss  # noqa: E402
from purerl.io.checkpoint import save_checkpoint  # noqa: E402
from purerl.models import response_logprobs, value_and_grad  # noqa: E402
from purerl.models.lora import LoraSpec, apply_lora  # noqa: E402
from purerl.optim import adamw, chain, clip_by_global_norm  # noqa: E402
from purerl.rollout.backends.torch import TorchEngine  # noqa: E402
from purerl.rollout.sampling import SamplingParams  # noqa: E402
from purerl.state import RngState, TrainState  # noqa: E402
from purerl.tiny import random_sequences  # noqa: E402

SMOKE = ["--tiny", "--rank", "2", "--batch", "2", "--prompt", "8", "--response", "8", "--iters", "1"]
"""What ``--smoke`` stands for: the smallest sizes that run every step of the bench."""


def load(tiny: bool):
    if tiny:
        from purerl.models import causal_lm_from_config
        from purerl.tiny import tiny_llama_config

        return causal_lm_from_config(tiny_llama_config(vocab_size=512, hidden_size=128, layers=4,
                                                       num_attention_heads=4, num_key_value_heads=2))
    from purerl.models import load_causal_lm, smollm2_gguf

    return load_causal_lm(smollm2_gguf())


def variant(args, name):
    """``(model, params, optimizer, state, seqs, weights)`` of ``name`` (``full`` or ``lora``)."""
    model, params = load(args.tiny)
    if name == "lora":
        model, params = apply_lora(model, params, LoraSpec(args.rank, 32.0))
    optimizer = chain(clip_by_global_norm(1.0), adamw(1e-5))
    vocab = model.config.vocab_size
    seqs = random_sequences(args.batch, args.prompt, args.response, vocab, seed=0)
    weights = torch.randn(seqs.response_mask.shape, generator=torch.Generator().manual_seed(1))
    return model, params, optimizer, {"params": params, "opt": optimizer.init(params)}, seqs, weights


def update(model, optimizer, state, seqs, weights):
    def loss_fn(p):
        return aggregate_loss(-weights * response_logprobs(model, p, seqs), seqs.response_mask), None

    _, _, grads = value_and_grad(loss_fn)(state["params"])
    state["params"], state["opt"] = optimizer.update(grads, state["opt"], state["params"])


def nbytes(tree) -> int:
    from purerl.tree import tree_leaves

    return sum(x.numel() * x.element_size() for x in tree_leaves(tree) if isinstance(x, torch.Tensor))


def memory(args) -> None:
    """In this fresh process: the resident set held between updates and an update's peak."""
    model, params, optimizer, state, seqs, weights = variant(args, args.memory)
    print(json.dumps(held_and_peak(lambda: update(model, optimizer, state, seqs, weights))))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--response", type=int, default=64)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--memory", choices=["full", "lora"], help=argparse.SUPPRESS)
    ap.add_argument("--smoke", action="store_true",
                    help=f"seconds, not a measurement: {' '.join(SMOKE)} (flags given win)")
    args = ap.parse_args()
    if args.smoke:
        args = ap.parse_args([*SMOKE, *sys.argv[1:]])
    if args.memory:
        return memory(args)

    runs = {name: variant(args, name) for name in ("full", "lora")}
    times = {name: [] for name in runs}
    for name, (model, _, optimizer, state, seqs, weights) in runs.items():
        update(model, optimizer, state, seqs, weights)  # warm-up
    for _ in range(args.iters):
        for name, (model, _, optimizer, state, seqs, weights) in runs.items():
            start = time.perf_counter()
            update(model, optimizer, state, seqs, weights)
            times[name].append(time.perf_counter() - start)
    med = {name: statistics.median(t) for name, t in times.items()}
    tokens = args.batch * (args.prompt + args.response)
    print(f"update ({args.batch} rows x {args.prompt}+{args.response} tokens), median of {args.iters}: "
          f"full {med['full']:.2f} s, LoRA r{args.rank} {med['lora']:.2f} s: "
          f"LoRA {med['full'] / med['lora']:.2f}x faster ({tokens / med['lora']:.0f} vs {tokens / med['full']:.0f} "
          f"tok/s)")

    mem = {name: in_fresh_process(__file__, sys.argv[1:], name) for name in runs}
    mib = 2**20
    print("resident memory (fresh process each): " + "; ".join(
        f"{label} held between updates {m['held'] / mib:.0f} MiB, update peak {m['peak'] / mib:.0f} MiB "
        f"(+{(m['peak'] - m['held']) / mib:.0f})" for label, m in (("full", mem["full"]), ("LoRA", mem["lora"])))
        + f"; peak ratio full/LoRA {mem['full']['peak'] / mem['lora']['peak']:.2f}")

    sizes = {}
    for name, (model, _, _, state, _, _) in runs.items():
        with tempfile.TemporaryDirectory() as folder:
            save_checkpoint(folder, TrainState(policy=state["params"], policy_opt=state["opt"], kl=None,
                                               rng=RngState(0)), step=1)
            sizes[name] = sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())
    full_model, full_params = runs["full"][0], runs["full"][1]
    print(f"trained state (params + AdamW moments): full {nbytes(runs['full'][3]) / mib:.1f} MiB, "
          f"LoRA {nbytes(runs['lora'][3]) / mib:.2f} MiB; checkpoint full {sizes['full'] / mib:.1f} MiB, "
          f"LoRA {sizes['lora'] / mib:.2f} MiB; a KL reference: full a copy of {nbytes(full_params) / mib:.0f} MiB, "
          f"LoRA none (the base, adapters off)")

    lora_model, adapters = runs["lora"][0], runs["lora"][3]["params"]
    prompts = [list(range(10 + i, 40 + i)) for i in range(8)]
    sampling = SamplingParams(max_new_tokens=32, n=4, temperature=1.0)
    engines = {"base": TorchEngine(full_model, eos_token_ids=[-1], pad_token_id=0),
               "lora": TorchEngine(lora_model, eos_token_ids=[-1], pad_token_id=0)}
    start = time.perf_counter()
    engines["lora"].sync(adapters, 0)
    merge = time.perf_counter() - start
    engines["base"].sync(full_params, 0)
    decode = {name: [] for name in engines}
    for i in range(max(2, args.iters // 2)):
        for name, engine in engines.items():
            start = time.perf_counter()
            engine.generate(prompts, sampling, RngState(i), version=0)
            decode[name].append(time.perf_counter() - start)
    rows = len(prompts) * sampling.n * sampling.max_new_tokens
    rate = {name: rows / statistics.median(t) for name, t in decode.items()}
    print(f"decoding ({len(prompts)} prompts x {sampling.n} x {sampling.max_new_tokens} tokens): "
          f"base {rate['base']:.0f} tok/s, LoRA (merged) {rate['lora']:.0f} tok/s, "
          f"ratio {rate['lora'] / rate['base']:.2f}; merge per weights version {merge:.2f} s")


if __name__ == "__main__":
    main()
