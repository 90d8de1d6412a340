"""Multi-turn RL with a tool: arithmetic word problems a 135M model cannot work out in its head
(3-digit × 3-digit products), answered in episodes where it may call a calculator first.

Default (no flags): SmolLM2-135M-Instruct on CPU, a short supervised warm-up on demonstrations
(``env.sft_steps``: the tool's format, which the model never emits on its own), then GRPO over
episodes: ``<calc>347*829</calc>`` → ``<result>287663</result>`` → ``#### 287663``. Held-out
greedy accuracy is measured before the warm-up, after it and after RL; ``--no-tool`` is the same
run without the calculator, the baseline. Settings: ``examples/tool_math.toml`` (applied first),
then any ``--config``, flags and ``section.key=value`` overrides, as in ``grpo_math.py``::

    python experiments/tool_math.py                           # the calculator, default model, CPU
    python experiments/tool_math.py --no-tool --out-dir runs/tool_math_no_tool   # the baseline
    python experiments/tool_math.py --tiny --steps 3          # a tiny random model, seconds

The run folder (resume, checkpoints, export, ``summary.json``, ``curve.png``) is the main job's;
``summary.json`` adds the episode metrics (``val/episode/*``) and the warm-up (``sft``).
"""

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from purerl.launch import end_quietly_until_started  # noqa: E402

if __name__ == "__main__":
    end_quietly_until_started("tool_math")  # Ctrl-C while torch loads: one line, no traceback

from purerl.command import main  # noqa: E402
from purerl.config.command_line import job_parser  # noqa: E402

COMMAND = dict(prog="tool_math", description=__doc__, default_out_dir="runs/tool_math")
DEFAULTS = [str(ROOT / "examples" / "tool_math.toml")]  # applied before the command line's --config files


def parser() -> argparse.ArgumentParser:
    """The script's flags, to document them without running anything."""
    return job_parser(**COMMAND)


if __name__ == "__main__":
    main(None, **COMMAND, defaults=DEFAULTS,
         title=lambda c: f"purerl {c.algorithm.adv_estimator} on calculator episodes"
                         + ("" if c.env.tools else " (no tool)"))
