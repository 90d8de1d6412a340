"""Functional update step vs a plain nn.Module + torch.optim.AdamW, on the same model and batch.

One update = forward over a batch of sequences, per-token log-probs, a policy-gradient style
loss, gradients, global-norm clipping and an AdamW step. purerl's path is
``value_and_grad(loss_fn)`` (functional_call + torch.autograd.grad) and the donated fused AdamW;
the baseline is ``loss.backward()`` + ``clip_grad_norm_`` + ``torch.optim.AdamW`` (fused, and the
default implementation); and purerl's path followed by the divergence guard (every param and
optimizer moment checked finite). The variants run interleaved in the same process so machine noise hits
them alike; the script prints medians and ratios against the fused baseline.

``--dtype bfloat16`` is mixed precision on both sides: float32 master weights and AdamW moments,
forwards and backwards in bfloat16 (purerl: ``CausalLM.compute_dtype``, a cast per forward; the
module: ``torch.autocast``), log-probs in float32. ``--qwen05b-shape`` is the 0.5 B update of issue 37
(hidden 896, 24 layers, 14/2 heads, MLP 4864, vocab 151,936; 8 full rows of 256 + 512 tokens). On
a GPU each variant also prints its MFU: 6 · params · tokens per second over ``--peak-tflops``
(989, an H100's dense bfloat16 peak).

    python bench/bench_update.py [--hidden 256 --layers 4 --batch 8 --prompt 32 --response 64 --iters 30]
    python bench/bench_update.py --device cuda --dtype bfloat16 --qwen05b-shape --iters 10 [--profile] \
        [--compile [--cudagraphs]]
    python bench/bench_update.py --smoke [--profile]     # the smallest sizes: not a measurement
"""

import argparse
import contextlib
import statistics
import sys
import time

import attrs
import torch
from transformers import AutoModelForCausalLM

from purerl.algo.aggregation import aggregate_loss
from purerl.batch import Sequences
from purerl.models import causal_lm_from_config, response_logprobs, value_and_grad
from purerl.optim import adamw, chain, clip_by_global_norm
from purerl.tiny import random_sequences, tiny_llama_config
from purerl.tree import tree_all_finite, tree_map

QWEN05B = dict(hidden=896, layers=24, heads=14, kv_heads=2, intermediate=4864, vocab=151936, batch=8, prompt=256,
               response=512)
SMOKE = ["--hidden", "32", "--layers", "1", "--heads", "4", "--kv-heads", "2", "--vocab", "128", "--batch", "2",
         "--prompt", "8", "--response", "8", "--iters", "2"]
"""What ``--smoke`` stands for: the smallest sizes that run every step of the bench."""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--intermediate", type=int, default=None, help="MLP width (default 2 × hidden)")
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--response", type=int, default=64)
    ap.add_argument("--full-rows", action="store_true", help="no padding: every row holds prompt + response tokens")
    ap.add_argument("--qwen05b-shape", action="store_true", help="the 0.5 B shape and batch of issue 37 (full rows)")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="the card's dense peak, for MFU (GPU only)")
    ap.add_argument("--no-default-adamw", action="store_true", help="leave out the module with the default AdamW")
    ap.add_argument("--profile", action="store_true", help="torch.profiler's kernel table of one step per variant")
    ap.add_argument("--compile", action="store_true",
                    help="add both sides compiled by torch.compile: purerl's actor.compile, the module's forward")
    ap.add_argument("--cudagraphs", action="store_true",
                    help="with --compile on a GPU: the compiled graphs replay as CUDA graphs (inductor's "
                         "triton.cudagraphs)")
    ap.add_argument("--smoke", action="store_true",
                    help=f"seconds, not a measurement: {' '.join(SMOKE)} (flags given win)")
    args = ap.parse_args()
    if args.smoke:
        args = ap.parse_args([*SMOKE, *sys.argv[1:]])
    if args.qwen05b_shape:
        for key, value in QWEN05B.items():
            setattr(args, key, value)
        args.full_rows = True
    device = torch.device(args.device)
    mixed = args.dtype == "bfloat16"
    if args.cudagraphs:
        from torch._inductor import config as inductor_config

        inductor_config.triton.cudagraphs = True

    config = tiny_llama_config(vocab_size=args.vocab, hidden_size=args.hidden, layers=args.layers,
                               num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                               intermediate_size=args.intermediate or 2 * args.hidden,
                               max_position_embeddings=max(256, args.prompt + args.response))
    seqs = random_sequences(args.batch, args.prompt, args.response, args.vocab, seed=0)
    if args.full_rows:
        full = torch.ones_like(seqs.attention_mask)
        seqs = Sequences(torch.randint(3, args.vocab, full.shape, generator=torch.Generator().manual_seed(0)), full,
                         full[:, args.prompt:].clone())
    seqs = tree_map(lambda x: x.to(device) if isinstance(x, torch.Tensor) else x, seqs)  # routing: None
    weights = torch.randn(seqs.response_mask.shape, generator=torch.Generator().manual_seed(1)).to(device)
    lr, wd = 1e-5, 0.01

    model, params = causal_lm_from_config(config, seed=0, device=device)
    if mixed:
        model = attrs.evolve(model, compute_dtype=torch.bfloat16)  # float32 masters, bfloat16 compute
    opt = chain(clip_by_global_norm(1.0), adamw(lr, weight_decay=wd))
    state = {"params": params, "opt": opt.init(params)}

    def purerl_step_factory(compiled: bool):
        policy = attrs.evolve(model, compiled=compiled)
        grad_fn = value_and_grad(lambda p: (aggregate_loss(-weights * response_logprobs(policy, p, seqs),
                                                           seqs.response_mask), None))

        def step() -> None:
            if compiled and args.cudagraphs:
                torch.compiler.cudagraph_mark_step_begin()
            _, _, grads = grad_fn(state["params"])
            state["params"], state["opt"] = opt.update(grads, state["opt"], state["params"])

        return step

    purerl_step = purerl_step_factory(False)

    def guarded_step() -> None:  # the trainer's divergence guard after the update
        purerl_step()
        assert tree_all_finite(state["params"], state["opt"])

    def module_step_factory(fused: bool, compiled: bool = False):
        torch.manual_seed(0)
        module = AutoModelForCausalLM.from_config(config).to(device).eval()
        optimizer = torch.optim.AdamW(module.parameters(), lr=lr, weight_decay=wd, fused=fused or None)
        t = seqs.response_length
        autocast = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if mixed else contextlib.nullcontext

        def logprobs() -> torch.Tensor:
            with autocast():
                logits = module(input_ids=seqs.input_ids, attention_mask=seqs.attention_mask.long(),
                                position_ids=seqs.position_ids(), use_cache=False, logits_to_keep=t + 1).logits
            return torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, seqs.responses()[..., None]).squeeze(-1)

        forward = torch.compile(logprobs) if compiled else logprobs

        def step() -> None:
            if compiled and args.cudagraphs:
                torch.compiler.cudagraph_mark_step_begin()
            logp = forward()
            mask = seqs.response_mask
            loss = -(weights * logp * mask).sum() / mask.sum()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
            optimizer.step()

        return step

    variants = {"module + torch.optim.AdamW(fused)": module_step_factory(True)}
    if not args.no_default_adamw:
        variants["module + torch.optim.AdamW(default)"] = module_step_factory(False)
    variants["purerl functional + donated fused AdamW"] = purerl_step
    variants["  + divergence guard (tree_all_finite)"] = guarded_step
    if args.compile:
        variants["module compiled + AdamW(fused)"] = module_step_factory(True, compiled=True)
        variants["purerl compiled (actor.compile)"] = purerl_step_factory(True)

    def synchronize() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    times: dict[str, list[float]] = {name: [] for name in variants}
    if args.compile:
        gap = _compiled_gap(model, state["params"], seqs, weights)
        print(f"compiled vs eager, one gradient from the same params: {gap}")
    for name, fn in list(variants.items()):  # warm-up (and compilation), timed once
        synchronize()
        start = time.perf_counter()
        try:
            fn()
        except Exception as err:  # a machine that cannot compile (no triton, no C compiler) still gets the rest
            if "compiled" not in name:
                raise
            print(f"first call: {name.strip()} failed, left out: {type(err).__name__}: {str(err)[:300]}")
            del variants[name]
            continue
        synchronize()
        print(f"first call: {name.strip()} {time.perf_counter() - start:.1f} s", flush=True)
    for _ in range(2):
        for fn in variants.values():
            fn()
    for _ in range(args.iters):
        for name, fn in variants.items():
            synchronize()
            start = time.perf_counter()
            fn()
            synchronize()
            times[name].append(time.perf_counter() - start)
    if args.profile:
        _profile(variants, device)

    n_params = sum(p.numel() for p in params.values())
    tokens = int(seqs.attention_mask.numel())
    print(f"model: {n_params / 1e6:.2f} M params, batch {args.batch} x ({args.prompt}+{args.response}) tokens "
          f"({'full rows' if args.full_rows else 'random padding'}), {args.dtype} on {device}, torch "
          f"{torch.__version__}, {torch.get_num_threads()} threads, {args.iters} interleaved iterations")
    base = statistics.median(times["module + torch.optim.AdamW(fused)"])
    for name, ts in times.items():
        med = statistics.median(ts)
        mfu = (f"   MFU {6 * n_params * tokens / med / (args.peak_tflops * 1e12):5.1%}"
               if device.type == "cuda" else "")
        print(f"{name:42s} median {med * 1e3:8.2f} ms   ratio vs fused module {med / base:5.3f}{mfu}")


def _compiled_gap(model, params, seqs, weights) -> str:
    """How far ``actor.compile``'s log-probs and gradient are from the eager ones, on one batch."""
    out = []
    for compiled in (False, True):
        policy = attrs.evolve(model, compiled=compiled)
        _, logp, grads = value_and_grad(lambda p: (aggregate_loss(-weights * (lp := response_logprobs(
            policy, p, seqs)), seqs.response_mask), lp))(params)
        out.append((logp, torch.cat([g.flatten().float() for g in grads.values()])))
    (logp, grad), (logp_c, grad_c) = out
    return (f"log-probs max |diff| {(logp - logp_c).abs().max().item():.2e}, gradient relative "
            f"{((grad - grad_c).norm() / grad.norm()).item():.2e}")


def _profile(variants, device: torch.device) -> None:
    """The profiler's table (by device time, or CPU time on a CPU) of one step of each variant."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    key = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    for name, fn in variants.items():
        if "default" in name or "guard" in name or "module compiled" in name:
            continue
        with profile(activities=activities) as prof:
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
        print(f"--- profile: {name.strip()}")
        print(prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=60))


if __name__ == "__main__":
    main()
