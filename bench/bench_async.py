"""Asynchronous against synchronous training on the Ray executor's split placement, in one run.

One FSDP2 training rank and one rollout worker, each on its own resource pool with one CPU
thread, train the same GRPO job (a small random Llama, a reward counting one token class) twice: synchronously
(generate → score → step → sync, each waiting for the other) and asynchronously with
``max_staleness`` (the rollout worker generates the next batch with published weights while the
rank trains). Each mode uses its natural step: the synchronous one takes the engine's log-probs
as π_old; the asynchronous one recomputes them and corrects with token-level truncated IS.

Throughput = trained samples per second of wall time after ``--warmup`` steps. The synchronous
run's phase medians show how balanced generation and training are (async can at best hide the
shorter one: ≤ 2× when they are equal).

    python bench/bench_async.py [--steps 40 --warmup 2 --hidden 128 --layers 4 --prompts 4 --n 3 --new 96 --repeats 3]

The defaults balance generation and training on a 2-core CPU; on other machines, pick sizes
where the synchronous run's gen and train medians are close.

``--straggler F`` measures many generators instead: one rollout worker takes F× its compute time
per call (:meth:`~purerl.executors.ray.actors.RolloutWorker.straggle`), and these modes train the
same job in one run: synchronous with one generator sharding each batch over 2 workers (the
batch waits for the straggler), asynchronous with that one generator, and 2 and 3 independent
streaming generators (one worker each, the straggler among them), 2 also with interruptible
rollouts (rows continued on newer weights).

    python bench/bench_async.py --straggler 3 [--steps 16 --warmup 3 --prompts 6 --new 48]

``--smoke`` runs either mode at the smallest sizes: seconds of work, plus a few seconds for each Ray executor
to start; not a measurement.
"""

import argparse
import functools
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import torch  # noqa: E402

from purerl.algo.kl_control import make_kl_controller  # noqa: E402
from purerl.assembly.stages import batch_plan_of, stage_settings_of  # noqa: E402
from purerl.config.job import ExecutorConfig, JobConfig  # noqa: E402
from purerl.config.loading import build  # noqa: E402
from purerl.data.cursor import DataCursor  # noqa: E402
from purerl.data.records import PromptRecord  # noqa: E402
from purerl.executors.ray import RayExecutor, RaySetup  # noqa: E402
from purerl.io.metrics import MetricsLog  # noqa: E402
from purerl.loop.async_train import train_async  # noqa: E402
from purerl.loop.task import Task  # noqa: E402
from purerl.loop.train import train  # noqa: E402
from purerl.models import causal_lm_from_config  # noqa: E402
from purerl.optim import adamw, chain, clip_by_global_norm  # noqa: E402
from purerl.state import RngState, TrainState  # noqa: E402
from purerl.step import grpo_step  # noqa: E402
from purerl.tiny import tiny_llama_config  # noqa: E402

ENGINE = dict(eos_token_ids=[1], pad_token_id=0)
SMOKE = ["--steps", "3", "--warmup", "1", "--hidden", "32", "--layers", "1", "--prompts", "2", "--n", "2", "--new",
         "4", "--micro-batch", "4", "--repeats", "1"]
"""What ``--smoke`` stands for: the smallest sizes that run every step of the bench."""


def reward(text: str, truth: str) -> float:
    return float(text.count("a")) / max(len(text), 1)


def decode(ids: list[int]) -> str:
    return "".join("a" if t % 3 == 0 else "b" for t in ids)


def job_config(mode: str, args: argparse.Namespace) -> JobConfig:
    """The run: the sync loop recomputes nothing it need not; async corrects for staleness."""
    asynchronous = mode == "async"
    return build(JobConfig, {
        "trainer": {"steps": args.steps, "progress": False}, "data": {"prompts_per_step": args.prompts},
        "rollout": {"max_new_tokens": args.new, "n": args.n, "temperature": 1.0},
        "actor": {"clip_high": 0.2, "micro_batch_rows": args.micro_batch, "compute_entropy": False,
                  "recompute_old_logprobs": asynchronous},
        "algorithm": {"rollout_correction": "token-tis" if asynchronous else "none"},
        "asynchronous": {"enable": asynchronous, "max_staleness": args.max_staleness}})


def run_mode(mode: str, args: argparse.Namespace, model, params, task: Task) -> dict:
    optimizer = chain(clip_by_global_norm(1.0), adamw(1e-4, weight_decay=0.0))
    kl = make_kl_controller("fixed", coef=0.0)
    config = job_config(mode, args)
    step_fn = functools.partial(grpo_step, optimizer=optimizer, kl_controller=kl, **stage_settings_of(config))
    state = TrainState(policy=params, policy_opt=optimizer.init(params), kl=kl.init(), rng=RngState(0),
                       data=DataCursor(0))
    executor_config = ExecutorConfig(kind="ray", train_ranks=1, rollout_workers=1, placement="split")
    with tempfile.TemporaryDirectory() as run_dir, RayExecutor(step_fn, model, RaySetup(engine_kwargs=ENGINE),
                                                                executor_config) as executor:
        log = MetricsLog(run_dir)
        state = executor.start(state)
        report = None
        loop = dict(executor=executor, task=task, plan=batch_plan_of(config), trainer=config.trainer,
                    run_dir=run_dir, log=log)
        if mode == "sync":
            train(state, **loop)
        else:
            _, report = train_async(state, asynchronous=config.asynchronous, **loop)
        log.close()
        records = MetricsLog.read(log.path)
    timed = records[args.warmup:]
    seconds = timed[-1]["time"] - records[args.warmup - 1]["time"]
    samples = len(timed) * args.prompts * args.n
    med = lambda key: statistics.median(r[key] for r in timed) if key in timed[0] else float("nan")  # noqa: E731
    return {"samples_per_s": samples / seconds, "seconds": seconds, "gen_s": med("timing/gen_s"),
            "train_s": med("timing/train_s"), "step_s": med("timing/step_s"),
            "trainer_idle": timed[-1].get("async/trainer_idle_frac", float("nan")),
            "generator_idle": timed[-1].get("async/generator_idle_frac", float("nan")), "report": report}


STRAGGLER_MODES = (("sync, 1 generator × 2 shards", 0, 2, False), ("async, 1 generator × 2 shards", 1, 2, False),
                   ("async, 2 streaming generators", 2, 2, False),
                   ("async, 2 streaming generators, interruptible", 2, 2, True),
                   ("async, 3 streaming generators", 3, 3, False))


def straggler_mode(name: str, generators: int, workers: int, interruptible: bool, args: argparse.Namespace, model,
                   params, task: Task) -> dict:
    """Train with ``generators`` generators (0: the synchronous loop) over ``workers`` rollout
    workers, the last one a straggler; trained samples per second after ``--warmup`` steps."""
    optimizer = chain(clip_by_global_norm(1.0), adamw(1e-4, weight_decay=0.0))
    kl = make_kl_controller("fixed", coef=0.0)
    asynchronous = generators > 0
    config = build(JobConfig, {
        "trainer": {"steps": args.steps, "progress": False}, "data": {"prompts_per_step": args.prompts},
        "rollout": {"max_new_tokens": args.new, "n": args.n, "temperature": 1.0},
        "actor": {"clip_high": 0.2, "micro_batch_rows": args.micro_batch, "compute_entropy": False,
                  "recompute_old_logprobs": asynchronous},
        "algorithm": {"rollout_correction": "token-tis" if asynchronous else "none"},
        "asynchronous": {"enable": asynchronous, "max_staleness": args.max_staleness,
                         "queue_batches": args.max_staleness, "generators": max(generators, 1),
                         "interruptible": interruptible}})
    step_fn = functools.partial(grpo_step, optimizer=optimizer, kl_controller=kl, **stage_settings_of(config))
    state = TrainState(policy=params, policy_opt=optimizer.init(params), kl=kl.init(), rng=RngState(0),
                       data=DataCursor(0))
    executor_config = ExecutorConfig(kind="ray", train_ranks=1, rollout_workers=workers, placement="split")
    with tempfile.TemporaryDirectory() as run_dir, RayExecutor(
            step_fn, model, RaySetup(engine_kwargs=ENGINE, generators=generators), executor_config) as executor:
        import ray

        ray.get(executor.rollout[-1].straggle.remote(args.straggler))
        log = MetricsLog(run_dir)
        state = executor.start(state)
        loop = dict(executor=executor, task=task, plan=batch_plan_of(config), trainer=config.trainer,
                    run_dir=run_dir, log=log)
        if asynchronous:
            _, report = train_async(state, asynchronous=config.asynchronous, **loop)
        else:
            train(state, **loop)
        log.close()
        records = MetricsLog.read(log.path)
        status = json.loads((Path(run_dir) / "status.json").read_text()) if asynchronous else None
    timed = records[args.warmup:]
    seconds = timed[-1]["time"] - records[args.warmup - 1]["time"]
    groups = [g["groups"] for g in status["generators"]] if status else None
    continued = sum(g["continued_rows"] for g in status["generators"]) if status else 0
    return {"name": name, "samples_per_s": len(timed) * args.prompts * args.n / seconds, "seconds": seconds,
            "groups": groups, "staleness": report["staleness_histogram"] if asynchronous else None,
            "continued": continued}


def straggler_bench(args: argparse.Namespace, model, params, task: Task) -> None:
    runs = [[straggler_mode(name, g, w, i, args, model, params, task) for name, g, w, i in STRAGGLER_MODES]
            for _ in range(args.repeats)]
    print(f"\n## Many generators with a {args.straggler:g}× straggler (Ray, 1 training rank, 1 thread per worker)\n")
    print(f"{args.prompts} prompts × {args.n} samples per step, ≤ {args.new} new tokens, {args.steps} steps "
          f"({args.warmup} not timed), max_staleness {args.max_staleness}, {args.repeats} round(s)\n")
    print("| mode | samples/s | × sync (same round) | groups per generator | rows continued | staleness |")
    print("|---|---|---|---|---|---|")
    for results in runs:
        base = results[0]["samples_per_s"]
        for r in results:
            print(f"| {r['name']} | {r['samples_per_s']:.2f} | {r['samples_per_s'] / base:.2f}× | "
                  f"{r['groups'] or '-'} | {r['continued']} | {r['staleness'] or '-'} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=2, help="first steps not timed (start-up, first sync)")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--n", type=int, default=3)
    ap.add_argument("--new", type=int, default=96, help="max new tokens")
    ap.add_argument("--micro-batch", type=int, default=16)
    ap.add_argument("--max-staleness", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3, help="sync/async pairs, alternating (this box is noisy)")
    ap.add_argument("--straggler", type=float, default=0.0,
                    help="instead: many generators, one rollout worker this many times slower")
    ap.add_argument("--smoke", action="store_true",
                    help=f"seconds, not a measurement: {' '.join(SMOKE)} (flags given win)")
    args = ap.parse_args()
    if args.smoke:
        args = ap.parse_args([*SMOKE, *sys.argv[1:]])
    if not 1 <= args.warmup < args.steps:
        ap.error("need 1 ≤ --warmup < --steps")

    import ray

    # the straggler modes hold 1 rank + up to 3 rollout workers: Ray's CPUs are bundles, not cores
    ray.init(address="local", num_cpus=max(4 if args.straggler else 2, os.cpu_count() or 2), include_dashboard=False,
             log_to_driver=False,
             _temp_dir=tempfile.mkdtemp(prefix="ray"))
    config = tiny_llama_config(vocab_size=128, hidden_size=args.hidden, layers=args.layers,
                               intermediate_size=3 * args.hidden, max_position_embeddings=512)
    model, params = causal_lm_from_config(config, seed=0)
    records = [PromptRecord(({"role": "user", "content": str(i)},), "0") for i in range(256)]
    task = Task([[5 + i % 100, 6, 7, 8, 9, 10, 11, 12] for i in range(256)], records, reward, decode)
    if args.straggler:
        straggler_bench(args, model, params, task)
        ray.shutdown()
        return
    results: dict[str, list[dict]] = {"sync": [], "async": []}
    for _ in range(args.repeats):
        for mode in ("sync", "async"):
            results[mode].append(run_mode(mode, args, model, params, task))
    ray.shutdown()

    count = sum(p.numel() for p in params.values())
    print("\n## Async vs sync, Ray split placement: 1 training rank + 1 rollout worker, 1 thread each\n")
    print(f"Llama h{args.hidden}×{args.layers} ({count / 1e6:.1f} M params), {args.prompts} prompts × {args.n} "
          f"samples, ≤ {args.new} new tokens, {args.steps} steps ({args.warmup} not timed), "
          f"async max_staleness {args.max_staleness}, {args.repeats} pair(s)\n")
    print("| mode | samples/s | timed s | gen s (median) | train s (median) | step s (median) | "
          "trainer idle | generator idle |")
    print("|---|---|---|---|---|---|---|---|")
    for mode, runs in results.items():
        for r in runs:
            print(f"| {mode} | {r['samples_per_s']:.2f} | {r['seconds']:.1f} | {r['gen_s']:.2f} | {r['train_s']:.2f} "
                  f"| {r['step_s']:.2f} | {r['trainer_idle']:.0%} | {r['generator_idle']:.0%} |")
    ratios = [a["samples_per_s"] / s["samples_per_s"] for s, a in zip(results["sync"], results["async"])]
    sync = results["sync"]
    gen, trn = statistics.median(r["gen_s"] for r in sync), statistics.median(r["train_s"] for r in sync)
    print(f"\nasync / sync throughput: {', '.join(f'{x:.2f}×' for x in ratios)} "
          f"(median {statistics.median(ratios):.2f}×); "
          f"perfect overlap would give (gen + train) / max(gen, train) = {(gen + trn) / max(gen, trn):.2f}×")
    print(f"async staleness: {results['async'][-1]['report']['staleness_histogram']}")
    print(f"machine: {os.cpu_count()} CPUs, torch {torch.__version__}, ray {ray.__version__}")


if __name__ == "__main__":
    main()
