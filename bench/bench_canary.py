"""What the weight-sync checks cost on the main job's model, against the work a sync already does.

Two checks (README, "Every weight sync is checked"): the step's own, which compares the engine's
log-probs of a batch with those the update's first mini-batch computes anyway (its added work is a
masked ``|Δ|`` and a sum per micro-batch, timed here on a training batch's shape, 32 × 48), and the
canary, which runs only where no step reads a version: each held-out evaluation (every
``--eval-every`` steps, and at the start) and each asynchronous generator's load.

On the main job's model (SmolLM2-135M-Instruct from the GGUF cache, float32, the embedded engine as
the job builds it) this times, interleaved: one ``engine.sync`` of the params (the sync the canary
follows, including the engine's prepacked decode weights), one :meth:`Canary.check` (a greedy
continuation of the canary prompt on the engine and one trainer forward), and one greedy generation
of a training batch's shape (8 prompts × 4 samples × 48 tokens) for scale. It prints medians and the
canary's time as a fraction of a main-job step, whose median the caller gives (``--step-s``, from the
job's ``metrics.jsonl``: ``timing/step_s``), or of the sync plus the batch's generation when none is
given.

    python3 bench/bench_canary.py [--iters 10] [--step-s 14.2] [--threads 1] [--eval-every 10 --steps 30]
    python3 bench/bench_canary.py --smoke     # the main job's --tiny model, one iteration: not a measurement
"""

import argparse
import statistics
import sys
import time

import torch

from purerl.assembly.models import engine_options, load_policy
from purerl.config.job import JobConfig
from purerl.config.loading import build
from purerl.config.rules import resolve
from purerl.rollout.canary import Canary
from purerl.rollout.engine import make_engine
from purerl.rollout.sampling import SamplingParams
from purerl.state import RngState

SMOKE = ["--iters", "1"]
"""What ``--smoke`` stands for, on the main job's ``--tiny`` model."""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--step-s", type=float, default=None, help="a main-job step's median seconds, to compare with")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--eval-every", type=int, default=10, help="the main job's trainer.eval_every")
    ap.add_argument("--steps", type=int, default=30, help="the main job's trainer.steps")
    ap.add_argument("--smoke", action="store_true",
                    help=f"seconds, not a measurement: {' '.join(SMOKE)} (flags given win)")
    args = ap.parse_args()
    if args.smoke:
        args = ap.parse_args([*SMOKE, *sys.argv[1:]])
    if args.threads:
        torch.set_num_threads(args.threads)
    config = resolve(build(JobConfig, {"model": {"tiny": True}} if args.smoke else {}))
    model, params, tokenizer = load_policy(config)
    engine = make_engine("torch", model, device=config.model.device, **engine_options(config, model, tokenizer))
    canary = Canary(model, tolerance=5e-2)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is 17 + 25? End with '#### N'."}],
                                           add_generation_prompt=True, tokenize=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    batch = SamplingParams(max_new_tokens=48, temperature=0.7, n=4)
    times: dict[str, list[float]] = {"sync": [], "canary": [], "generate (8 x 4 x 48)": []}
    gaps = []
    for i in range(args.iters + 1):
        start = time.perf_counter()
        engine.sync(params, i)
        synced = time.perf_counter()
        gaps.append(canary.gap(engine, params, i))
        checked = time.perf_counter()
        engine.generate([prompt] * 8, batch, RngState(i), version=i)
        done = time.perf_counter()
        if i:  # the first is a warm-up
            times["sync"].append(synced - start)
            times["canary"].append(checked - synced)
            times["generate (8 x 4 x 48)"].append(done - checked)
    medians = {k: statistics.median(v) for k, v in times.items()}
    for name, value in medians.items():
        print(f"{name}: {1000 * value:.1f} ms (median of {args.iters})")
    print(f"largest canary gap: {max(gaps):.3g} nats per token (float32 engine and trainer)")
    step = args.step_s if args.step_s else medians["sync"] + medians["generate (8 x 4 x 48)"]
    what = "a main-job step" if args.step_s else "the sync plus one batch's generation"
    print(f"canary / {what}: {medians['canary'] / step:.2%}")
    in_step = _in_step_check_s()
    print(f"the step's own check (|dlogp| token mean, 32 x 48, one micro-batch of 8 rows at a time): "
          f"{1e6 * in_step:.1f} us; / {what}: {in_step / step:.5%}")
    # one canary per evaluation (the start's included); the last reads the last version
    canaries = args.steps // args.eval_every + 1 if args.eval_every else 1
    per_step = in_step + medians["canary"] * canaries / args.steps
    print(f"synchronous main job ({args.steps} steps, an evaluation every {args.eval_every}: {canaries} canaries): "
          f"{1000 * per_step:.1f} ms per step = {per_step / step:.2%} of {what}")


def _in_step_check_s(rows: int = 32, width: int = 48, micro: int = 8, reps: int = 200) -> float:
    """The median time of the step check's added work over one batch: per micro-batch the masked
    ``|log π − log μ|`` and its token sum (:func:`purerl.algo.aggregation.token_mean`)."""
    from purerl.algo.aggregation import token_mean

    g = torch.Generator().manual_seed(0)
    logp, behaviour = -torch.rand(rows, width, generator=g), -torch.rand(rows, width, generator=g)
    mask = torch.rand(rows, width, generator=g) > 0.3
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        for lo in range(0, rows, micro):
            sl = slice(lo, lo + micro)
            token_mean(torch.where(mask[sl], (logp[sl] - behaviour[sl]).abs(), 0.0), mask[sl])
        times.append(time.perf_counter() - start)
    return statistics.median(times)


if __name__ == "__main__":
    main()
