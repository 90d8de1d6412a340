"""Token-budget micro-batches and packed forwards against fixed-row micro-batches on a long-tailed batch.

The batch: ``--rows`` sequences, prompts of 32-128 tokens, responses of log-normal lengths clipped
to 16-``--longest`` tokens (most short, a few long), padded to the batch's longest as a rollout is.
One actor update (GRPO-style loss, clipping, fused AdamW) in micro-batches of ``--micro-rows`` rows
(each padded to the batch's width), against micro-batches filled up to the same number of
positions a fixed-row micro-batch holds (rows ordered by length, each micro-batch's own padding
trimmed): the same bound on a forward's size, the same gradient; and both again with packed
forwards (``actor.packed_forwards``: each micro-batch's rows as one stream of their attended
tokens, attention per row: no compute on padding at all). Then the trainer's whole GRPO step
(no-grad forwards for the old and reference log-probs, advantages, the KL loss and the update),
fixed rows against packed + token budget. Times are medians of interleaved
runs; peak memory is each variant's resident-set high-water mark in a fresh process during one
update after a warm-up (glibc returning freed tensors), as in ``bench_lora.py``.

    python bench/bench_token_budget.py                 # a 4-layer, 256-wide random Llama
    python bench/bench_token_budget.py --rows 16 --longest 256 --iters 2   # quicker
    python bench/bench_token_budget.py --smoke        # the smallest sizes, 2 of the 4 peaks: not a measurement
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import attrs
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from peak_memory import held_and_peak, in_fresh_process  # noqa: E402

from purerl.algo.kl_control import make_kl_controller  # noqa: E402
from purerl.assembly.stages import actor_batching_of, actor_loss_of, stage_settings_of  # noqa: E402
from purerl.batch import Rollout, Sequences  # noqa: E402
from purerl.config.job import JobConfig  # noqa: E402
from purerl.config.loading import build  # noqa: E402
from purerl.models import causal_lm_from_config  # noqa: E402
from purerl.optim import adamw, chain, clip_by_global_norm  # noqa: E402
from purerl.state import RngState, TrainState  # noqa: E402
from purerl.step import grpo_step  # noqa: E402
from purerl.step.shaping import TrainBatch  # noqa: E402
from purerl.step.update import actor_update  # noqa: E402
from purerl.tiny import tiny_llama_config  # noqa: E402
from purerl.tree import tree_clone  # noqa: E402

SMOKE = ["--rows", "4", "--longest", "32", "--micro-rows", "2", "--hidden", "32", "--layers", "1", "--vocab", "128",
         "--iters", "1"]
"""What ``--smoke`` stands for (with it, peak memory is measured for the first and last variants only)."""


def long_tailed(rows: int, longest: int, vocab: int) -> TrainBatch:
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(32, 129, (rows,), generator=g)
    responses = torch.exp(torch.randn(rows, generator=g) * 1.0 + 4.2).long().clamp(16, longest)
    p, t = int(prompts.max()), int(responses.max())
    ids = torch.randint(2, vocab, (rows, p + t), generator=g)
    attend = torch.zeros(rows, p + t, dtype=torch.bool)
    mask = torch.zeros(rows, t, dtype=torch.bool)
    for i in range(rows):
        attend[i, p - prompts[i]: p + responses[i]] = True
        mask[i, : responses[i]] = True
    seqs = Sequences(torch.where(attend, ids, 0), attend, mask)
    advantages = torch.randn(rows, 1, generator=g).expand(rows, t) * mask
    old = torch.full((rows, t), -3.0)
    return TrainBatch(seqs, old, None, advantages, advantages, None, temperature=1.0)


def setup(args):
    config = tiny_llama_config(vocab_size=args.vocab, hidden_size=args.hidden, layers=args.layers,
                               num_attention_heads=8, num_key_value_heads=4,
                               max_position_embeddings=args.longest + 256)
    model, params = causal_lm_from_config(config, seed=0)
    batch = long_tailed(args.rows, args.longest, args.vocab)
    width = batch.sequences.input_ids.shape[1]
    actor = {"clip_high": 0.2, "micro_batch_rows": args.micro_rows}
    rollout = {"temperature": 1.0}
    fixed = build(JobConfig, {"actor": actor, "rollout": rollout})
    budget = build(JobConfig, {"rollout": rollout,
                               "actor": {**actor, "max_tokens_per_micro_batch": args.micro_rows * width}})
    configs = {"fixed rows": (fixed, False), "token budget": (budget, False), "packed, fixed rows": (fixed, True),
               "packed + token budget": (budget, True)}
    return model, params, batch, configs


def trainer_step(model, params, batch, variant):
    """The trainer's whole GRPO step on ``batch`` as a rollout (rows in groups of 4): old and
    reference log-probs (no-grad forwards), advantages, KL loss and the update. Generation is
    left out: packing does not change it."""
    config, packed = variant
    config = attrs.evolve(config, actor=attrs.evolve(config.actor, recompute_old_logprobs=True, kl_loss_coef=0.01))
    optimizer = chain(clip_by_global_norm(1.0), adamw(1e-5))
    p = tree_clone(params)
    state = TrainState(policy=p, policy_opt=optimizer.init(p), kl=make_kl_controller("fixed", coef=0.0).init(),
                       rng=RngState(0), reference=params)
    seqs = batch.sequences
    rows = len(seqs)
    rollout = Rollout(seqs, batch.old_logprobs * seqs.response_mask, torch.zeros(rows, dtype=torch.long),
                      torch.arange(rows) // 4, 0, 1.0)
    scores = torch.randn(rows, generator=torch.Generator().manual_seed(1))
    return grpo_step(state, rollout, scores, policy=attrs.evolve(model, packed=packed), optimizer=optimizer,
                     kl_controller=make_kl_controller("fixed", coef=0.0), **stage_settings_of(config))


def update(model, params, batch, variant):
    config, packed = variant
    optimizer = chain(clip_by_global_norm(1.0), adamw(1e-5))
    p = tree_clone(params)
    return actor_update(p, optimizer.init(p), batch, policy=attrs.evolve(model, packed=packed),
                        loss=actor_loss_of(config), batching=actor_batching_of(config), optimizer=optimizer,
                        rng=RngState(0))


def memory(args) -> None:
    model, params, batch, configs = setup(args)
    print(json.dumps(held_and_peak(lambda: update(model, params, batch, configs[args.memory]))))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--longest", type=int, default=1024)
    ap.add_argument("--micro-rows", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--memory", help=argparse.SUPPRESS)
    ap.add_argument("--smoke", action="store_true",
                    help=f"seconds, not a measurement: {' '.join(SMOKE)} (flags given win)")
    args = ap.parse_args()
    if args.smoke:
        args = ap.parse_args([*SMOKE, *sys.argv[1:]])
    if args.memory:
        return memory(args)
    model, params, batch, configs = setup(args)
    seqs = batch.sequences
    tokens = int(seqs.attention_mask.sum())
    lengths = seqs.response_mask.sum(-1)
    print(f"{args.rows} rows, responses {int(lengths.min())}-{int(lengths.max())} tokens (median "
          f"{int(lengths.median())}), {tokens} real tokens in a {tuple(seqs.input_ids.shape)} padded batch "
          f"({tokens / seqs.input_ids.numel():.0%} real)")
    times = {name: [] for name in configs}
    for name, config in configs.items():
        update(model, params, batch, config)  # warm-up
    for _ in range(args.iters):
        for name, config in configs.items():
            start = time.perf_counter()
            update(model, params, batch, config)
            times[name].append(time.perf_counter() - start)
    med = {name: statistics.median(t) for name, t in times.items()}
    for name in configs:
        print(f"{name}: {med[name]:.2f} s per update, {tokens / med[name]:.0f} real tokens/s")
    for name in list(configs)[1:]:
        print(f"{name}: {med['fixed rows'] / med[name]:.2f}x the fixed-row update's tokens/s")
    whole = {name: [] for name in ("fixed rows", "packed + token budget")}
    for name in whole:
        trainer_step(model, params, batch, configs[name])  # warm-up
    for _ in range(args.iters):
        for name in whole:
            start = time.perf_counter()
            trainer_step(model, params, batch, configs[name])
            whole[name].append(time.perf_counter() - start)
    step_med = {name: statistics.median(t) for name, t in whole.items()}
    print("the trainer's whole step (old and reference log-probs, advantages, KL loss, update): " + "; ".join(
        f"{name} {t:.2f} s" for name, t in step_med.items())
        + f"; packed + token budget {step_med['fixed rows'] / step_med['packed + token budget']:.2f}x")
    measured = list(configs)[::3] if args.smoke else configs  # --smoke: the first and last (a process each)
    mem = {name: in_fresh_process(__file__, sys.argv[1:], name) for name in measured}
    mib = 2**20
    print("peak resident set of an update: " + "; ".join(
        f"{name} {m['peak'] / mib:.0f} MiB (+{(m['peak'] - m['held']) / mib:.0f} over the held state)"
        for name, m in mem.items()))


if __name__ == "__main__":
    main()
