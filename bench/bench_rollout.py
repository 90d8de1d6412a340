"""Rollout engines vs Hugging Face ``generate``: new tokens per second, same model and prompts.

Both sample (temperature 1) a fixed number of new tokens (EOS disabled so lengths match) from the
same left-padded prompts; runs are interleaved so machine noise hits both alike. Prints medians
and the ratio against ``generate``.

    python bench/bench_rollout.py [--hidden 256 --layers 4 --vocab 2048 --prompts 16 --n 4 --new 64]
    python bench/bench_rollout.py --device cuda --smollm2-shape     # SmolLM2-135M's shape, random weights
    python bench/bench_rollout.py --vllm --smollm2-shape --prompts 64 --prompt-len 160 --new 48   # + vLLM
    python bench/bench_rollout.py --device cuda --smollm2-shape --prompts 64 --n 4 --new 128 --dtype bfloat16 --profile

``--dtype bfloat16`` decodes both in bfloat16 (the engine casts the float32 weights once). On CUDA
the engine also runs with the host reading the batch every step (``host_check_every=1``, the
loop before it read every 8th) and without CUDA graphs, in the same interleaved runs.
``--profile`` prints torch.profiler's table of one engine generate call (the 15 costliest ops).

``--vllm`` adds the vLLM engine (``purerl.rollout.backends.vllm``, in this process; run with a
python that has vLLM, e.g. ``tools/vllm_env.sh``'s environment).

On CUDA the engine replays its decoding step as a CUDA graph; the timings synchronise the device.
"""

import argparse
import statistics
import time

import torch
from transformers import AutoModelForCausalLM

from purerl.batch import left_pad
from purerl.models import causal_lm_from_config
from purerl.rollout.backends.torch import TorchEngine
from purerl.rollout.engine import make_engine
from purerl.rollout.sampling import SamplingParams
from purerl.state import RngState
from purerl.tiny import tiny_llama_config


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=48)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--smollm2-shape", action="store_true", help="30 layers, hidden 576, 9/3 heads, vocab 49152")
    ap.add_argument("--vllm", action="store_true", help="also the vLLM engine (needs vLLM installed)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--profile", action="store_true", help="torch.profiler's table of one engine call")
    args = ap.parse_args()

    shape = dict(num_attention_heads=8, num_key_value_heads=4)
    if args.smollm2_shape:
        args.hidden, args.layers, args.vocab = 576, 30, 49152
        shape = dict(num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536)
    config = tiny_llama_config(vocab_size=args.vocab, hidden_size=args.hidden, layers=args.layers,
                               max_position_embeddings=2048, **shape)
    model, params = causal_lm_from_config(config, seed=0, device=args.device)
    no_eos = args.vocab + 7  # an id never sampled: every row runs the full length
    dtype = getattr(torch, args.dtype)
    cast = None if dtype == torch.float32 else dtype
    engine = TorchEngine(model, eos_token_ids=[no_eos], pad_token_id=0, device=args.device, dtype=cast)
    engine.sync(params, 0)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, args.vocab, (int(torch.randint(args.prompt_len // 2, args.prompt_len + 1, (),
                                                                 generator=g)),), generator=g).tolist()
               for _ in range(args.prompts)]
    sampling = SamplingParams(max_new_tokens=args.new, n=args.n, temperature=1.0)

    torch.manual_seed(0)
    module = AutoModelForCausalLM.from_config(config).eval().to(args.device)
    module.load_state_dict({**params, "lm_head.weight": params["model.embed_tokens.weight"]}, strict=False)
    module = module.to(dtype)
    ids, mask = left_pad(prompts, 0)
    ids, mask = ids.repeat_interleave(args.n, 0).to(args.device), mask.repeat_interleave(args.n, 0).long().to(args.device)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)

    def purerl_generate() -> int:
        return int(engine.generate(prompts, sampling, RngState(1)).sequences.response_mask.sum())

    def hf_generate() -> int:
        out = module.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0,
                              top_p=1.0, max_new_tokens=args.new, min_new_tokens=args.new, pad_token_id=0,
                              eos_token_id=no_eos)
        return (out.shape[1] - ids.shape[1]) * out.shape[0]

    variants = {"HF generate (sampling, DynamicCache)": hf_generate, "purerl TorchEngine": purerl_generate}
    if args.device.startswith("cuda"):
        for name, options in (("no CUDA graph", dict(cuda_graphs=False)), ("host read every step", dict(host_check_every=1))):
            other = TorchEngine(model, eos_token_ids=[no_eos], pad_token_id=0, device=args.device, dtype=cast, **options)
            other.sync(params, 0)
            variants[f"purerl TorchEngine, {name}"] = (
                lambda other=other: int(other.generate(prompts, sampling, RngState(1)).sequences.response_mask.sum()))
    if args.vllm:
        # vLLM refuses stop ids outside the vocabulary; random weights draw this one ~once per 50k tokens
        vllm_engine = make_engine("vllm", model, eos_token_ids=[args.vocab - 1], pad_token_id=0, device=args.device)
        vllm_engine.sync(params, 0)
        variants["purerl vllm engine"] = (
            lambda: int(vllm_engine.generate(prompts, sampling, RngState(1)).sequences.response_mask.sum()))
    rates: dict[str, list[float]] = {k: [] for k in variants}
    for fn in variants.values():
        fn()
    for _ in range(args.iters):
        for name, fn in variants.items():
            sync()
            start = time.perf_counter()
            tokens = fn()
            sync()
            rates[name].append(tokens / (time.perf_counter() - start))
    rows = args.prompts * args.n
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device.startswith("cuda") else [])
        with profile(activities=activities) as prof:
            purerl_generate()
            sync()
        key = "self_cuda_time_total" if args.device.startswith("cuda") else "self_cpu_time_total"
        print(prof.key_averages().table(sort_by=key, row_limit=15))
    print(f"model {sum(p.numel() for p in params.values()) / 1e6:.1f} M params, {rows} rows x {args.new} new tokens, "
          f"prompts {args.prompt_len // 2}-{args.prompt_len} tokens, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, device {args.device}, {args.dtype}, {args.iters} interleaved runs")
    base = statistics.median(rates["HF generate (sampling, DynamicCache)"])
    for name, values in rates.items():
        med = statistics.median(values)
        print(f"{name:38s} median {med:9.0f} new tok/s   ratio vs HF generate {med / base:5.2f}")


if __name__ == "__main__":
    main()
