"""The main job's twin on TRL's ``GRPOTrainer``, and the main job itself, back to back at one seed.

Both sides get the same model (SmolLM2-135M-Instruct, the GGUF dequantized to float32), the same
training prompts in the same order (purerl's data cursor at that seed; TRL's sampler without
shuffling), the same chat template, the same reward (``lenient_math_reward`` on the decoded
answer, plus DAPO's soft overlong penalty on the completion's token count, EOS included, as
``reward.overlong_buffer`` sets it: a second TRL reward function, which TRL adds to the first), and
the main job's hyper-parameters, read from its config (today: 8 prompts × 4 samples per step, ≤ 48
new tokens, lr 2e-5 with a 2-step warm-up and a cosine to 0.1×, clip 0.2/0.28 with token-mean
aggregation (TRL's ``loss_type="dapo"``), no KL, one update per batch, global-norm clipping at 1.0,
AdamW without weight decay. ``tests/test_trl_parity.py`` pins that one update is the same on both
sides. Both are scored by the same held-out evaluation (purerl's: greedy, 64 problems), TRL's
weights loaded into purerl's engine for it.

Prints one JSON line per side (held-out accuracy before and after, the gain, wall seconds, per
step mean response length, the fraction cut at the limit and the mean reward) and writes them to
``--out``/seed_<seed>.json. The ratio of wall times is TRL's over purerl's, measured in the same
process, one after the other.

    python3 bench/trl_twin.py --seed 0            # both sides, ~20 min on a 2-core CPU
    python3 bench/trl_twin.py --seed 1 --side trl # one side
    python3 bench/trl_twin.py --seed 2 --side trl --threads 1   # one thread, to run two seeds at a time
    python3 bench/trl_twin.py --steps 2 --eval-size 8 --prompts-per-step 2   # a quick look
    python3 bench/trl_twin.py --model runs/x/export --steps 10 --seed 100    # both from one trained state
    python3 bench/trl_twin.py --smoke --out /tmp/twin   # the main job's --tiny model, one step: not a measurement

Needs ``pip install trl`` (pinned in constraints.txt; a test dependency).
"""

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from purerl.algo.dapo import overlong_penalty  # noqa: E402
from purerl.config.command_line import parse_command_line  # noqa: E402
from purerl.data.cursor import DataCursor, next_indices  # noqa: E402
from purerl.loop.evaluation import evaluate  # noqa: E402
from purerl.models.hf import export_hf  # noqa: E402
from purerl.rewards import lenient_math_reward  # noqa: E402
from purerl.rollout.backends.torch import TorchEngine  # noqa: E402
from purerl.run import engine_options, load_policy, load_records_of, load_tasks, reward_of, run  # noqa: E402

SMOKE = ["--steps", "1", "--eval-size", "2", "--prompts-per-step", "2"]
"""What ``--smoke`` stands for, with the job's :data:`SMOKE_JOB` flags."""
SMOKE_JOB = ["--tiny", "--samples-per-prompt", "2", "--max-new-tokens", "8"]


def _job(args: argparse.Namespace) -> list[str]:
    """The main job's command line for this twin: the job's own defaults unless a flag overrides one."""
    overrides = []
    for flag, value in (("--steps", args.steps), ("--eval-size", args.eval_size),
                        ("--prompts-per-step", args.prompts_per_step)):
        if value is not None:
            overrides += [flag, str(value)]
    return ["--seed", str(args.seed), *overrides, "--no-progress", "--eval-every", "0",
            *(["--model", args.model] if args.model else []),
            *(["--threads", str(args.threads)] if args.threads else []), *(SMOKE_JOB if args.smoke else [])]


def purerl_side(args: argparse.Namespace, out: Path) -> dict:
    inv = parse_command_line(_job(args), prog="trl_twin", default_out_dir=str(out / f"purerl_seed_{args.seed}"))
    start = time.perf_counter()
    summary = run(inv.config, inv.out_dir, overwrite=True)
    wall = time.perf_counter() - start
    records = summary["records"]
    return {"side": "purerl", "seed": args.seed, "overlong_buffer": inv.config.reward.overlong_buffer,
            "wall_s": wall, "accuracy_before": summary["accuracy_before"],
            "accuracy_after": summary["accuracy_after"], "gain_points": summary["accuracy_gain_points"],
            "length": [r["response_length/mean"] for r in records],
            "cut": [r["response_length/clip_ratio"] for r in records],
            "reward": [r["critic/score/mean"] for r in records]}


def trl_side(args: argparse.Namespace, out: Path) -> dict:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    config = parse_command_line(_job(args), prog="trl_twin", default_out_dir=str(out)).config
    if config.trainer.threads:
        torch.set_num_threads(config.trainer.threads)
    start = time.perf_counter()
    train_records, eval_records, _ = load_records_of(config)
    model, params, tokenizer = load_policy(config)
    options = engine_options(config, model, tokenizer)
    train_task, eval_task, _ = load_tasks(config, train_records, eval_records, tokenizer, reward_of(config))

    def held_out(weights: dict) -> float:
        engine = TorchEngine(model, **{k: options[k] for k in ("eos_token_ids", "pad_token_id", "decode")})
        engine.sync(weights, 0)
        metrics = evaluate(engine, eval_task, version=0, max_new_tokens=config.rollout.max_new_tokens,
                           reward_timeout=config.reward.timeout)
        engine.close()
        return metrics["val/accuracy"]

    before = held_out(params)
    cursor, order = DataCursor(config.trainer.seed), []
    for _ in range(config.trainer.steps):  # purerl's prompts, in purerl's order
        indices, cursor = next_indices(cursor, len(train_task.records), config.data.prompts_per_step)
        order += indices
    rows = [train_task.records[i] for i in order]
    dataset = Dataset.from_list([{"prompt": list(r.messages), "ground_truth": r.ground_truth} for r in rows])

    def reward(completions, ground_truth, **_):
        return [lenient_math_reward(c[0]["content"] if isinstance(c, list) else c, t)
                for c, t in zip(completions, ground_truth)]

    def overlong(completion_ids, **_):  # purerl's shaping (purerl.rewards.mix), on TRL's completions
        lengths = torch.tensor([len(ids) for ids in completion_ids])
        return overlong_penalty(lengths, config.rollout.max_new_tokens, config.reward.overlong_buffer,
                                config.reward.overlong_penalty).tolist()

    reward_funcs = [reward, overlong] if config.reward.overlong_buffer else [reward]

    records: list[dict] = []

    class Log(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "completions/mean_length" in logs:
                records.append(dict(logs))

    with tempfile.TemporaryDirectory() as tmp:
        hf = AutoModelForCausalLM.from_pretrained(export_hf(model, params, Path(tmp) / "start", tokenizer))
        hf.generation_config.eos_token_id = options["eos_token_ids"]
        hf.generation_config.pad_token_id = options["pad_token_id"]
        actor, rollout = config.actor, config.rollout
        trl_args = GRPOConfig(
            output_dir=tmp, use_cpu=True, bf16=False, seed=config.trainer.seed, max_steps=config.trainer.steps,
            per_device_train_batch_size=config.data.prompts_per_step * rollout.n, num_generations=rollout.n,
            max_completion_length=rollout.max_new_tokens, temperature=rollout.temperature, top_p=rollout.top_p,
            top_k=rollout.top_k, learning_rate=actor.lr, warmup_steps=actor.warmup_steps,
            lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs={"min_lr_rate": actor.min_lr_ratio},
            max_grad_norm=actor.grad_clip, weight_decay=actor.weight_decay, beta=0.0, loss_type="dapo",
            epsilon=actor.clip_low, epsilon_high=actor.clip_high, scale_rewards="group", shuffle_dataset=False,
            report_to="none", save_strategy="no", logging_steps=1, disable_tqdm=True)
        GRPOTrainer(model=hf, reward_funcs=reward_funcs, args=trl_args, train_dataset=dataset,
                    processing_class=tokenizer, callbacks=[Log()]).train()
        state = hf.state_dict()
        trained = {name: state[name].detach().clone() for name in params}
    after = held_out(trained)
    wall = time.perf_counter() - start
    return {"side": "trl", "seed": args.seed, "overlong_buffer": config.reward.overlong_buffer, "wall_s": wall,
            "accuracy_before": before, "accuracy_after": after,
            "gain_points": 100 * (after - before),
            "length": [float(r["completions/mean_length"]) for r in records],
            "cut": [float(r["completions/clipped_ratio"]) for r in records],
            "reward": [float(r["reward"]) for r in records]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, help="training steps (default: the main job's)")
    ap.add_argument("--eval-size", type=int, help="held-out problems (default: the main job's)")
    ap.add_argument("--prompts-per-step", type=int, help="prompts per step (default: the main job's)")
    ap.add_argument("--model", help="start both sides from this HF directory or GGUF (default: the main job's model)")
    ap.add_argument("--side", choices=["both", "purerl", "trl"], default="both")
    ap.add_argument("--threads", type=int, help="torch threads per side (default: the main job's, every core)")
    ap.add_argument("--out", default="runs/trl_twin")
    ap.add_argument("--smoke", action="store_true",
                    help=f"seconds, not a measurement: {' '.join(SMOKE)} (flags given win); the job "
                         f"{' '.join(SMOKE_JOB)}")
    args = ap.parse_args()
    if args.smoke:
        args = ap.parse_args([*SMOKE, *sys.argv[1:]])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for side, fn in (("purerl", purerl_side), ("trl", trl_side)):
        if args.side in ("both", side):
            results.append(fn(args, out))
            print(json.dumps(results[-1]), flush=True)
    if len(results) == 2:
        print(f"seed {args.seed}: gain purerl {results[0]['gain_points']:+.1f}, TRL {results[1]['gain_points']:+.1f} "
              f"points; wall purerl {results[0]['wall_s']:.0f} s, TRL {results[1]['wall_s']:.0f} s "
              f"(TRL / purerl {results[1]['wall_s'] / results[0]['wall_s']:.2f}x)", flush=True)
    path = out / f"seed_{args.seed}.json"
    previous = json.loads(path.read_text()) if path.exists() else []
    kept = [r for r in previous if r["side"] not in {r2["side"] for r2 in results}]
    path.write_text(json.dumps(kept + results, indent=1))


if __name__ == "__main__":
    main()
