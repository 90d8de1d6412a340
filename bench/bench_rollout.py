"""Rollout engines vs Hugging Face ``generate``: new tokens per second, same model and prompts.

Both sample (temperature 1) a fixed number of new tokens (EOS disabled so lengths match) from the
same left-padded prompts; runs are interleaved so machine noise hits both alike. Prints medians
and the ratio against ``generate``.

    python bench/bench_rollout.py [--hidden 256 --layers 4 --vocab 2048 --prompts 16 --n 4 --new 64]
    python bench/bench_rollout.py --device cuda --smollm2-shape     # SmolLM2-135M's shape, random weights
    python bench/bench_rollout.py --vllm --smollm2-shape --prompts 64 --prompt-len 160 --new 48   # + vLLM
    python bench/bench_rollout.py --device cuda --smollm2-shape --prompts 64 --n 4 --new 128 --dtype bfloat16 --profile
    python bench/bench_rollout.py --device cuda --smollm2-shape --prompts 64 --n 4 --new 128 --dtype bfloat16 \
        --compile --no-hf --bound      # issue 60: graph (sampler inside) vs eager vs compiled, against the bound
    python bench/bench_rollout.py --smoke [--bound --profile]    # the smallest sizes: not a measurement

``--dtype bfloat16`` decodes both in bfloat16 (the engine casts the float32 weights once). On CUDA
the engine also runs with the host reading the batch every step (``host_check_every=1``, the
loop before it read every 8th) and without CUDA graphs, in the same interleaved runs.
``--compile`` adds the engine with its decoding step and sampler compiled (``compile_decode``,
inside the CUDA graph on a GPU). ``--no-hf`` leaves HF ``generate`` out (ratios then against the
engine without CUDA graphs, or the default engine on a CPU).
``--profile`` prints torch.profiler's table of one engine generate call (the 15 costliest ops),
for each engine variant named in ``--profile-variants`` (``default,compiled step``: the default
engine and the compiled one).
``--bound`` prints each engine variant's time per decoding step (whole call minus a one-token
call, its prefill, over the steps; and, with ``--profile``, the device's kernel time per step)
against the memory bound: the weights and the written cache slots read once per step, at
``--bandwidth`` GB/s (default: the card's, for an H100 or H200). The fixed-shape step of a
CUDA graph reads the cache's whole capacity instead; that figure is printed too.

``--vllm`` adds the vLLM engine (``purerl.rollout.backends.vllm``, in this process; run with a
python that has vLLM, e.g. ``tools/vllm_env.sh``'s environment).

On CUDA the engine replays its decoding step as a CUDA graph; the timings synchronise the device.
"""

import argparse
import statistics
import sys
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

SMOKE = ["--hidden", "32", "--layers", "1", "--vocab", "128", "--prompts", "2", "--n", "2", "--prompt-len", "8",
         "--new", "4", "--iters", "1"]
"""What ``--smoke`` stands for: the smallest sizes that run every step of the bench."""


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
    ap.add_argument("--profile-variants", default="default",
                    help="comma-separated engine variants to profile: default, 'no CUDA graph', 'compiled step', ...")
    ap.add_argument("--compile", action="store_true", help="also the engine with compile_decode")
    ap.add_argument("--no-hf", action="store_true", help="leave HF generate out")
    ap.add_argument("--bound", action="store_true", help="time per decoding step against the memory bound")
    ap.add_argument("--bandwidth", type=float, default=None, help="memory bandwidth in GB/s for --bound")
    ap.add_argument("--smoke", action="store_true",
                    help=f"seconds, not a measurement: {' '.join(SMOKE)} (flags given win)")
    args = ap.parse_args()
    if args.smoke:
        args = ap.parse_args([*SMOKE, *sys.argv[1:]])

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
    ids = ids.repeat_interleave(args.n, 0).to(args.device)
    mask = mask.repeat_interleave(args.n, 0).long().to(args.device)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)

    def run(engine: TorchEngine, new: int = args.new) -> int:
        sampled = SamplingParams(max_new_tokens=new, n=args.n, temperature=1.0)
        return int(engine.generate(prompts, sampled, RngState(1)).sequences.response_mask.sum())

    def purerl_generate() -> int:
        return run(engine)

    def hf_generate() -> int:
        out = module.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0,
                              top_p=1.0, max_new_tokens=args.new, min_new_tokens=args.new, pad_token_id=0,
                              eos_token_id=no_eos)
        return (out.shape[1] - ids.shape[1]) * out.shape[0]

    hf_name = "HF generate (sampling, DynamicCache)"
    variants = {} if args.no_hf else {hf_name: hf_generate}
    variants["purerl TorchEngine"] = purerl_generate
    engines = {"purerl TorchEngine": engine}
    others = []
    if args.device.startswith("cuda"):
        others += [("no CUDA graph", dict(cuda_graphs=False)), ("host read every step", dict(host_check_every=1))]
    if args.compile:
        others.append(("compiled step", dict(compile_decode=True)))
    for name, options in others:
        other = TorchEngine(model, eos_token_ids=[no_eos], pad_token_id=0, device=args.device, dtype=cast, **options)
        other.sync(params, 0)
        engines[f"purerl TorchEngine, {name}"] = other
        variants[f"purerl TorchEngine, {name}"] = lambda other=other: run(other)
    if args.vllm:
        # vLLM refuses stop ids outside the vocabulary; random weights draw this one ~once per 50k tokens
        vllm_engine = make_engine("vllm", model, eos_token_ids=[args.vocab - 1], pad_token_id=0, device=args.device)
        vllm_engine.sync(params, 0)
        variants["purerl vllm engine"] = (
            lambda: int(vllm_engine.generate(prompts, sampling, RngState(1)).sequences.response_mask.sum()))
    rates: dict[str, list[float]] = {k: [] for k in variants}
    first: dict[str, float] = {}
    for name, fn in variants.items():  # warm-up: compilation, the first captures
        sync()
        start = time.perf_counter()
        fn()
        sync()
        first[name] = time.perf_counter() - start
    for _ in range(args.iters):
        for name, fn in variants.items():
            sync()
            start = time.perf_counter()
            tokens = fn()
            sync()
            rates[name].append(tokens / (time.perf_counter() - start))
    rows = args.prompts * args.n
    device_ms: dict[str, float] = {}
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        cuda = args.device.startswith("cuda")
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        for short in args.profile_variants.split(","):
            name = "purerl TorchEngine" + ("" if short.strip() == "default" else f", {short.strip()}")
            with profile(activities=activities) as prof:
                variants[name]()
                sync()
            key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
            print(f"profile: {name}")
            print(prof.key_averages().table(sort_by=key, row_limit=15))
            if cuda:  # kernel time of the whole call (prefill included) per decoding step
                total = sum(getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0)
                            for e in prof.key_averages())
                device_ms[name] = total / 1e3 / args.new
    print(f"model {sum(p.numel() for p in params.values()) / 1e6:.1f} M params, {rows} rows x {args.new} new tokens, "
          f"prompts {args.prompt_len // 2}-{args.prompt_len} tokens, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, device {args.device}"
          f"{' (' + torch.cuda.get_device_name() + ')' if args.device.startswith('cuda') else ''}, {args.dtype}, "
          f"{args.iters} interleaved runs")
    base_name = hf_name if hf_name in rates else next(
        n for n in ("purerl TorchEngine, no CUDA graph", "purerl TorchEngine") if n in rates)
    base = statistics.median(rates[base_name])
    for name, values in rates.items():
        med = statistics.median(values)
        print(f"{name:44s} median {med:9.0f} new tok/s   ratio vs {base_name.split(' (')[0]} {med / base:5.2f}   "
              f"first call {first[name]:6.2f} s")
    if args.bound:
        _print_bound(args, config, params, prompts, {k: statistics.median(v) for k, v in rates.items()
                                                     if k.startswith("purerl TorchEngine")},
                     lambda: run(engine, 1), sync, device_ms, dtype)


def _print_bound(args, config, params, prompts, rates, prefill, sync, device_ms, dtype) -> None:
    """Each engine variant's time per decoding step (its median call, less the default engine's
    one-token call, the prefill every variant runs alike, over the steps after the first) against
    the memory bound of a step: the weights once, plus the keys and values of the written slots
    (their mean over the steps), at the card's bandwidth."""
    rows, steps = args.prompts * args.n, args.new
    size = torch.finfo(dtype).bits // 8
    weights = sum(p.numel() for p in params.values()) * size
    head_dim = args.hidden // config.num_attention_heads
    per_slot = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * size  # keys and values
    written = rows * (statistics.mean(len(p) for p in prompts) + steps / 2) * per_slot
    capacity = rows * (max(len(p) for p in prompts) + steps) * per_slot
    bandwidth = args.bandwidth
    if bandwidth is None and args.device.startswith("cuda"):
        name = torch.cuda.get_device_name()
        bandwidth = 4800.0 if "H200" in name else 3350.0 if "H100" in name else None
    bound_ms = 1e3 * (weights + written) / (bandwidth * 1e9) if bandwidth else None
    print(f"bound per step: weights {weights / 1e9:.3f} GB + written cache {written / 1e9:.3f} GB (mean) "
          f"[a fixed-shape step reads the whole capacity, {capacity / 1e9:.3f} GB]"
          + (f" at {bandwidth:.0f} GB/s: {bound_ms:.3f} ms "
             f"[{1e3 * (weights + capacity) / (bandwidth * 1e9):.3f} ms over the capacity]" if bandwidth else
             ": no bandwidth known (--bandwidth)"))
    times = []
    for _ in range(3):
        sync()
        start = time.perf_counter()
        prefill()
        sync()
        times.append(time.perf_counter() - start)
    first = statistics.median(times)
    for name, rate in rates.items():
        step_ms = 1e3 * (rows * steps / rate - first) / (steps - 1)
        line = f"{name:44s} step {step_ms:7.3f} ms wall (after a {1e3 * first:.1f} ms prefill)"
        if name in device_ms:
            line += f", {device_ms[name]:.3f} ms of kernels (the whole call's over its steps)"
        if bound_ms:
            line += f"   = {step_ms / bound_ms:5.1f}x the bound"
        print(line)


if __name__ == "__main__":
    main()
