"""The training ranks' update, sharded two ways, measured in one run on the same machine (issue 88).

Each rank of a gloo group (processes on this machine) holds its shard of a model's params and AdamW state and
times updates (forward, backward, AdamW) of one fixed batch, the same on every rank, its rows split over the
ranks as the Ray executor's ranks split them:

- ``lean``: the lean family's forward over ``DTensor``-sharded params, each weight gathered when the forward
  reads it (:class:`purerl.executors.fsdp.ShardedLeanLM`, what the ranks run now);
- ``module``: the HF module under FSDP2 (:func:`purerl.executors.fsdp_modules.shard_causal_lm`, what they ran
  before, and still run for an architecture no family computes).

It prints each's median seconds per update and their ratio, and each rank's peak resident memory (Linux's
``VmHWM``) after the warm-up update. ``--worlds 1 2 4 --modes lean`` shows how the params' and AdamW's share
of a rank's memory falls with the ranks.

    python3 bench/bench_sharded.py --model smollm2 --worlds 2 --modes lean module
    python3 bench/bench_sharded.py --model gemma3 --worlds 2 --modes lean module
    python3 bench/bench_sharded.py --model smollm2 --worlds 1 2 4 --modes lean     # memory per rank
    python3 bench/bench_sharded.py --smoke   # a tiny model, one update: not a measurement
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

SMOKE = ["--model", "tiny", "--worlds", "2", "--modes", "lean", "module", "--updates", "1", "--rounds", "1"]
"""What ``--smoke`` stands for."""


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=["tiny", "smollm2", "gemma3"], default="smollm2")
    ap.add_argument("--worlds", type=int, nargs="+", default=[2])
    ap.add_argument("--modes", nargs="+", choices=["lean", "module"], default=["lean", "module"])
    ap.add_argument("--rows", type=int, default=8, help="rows of the batch (split over the ranks)")
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--response", type=int, default=48)
    ap.add_argument("--updates", type=int, default=3, help="timed updates after one warm-up")
    ap.add_argument("--rounds", type=int, default=3, help="groups started per mode, the modes alternating (this "
                    "box's speed drifts between runs: the ratio is the median of each round's)")
    ap.add_argument("--checkpointing", action="store_true", help="activation checkpointing (the lean forward's own; "
                    "the HF module's wrapped layers)")
    ap.add_argument("--smoke", action="store_true", help="the smallest sizes: " + " ".join(SMOKE))
    ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)  # a rank process: rank world port mode
    ap.add_argument("--world", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--mode", help=argparse.SUPPRESS)
    return ap


def _model(name: str):
    from purerl.models import load_causal_lm
    from purerl.models.gguf_cache import gguf_as_folder
    from purerl.models.hf import gemma3_270m_gguf, smollm2_gguf
    from purerl.tiny import tiny_causal_lm, tiny_llama_config

    if name == "tiny":
        return tiny_causal_lm(tiny_llama_config(vocab_size=128, hidden_size=32), seed=0)
    path = smollm2_gguf() if name == "smollm2" else gemma3_270m_gguf()
    return load_causal_lm(gguf_as_folder(path) or path)


def rank_main(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from purerl.algo.aggregation import SumCount
    from purerl.executors.fsdp import shard_like, sharded_model, sharded_value_and_grad
    from purerl.executors.fsdp_modules import ShardedCausalLM, shard_causal_lm
    from purerl.models import response_logprobs
    from purerl.optim import adamw
    from purerl.tiny import random_sequences
    from purerl.tree import tree_leaves

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank,
                            world_size=args.world)
    mesh = init_device_mesh("cpu", (args.world,))
    model, params = _model(args.model)
    if args.checkpointing:
        import attrs

        from purerl.models import checkpoint_layers

        if args.mode == "module":
            checkpoint_layers(model.module, rebind=True)
        model = attrs.evolve(model, checkpointed=True)
    if args.mode == "lean":
        policy, sharded = sharded_model(model, mesh, params)
    else:
        import attrs

        model = attrs.evolve(model, lean=False)
        module, sharded = shard_causal_lm(model, params, mesh=mesh)
        policy = ShardedCausalLM.of(model, [(module, sharded)])
    del params
    optimizer = adamw(1e-6)
    state = shard_like(optimizer.init({k: v.full_tensor() for k, v in sharded.items()}), sharded)
    seqs = random_sequences(args.rows, args.prompt, args.response, model.config.vocab_size, seed=0)

    class Rows:
        def __init__(self, sequences):
            self.sequences = sequences

        def rows(self, index):
            return Rows(self.sequences.rows(index))

    def loss(params, batch):
        logprobs = response_logprobs(policy, params, batch.sequences)
        mask = batch.sequences.response_mask
        return SumCount(logprobs[mask].sum(), mask.sum().to(logprobs.dtype)), {}

    value_and_grad = sharded_value_and_grad(args.rank, args.world)(loss)

    def update() -> None:
        nonlocal sharded, state
        _, _, grads = value_and_grad(sharded, Rows(seqs))
        sharded, state = optimizer.update(grads, state, sharded)

    update()  # warm-up: every tensor touched
    dist.barrier()
    peak = int(next(line for line in Path("/proc/self/status").read_text().splitlines()
                    if line.startswith("VmHWM:")).split()[1]) * 1024
    seconds = []
    for _ in range(args.updates):
        dist.barrier()
        start = time.perf_counter()
        update()
        dist.barrier()
        seconds.append(time.perf_counter() - start)
    held = sum(t.to_local().numel() * t.element_size() for t in tree_leaves((sharded, state))
               if hasattr(t, "to_local"))
    print(json.dumps({"rank": args.rank, "seconds": seconds, "peak": peak, "shards_bytes": held}), flush=True)
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(args: argparse.Namespace, world: int, mode: str) -> list[dict]:
    """One group of ``world`` rank processes in ``mode``: each rank's JSON."""
    port = _free_port()
    flags = ["--model", args.model, "--rows", str(args.rows), "--prompt", str(args.prompt), "--response",
             str(args.response), "--updates", str(args.updates), "--world", str(world), "--port", str(port),
             "--mode", mode, *(["--checkpointing"] if args.checkpointing else [])]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536"}
    ranks = [subprocess.Popen([sys.executable, __file__, *flags, "--rank", str(r)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for r in range(world)]
    results = []
    for rank in ranks:
        out, err = rank.communicate(timeout=3600)
        if rank.returncode:
            raise SystemExit(f"bench_sharded: a {mode} rank failed:\n{err[-3000:]}")
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    if args.rank is not None:
        return rank_main(args)
    if args.smoke:
        args = parser().parse_args([*SMOKE, *(argv if argv is not None else sys.argv[1:])])
    print(f"{args.model}: {args.rows} rows of {args.prompt} + {args.response} tokens, one thread a rank, "
          f"median of {args.updates} updates after a warm-up"
          + (", activation checkpointing" if args.checkpointing else ""))
    medians: dict[tuple[int, str], list[float]] = {}
    print("| mode | ranks | round | median s/update | peak MiB per rank (max) | params + AdamW shards MiB per rank |")
    print("|---|---|---|---|---|---|")
    for world in args.worlds:
        for round_ in range(args.rounds):
            for mode in args.modes:
                ranks = run(args, world, mode)
                median = statistics.median(max(r["seconds"][i] for r in ranks) for i in range(args.updates))
                medians.setdefault((world, mode), []).append(median)
                print(f"| {mode} | {world} | {round_} | {median:.3f} | {max(r['peak'] for r in ranks) / 2**20:.0f} | "
                      f"{max(r['shards_bytes'] for r in ranks) / 2**20:.0f} |", flush=True)
    for world in args.worlds:
        if (world, "lean") in medians and (world, "module") in medians:
            ratios = [m / lean for m, lean in zip(medians[world, "module"], medians[world, "lean"])]
            print(f"{world} ranks: the lean sharded update runs {statistics.median(ratios):.2f}x the HF-module FSDP2 "
                  f"update's speed (each round's: {', '.join(f'{r:.2f}' for r in ratios)})")


if __name__ == "__main__":
    main()
