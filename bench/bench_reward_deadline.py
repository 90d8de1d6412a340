"""What a step costs when every reward call hangs, with and without the per-batch deadline.

Each of ``--samples`` calls sleeps far past its per-sample deadline ``--timeout``; the reward
processes (``PURERL_REWARD_PROCESSES``, default min(4, cores)) kill each at its deadline. Without
a batch deadline the calls wait their deadlines out a few at a time: samples × timeout ÷ processes.
With ``--batch-timeout`` the whole batch ends there. Both are measured in this run, interleaved,
beside a batch of calls that return at once (the processes' own cost). No reward child may
outlive its killed worker: the script counts ``sleep`` processes left behind.

    python3 bench/bench_reward_deadline.py [--samples 32 --timeout 2 --batch-timeout 4 --repeats 2]
    python3 bench/bench_reward_deadline.py --smoke    # 4 samples, deadlines of tenths of a second: a second
"""

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from purerl.rewards import load_reward_fn, score_responses  # noqa: E402
from purerl.rewards.scoring import reward_processes  # noqa: E402

SMOKE = ["--samples", "4", "--timeout", "0.2", "--batch-timeout", "0.4", "--repeats", "1"]
"""What ``--smoke`` stands for: the smallest sizes that run every step of the bench."""

REWARDS = """
import subprocess


def hangs(response, truth):
    subprocess.run(["sleep", "{sleep}"])
    return 1.0


def instant(response, truth):
    return float(response == truth)
"""


def left_behind(marker: str) -> int:
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout.splitlines()
    return sum(line.strip() == f"sleep {marker}" for line in ps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--timeout", type=float, default=2.0)
    parser.add_argument("--batch-timeout", type=float, default=4.0)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--smoke", action="store_true",
                        help=f"seconds, not a measurement: {' '.join(SMOKE)} (flags given win)")
    args = parser.parse_args()
    if args.smoke:
        args = parser.parse_args([*SMOKE, *sys.argv[1:]])
    sleep = "997"  # a marker no other process is likely to run
    folder = Path(tempfile.mkdtemp(prefix="deadline"))
    (folder / "rewards.py").write_text(REWARDS.format(sleep=sleep))
    hangs, instant = (load_reward_fn(f"{folder / 'rewards.py'}:{name}") for name in ("hangs", "instant"))
    n = args.samples
    responses, truths = ["1"] * n, ["1"] * n
    score_responses(instant, responses, truths, timeout=args.timeout)  # start the processes
    cases = {"instant rewards": (instant, None), "all hang, per-sample deadline only": (hangs, None),
             f"all hang, batch deadline {args.batch_timeout:g} s": (hangs, args.batch_timeout)}
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.repeats):
        for name, (fn, batch_timeout) in cases.items():
            start = time.perf_counter()
            scores = score_responses(fn, responses, truths, timeout=args.timeout, batch_timeout=batch_timeout)
            times[name].append(time.perf_counter() - start)
            assert scores.timeouts == (0 if fn is instant else n), scores
    time.sleep(0.5)
    processes = reward_processes().size
    print(f"{n} samples, per-sample deadline {args.timeout:g} s, {processes} reward processes, "
          f"{args.repeats} repeats (median s; ratio to the per-sample-only batch)")
    base = statistics.median(times["all hang, per-sample deadline only"])
    for name, values in times.items():
        median = statistics.median(values)
        print(f"  {name:<42} {median:8.2f} s   {median / base:6.3f}×")
    print(f"  bound samples × timeout ÷ processes = {n * args.timeout / processes:.1f} s; "
          f"reward children left behind: {left_behind(sleep)}")


if __name__ == "__main__":
    main()
