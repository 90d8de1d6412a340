"""Functional update step vs a plain nn.Module + torch.optim.AdamW, on the same tiny model.

One update = forward over a batch of sequences, per-token log-probs, a policy-gradient style
loss, gradients, global-norm clipping and an AdamW step. purerl's path is
``value_and_grad(loss_fn)`` (functional_call + torch.autograd.grad) and the donated fused AdamW;
the baseline is ``loss.backward()`` + ``clip_grad_norm_`` + ``torch.optim.AdamW`` (fused, and the
default implementation); and purerl's path followed by the divergence guard (every param and
optimizer moment checked finite). The variants run interleaved in the same process so machine noise hits
them alike; the script prints medians and ratios against the fused baseline.

    python bench/bench_update.py [--hidden 256 --layers 4 --batch 8 --prompt 32 --response 64 --iters 30]
"""

import argparse
import statistics
import time

import torch
from transformers import AutoModelForCausalLM

from purerl.algo.aggregation import aggregate_loss
from purerl.models import causal_lm_from_config, response_logprobs, value_and_grad
from purerl.optim import adamw, chain, clip_by_global_norm
from purerl.tiny import random_sequences, tiny_llama_config
from purerl.tree import tree_all_finite


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--response", type=int, default=64)
    ap.add_argument("--iters", type=int, default=30)
    args = ap.parse_args()

    config = tiny_llama_config(vocab_size=args.vocab, hidden_size=args.hidden, layers=args.layers,
                               num_attention_heads=8, num_key_value_heads=4)
    seqs = random_sequences(args.batch, args.prompt, args.response, args.vocab, seed=0)
    weights = torch.randn(seqs.response_mask.shape, generator=torch.Generator().manual_seed(1))
    lr, wd = 1e-5, 0.01

    model, params = causal_lm_from_config(config, seed=0)
    opt = chain(clip_by_global_norm(1.0), adamw(lr, weight_decay=wd))
    state = {"params": params, "opt": opt.init(params)}

    def loss_fn(p):
        return aggregate_loss(-weights * response_logprobs(model, p, seqs), seqs.response_mask), None

    grad_fn = value_and_grad(loss_fn)

    def purerl_step() -> None:
        _, _, grads = grad_fn(state["params"])
        state["params"], state["opt"] = opt.update(grads, state["opt"], state["params"])

    def guarded_step() -> None:  # the trainer's divergence guard after the update
        purerl_step()
        assert tree_all_finite(state["params"], state["opt"])

    def module_step_factory(fused: bool):
        torch.manual_seed(0)
        module = AutoModelForCausalLM.from_config(config).eval()
        optimizer = torch.optim.AdamW(module.parameters(), lr=lr, weight_decay=wd, fused=fused or None)
        t = seqs.response_length

        def step() -> None:
            logits = module(input_ids=seqs.input_ids, attention_mask=seqs.attention_mask.long(),
                            position_ids=seqs.position_ids(), use_cache=False, logits_to_keep=t + 1).logits
            logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, seqs.responses()[..., None]).squeeze(-1)
            mask = seqs.response_mask
            loss = -(weights * logp * mask).sum() / mask.sum()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
            optimizer.step()

        return step

    variants = {
        "module + torch.optim.AdamW(fused)": module_step_factory(True),
        "module + torch.optim.AdamW(default)": module_step_factory(False),
        "purerl functional + donated fused AdamW": purerl_step,
        "  + divergence guard (tree_all_finite)": guarded_step,
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(3):  # warm-up
        for fn in variants.values():
            fn()
    for _ in range(args.iters):
        for name, fn in variants.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)

    n_params = sum(p.numel() for p in params.values())
    print(f"model: {n_params / 1e6:.2f} M params, batch {args.batch} x ({args.prompt}+{args.response}) tokens, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.iters} interleaved iterations")
    base = statistics.median(times["module + torch.optim.AdamW(fused)"])
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name:42s} median {med * 1e3:8.2f} ms   ratio vs fused module {med / base:5.3f}")


if __name__ == "__main__":
    main()
