"""The job's command line run in this process, as ``experiments/grpo_math.py`` runs it (without its plot)."""

from purerl.config.command_line import Invocation, parse_command_line
from purerl.config.job import JobConfig
from purerl.config.loading import build
from purerl.run import run

_SECTION = {"adv_estimator": "algorithm", "gamma": "algorithm", "lam": "algorithm", "gdpo_weights": "algorithm",
            "rollout_correction": "algorithm", "correction_cap": "algorithm", "critic_warmup": "trainer",
            "temperature": "rollout"}


def step_config(**settings) -> JobConfig:
    """A job config from flat settings (each in its section, the actor's by default) for step
    functions, sampling at temperature 1 and clipping at 0.2 on both sides unless given."""
    nested = {"rollout": {"temperature": 1.0}, "actor": {"clip_high": 0.2}}
    for key, value in settings.items():
        nested.setdefault(_SECTION.get(key, "actor"), {})[key] = value
    return build(JobConfig, nested)


def parse(argv: list[str]) -> Invocation:
    return parse_command_line(argv, prog="grpo_math", default_out_dir="runs/grpo_math")


def run_job(argv: list[str]) -> dict:
    """The summary of the job ``argv`` describes (library errors propagate as they are)."""
    inv = parse(argv)
    return run(inv.config, inv.out_dir, resume=inv.resume, overwrite=inv.overwrite)
