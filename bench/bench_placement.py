"""PPO steps with the critic on the training ranks vs on a pool of its own, measured in one run.

``split``: one training rank holds the policy and the critic and runs both updates one after the
other. ``split_collocate``: the critic lives on a ``critic`` pool (one rank), so its values and
update run there; its update overlaps the actor's. Each worker gets one CPU (one torch thread),
so the second placement also uses one more core: that is what a pool of its own buys. The same
scored batch is stepped on repeatedly (a random Llama, a fixed rollout), the two placements
interleaved; medians per step and the ratio are printed.

    python bench/bench_placement.py [--steps 5 --hidden 256 --layers 4 --rows 16 --response 96 --repeats 2]
    python bench/bench_placement.py --smoke     # the smallest sizes, one step each: not a measurement
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

from purerl.assembly.stages import step_function  # noqa: E402
from purerl.config.job import ExecutorConfig, JobConfig  # noqa: E402
from purerl.config.loading import build  # noqa: E402
from purerl.executors.base import Roles  # noqa: E402
from purerl.executors.ray import RayExecutor, RaySetup, StepFactory  # noqa: E402
from purerl.models import causal_lm_from_config, critic_from_causal_lm  # noqa: E402
from purerl.rollout.backends.torch import TorchEngine  # noqa: E402
from purerl.rollout.sampling import SamplingParams  # noqa: E402
from purerl.run import initial_state  # noqa: E402
from purerl.state import RngState  # noqa: E402
from purerl.tiny import tiny_llama_config  # noqa: E402

ENGINE = dict(eos_token_ids=[1], pad_token_id=0)
SMOKE = ["--steps", "1", "--hidden", "32", "--layers", "1", "--rows", "2", "--prompt", "4", "--response", "4",
         "--repeats", "1"]
"""What ``--smoke`` stands for: the smallest sizes that run every step of the bench."""


def job(args: argparse.Namespace) -> JobConfig:
    return build(JobConfig, {"trainer": {"steps": 1000, "progress": False},
                             "algorithm": {"adv_estimator": "gae"},
                             "rollout": {"max_new_tokens": args.response, "temperature": 1.0},
                             "actor": {"micro_batch_rows": 4, "ppo_epochs": 1}})


def time_placement(placement: str, model, critic, state, rollout, scores, config: JobConfig, steps: int) -> list[float]:
    executor_config = ExecutorConfig(kind="ray", placement=placement, train_ranks=1, rollout_workers=1,
                                     critic_workers=1, step_timeout=1800)
    with RayExecutor(StepFactory(functools.partial(step_function, config)), Roles(model, critic=critic),
                     RaySetup(engine_kwargs=ENGINE), executor_config) as executor:
        held = executor.start(state)
        held, _ = executor.step(held, rollout, scores)  # warm-up
        times = []
        for _ in range(steps):
            began = time.perf_counter()
            held, _ = executor.step(held, rollout, scores)
            times.append(time.perf_counter() - began)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--response", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--smoke", action="store_true",
                        help=f"seconds, not a measurement: {' '.join(SMOKE)} (flags given win)")
    args = parser.parse_args()
    if args.smoke:
        args = parser.parse_args([*SMOKE, *sys.argv[1:]])

    import ray

    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    config = job(args)
    model, params = causal_lm_from_config(tiny_llama_config(vocab_size=2048, hidden_size=args.hidden,
                                                            layers=args.layers), seed=0)
    critic, critic_params = critic_from_causal_lm(model, params)
    state = initial_state(config, params, critic_params)
    engine = TorchEngine(model, **ENGINE)
    engine.sync(params, 0)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, 2048, (args.rows, args.prompt), generator=g).tolist()
    rollout = engine.generate(prompts, SamplingParams(max_new_tokens=args.response, n=1, temperature=1.0),
                              RngState(1), version=0)
    scores = torch.rand(args.rows, generator=g)
    print(f"PPO step: {args.rows} rows × ({args.prompt} prompt + {args.response} response) tokens, Llama "
          f"{args.hidden} wide × {args.layers} layers ({sum(p.numel() for p in params.values()) / 1e6:.1f} M "
          f"params), critic of the same size; 1 CPU per worker")
    results: dict[str, list[float]] = {"split": [], "split_collocate": []}
    for _ in range(args.repeats):
        for placement in results:
            results[placement] += time_placement(placement, model, critic, state, rollout, scores, config, args.steps)
    medians = {p: statistics.median(t) for p, t in results.items()}
    for placement, median in medians.items():
        print(f"{placement:>16}: {median:.2f} s per step (median of {len(results[placement])})")
    print(f"split_collocate / split: {medians['split'] / medians['split_collocate']:.2f}x the steps per second")
    ray.shutdown()


if __name__ == "__main__":
    main()
