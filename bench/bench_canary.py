"""What the weight-sync canary costs on the main job's model, against the work a sync already does.

On the main job's model (SmolLM2-135M-Instruct from the GGUF cache, float32, the embedded engine as
the job builds it) this times, interleaved: one ``engine.sync`` of the params (the sync the canary
follows, including the engine's prepacked decode weights), one :meth:`Canary.check` (a greedy
continuation of the canary prompt on the engine and one trainer forward), and one greedy generation
of a training batch's shape (8 prompts × 4 samples × 48 tokens) for scale. It prints medians and the
canary's time as a fraction of a main-job step, whose median the caller gives (``--step-s``, from the
job's ``metrics.jsonl``: ``timing/step_s``), or of the sync plus the batch's generation when none is
given.

    python3 bench/bench_canary.py [--iters 10] [--step-s 14.2] [--threads 1]
"""

import argparse
import statistics
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--step-s", type=float, default=None, help="a main-job step's median seconds, to compare with")
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    config = resolve(build(JobConfig, {}))
    model, params, tokenizer = load_policy(config)
    engine = make_engine("torch", model, device=config.model.device, **engine_options(config, model, tokenizer))
    canary = Canary(model, tolerance=1e-3)
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


if __name__ == "__main__":
    main()
