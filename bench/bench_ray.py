"""The Ray executor's costs against the local executor, measured in one run on the same machine.

1. **Step overhead.** One GRPO step (weight load → generate → score → step) on a tiny model with
   the local executor, then with the Ray executor in ``split`` (2 FSDP2 training ranks + 1 rollout
   worker) and ``colocated`` (2 ranks that also generate) placement. Medians per phase and the
   ratio to local are printed. On a small CPU box this is pure overhead: Ray round trips, numpy
   transfers, gloo collectives and 3 processes sharing the cores.
2. **Weight sync.** Time to gather the policy from the shards and load it into the rollout worker
   (``split``), for a tiny and a larger model, without and with sha256 checksums, as MB/s.

    python bench/bench_ray.py [--steps 8 --hidden 64 --layers 2 --sync-hidden 512 --sync-layers 8 --sync-repeats 5]
    python bench/bench_ray.py --smoke   # the smallest sizes, one step, one Ray executor per table: not a measurement
"""

import argparse
import functools
import os
import statistics
import sys
import time

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import torch  # noqa: E402

from purerl.algo.kl_control import make_kl_controller  # noqa: E402
from purerl.assembly.stages import batch_plan_of, stage_settings_of  # noqa: E402
from purerl.config.job import ExecutorConfig, JobConfig  # noqa: E402
from purerl.config.loading import build  # noqa: E402
from purerl.data.cursor import DataCursor  # noqa: E402
from purerl.data.records import PromptRecord  # noqa: E402
from purerl.executors.local import LocalExecutor  # noqa: E402
from purerl.executors.ray import RayExecutor, RaySetup  # noqa: E402
from purerl.loop.sampling import rollout_batch  # noqa: E402
from purerl.loop.task import Task  # noqa: E402
from purerl.models import causal_lm_from_config  # noqa: E402
from purerl.optim import adamw, chain, clip_by_global_norm  # noqa: E402
from purerl.rollout.backends.torch import TorchEngine  # noqa: E402
from purerl.state import RngState, TrainState  # noqa: E402
from purerl.step import grpo_step  # noqa: E402
from purerl.tiny import tiny_llama_config  # noqa: E402
from purerl.tree import replace  # noqa: E402

ENGINE = dict(eos_token_ids=[1], pad_token_id=0)
SMOKE = ["--steps", "1", "--hidden", "32", "--layers", "1", "--prompts", "2", "--n", "2", "--new", "4",
         "--sync-hidden", "32", "--sync-layers", "1", "--sync-repeats", "1"]
"""What ``--smoke`` stands for (with it, each table also runs one Ray executor: one starts in seconds)."""


def reward(text: str, truth: str) -> float:
    return float(text.count("a")) / max(len(text), 1)


def setup(config, job: JobConfig):
    model, params = causal_lm_from_config(config, seed=0)
    optimizer = chain(clip_by_global_norm(1.0), adamw(1e-4, weight_decay=0.0))
    kl = make_kl_controller("fixed", coef=0.0)
    step_fn = functools.partial(grpo_step, optimizer=optimizer, kl_controller=kl, **stage_settings_of(job))
    state = TrainState(policy=params, policy_opt=optimizer.init(params), kl=kl.init(), rng=RngState(0),
                       data=DataCursor(0))
    return model, step_fn, state


def time_steps(executor, state, task, job: JobConfig, steps: int) -> dict[str, list[float]]:
    """Per step: loading the newest weights into the engine, generating and scoring, and the step
    (which publishes its weights: under Ray split placement, a gather into the object store)."""
    phases: dict[str, list[float]] = {"sync": [], "generate+score": [], "step": [], "total": []}
    plan = batch_plan_of(job)
    state = executor.start(state)
    for i in range(steps + 1):  # the first step warms up and is not counted
        t0 = time.perf_counter()
        with executor.engine(executor.newest(state.step)) as engine:
            t1 = time.perf_counter()
            state, rollout, scores, _ = rollout_batch(state, engine, task, plan)
        t2 = time.perf_counter()
        state, _ = executor.step(state, rollout, scores)
        t3 = time.perf_counter()
        if i:
            for name, value in zip(phases, (t1 - t0, t2 - t1, t3 - t2, t3 - t0)):
                phases[name].append(value)
    return phases


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--sync-hidden", type=int, default=512)
    ap.add_argument("--sync-layers", type=int, default=8)
    ap.add_argument("--sync-repeats", type=int, default=5)
    ap.add_argument("--smoke", action="store_true",
                    help=f"seconds, not a measurement: {' '.join(SMOKE)} (flags given win)")
    args = ap.parse_args()
    if args.smoke:
        args = ap.parse_args([*SMOKE, *sys.argv[1:]])

    import ray

    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    tiny = tiny_llama_config(vocab_size=128, hidden_size=args.hidden, layers=args.layers)
    records = [PromptRecord(({"role": "user", "content": str(i)},), "0") for i in range(64)]
    task = Task([[5 + i % 50, 6, 7, 8] for i in range(64)], records, reward, lambda ids: "a" * len(ids))
    job = build(JobConfig, {"trainer": {"steps": 10**9}, "data": {"prompts_per_step": args.prompts},
                            "rollout": {"max_new_tokens": args.new, "n": args.n, "temperature": 1.0},
                            "actor": {"clip_high": 0.2, "micro_batch_rows": 16, "compute_entropy": False}})

    results = {}
    model, step_fn, state = setup(tiny, job)
    results["local"] = time_steps(LocalExecutor(step_fn, model, TorchEngine(model, **ENGINE)), state, task, job,
                                  args.steps)
    for placement in ("split",) if args.smoke else ("split", "colocated"):
        model, step_fn, state = setup(tiny, job)
        config = ExecutorConfig(kind="ray", train_ranks=2, rollout_workers=1, placement=placement)
        with RayExecutor(step_fn, model, RaySetup(engine_kwargs=ENGINE), config) as executor:
            results[f"ray {placement}"] = time_steps(executor, state, task, job, args.steps)

    params = sum(p.numel() for p in causal_lm_from_config(tiny)[1].values())
    print(f"\n## Step overhead: Llama h{args.hidden}×{args.layers} ({params / 1e3:.0f} k params), "
          f"{args.prompts}×{args.n} samples, ≤{args.new} new tokens, medians of {args.steps} steps (ms)\n")
    print("| executor | weight load | generate+score | step (publishes) | total | total vs local |")
    print("|---|---|---|---|---|---|")
    base = statistics.median(results["local"]["total"])
    for name, phases in results.items():
        med = {k: statistics.median(v) * 1e3 for k, v in phases.items()}
        print(f"| {name} | {med['sync']:.1f} | {med['generate+score']:.1f} | {med['step']:.1f} | {med['total']:.1f} "
              f"| {med['total'] / (base * 1e3):.2f}× |")

    print(f"\n## Weight sync, split placement (2 ranks → 1 rollout worker), median of {args.sync_repeats}\n")
    print("| model | params | MB (fp32) | checksum | sync ms | MB/s |")
    print("|---|---|---|---|---|---|")
    larger = tiny_llama_config(vocab_size=8192, hidden_size=args.sync_hidden, layers=args.sync_layers,
                               intermediate_size=args.sync_hidden * 3)
    models = (("tiny", tiny), (f"h{args.sync_hidden}×{args.sync_layers}", larger))
    rows = [(label, config, checksum) for label, config in models for checksum in (False, True)]
    for label, config, checksum in rows[-1:] if args.smoke else rows:  # --smoke: the larger model, sha256
        model, step_fn, state = setup(config, job)
        size = sum(p.nbytes for p in state.policy.values()) / 1e6
        count = sum(p.numel() for p in state.policy.values())
        ray_config = ExecutorConfig(kind="ray", placement="split", sync_checksum=checksum)
        with RayExecutor(step_fn, model, RaySetup(engine_kwargs=ENGINE), ray_config) as executor:
            small = executor.start(state)
            times = []
            for version in range(1, args.sync_repeats + 2):  # gather (publish), then load
                start = time.perf_counter()
                executor.publish(replace(small, step=version))
                with executor.engine(executor.newest(version)):
                    times.append(time.perf_counter() - start)
            ms = statistics.median(times[1:]) * 1e3
        print(f"| {label} | {count / 1e6:.2f} M | {size:.1f} | {'sha256' if checksum else 'off'} | {ms:.1f} "
              f"| {size / (ms / 1e3):.0f} |")
    ray.shutdown()
    print(f"\nmachine: {os.cpu_count()} CPUs, torch {torch.__version__}, ray {ray.__version__}")


if __name__ == "__main__":
    main()
