"""The job's command line run in this process, as ``experiments/grpo_math.py`` runs it (without its
plot), and what tests that run the script itself share."""

import os
from pathlib import Path

import torch

from purerl.config.command_line import Invocation, parse_command_line
from purerl.config.job import JobConfig
from purerl.config.loading import build
from purerl.run import run
from purerl.tiny import tiny_causal_lm

SCRIPT = Path(__file__).resolve().parents[1] / "experiments" / "grpo_math.py"
SMALL = ["--prompts-per-step", "2", "--samples-per-prompt", "2", "--max-new-tokens", "6",
         "--eval-size", "4", "--train-size", "40", "--eval-every", "0", "--no-progress", "--threads", "1"]
"""A few small steps' worth of settings for the script (add ``--tiny`` or ``--model``)."""
ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}

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


def tiny_teacher(folder: Path, seed: int = 1, sharpness: float = 5.0) -> Path:
    """A teacher for ``--tiny`` jobs, exported to ``folder``: a tiny Llama of the tiny policy's
    vocabulary (the character tokenizer's) from another seed, its final norm scaled by
    ``sharpness`` so its next-token distributions are peaked, far from a random student's."""
    from purerl.models.hf import export_hf
    from purerl.tiny import char_tokenizer

    model, params = tiny_causal_lm(vocab_size=len(char_tokenizer()), hidden_size=64, seed=seed)
    params = {k: v * sharpness if k == "model.norm.weight" else v for k, v in params.items()}
    return export_hf(model, params, folder)


def parse(argv: list[str]) -> Invocation:
    return parse_command_line(argv, prog="grpo_math", default_out_dir="runs/grpo_math")


def run_job(argv: list[str]) -> dict:
    """The summary of the job ``argv`` describes (library errors propagate as they are). The torch
    thread count ``--threads`` sets is restored after it, so later tests compute as they would alone."""
    inv = parse(argv)
    threads = torch.get_num_threads()
    try:
        return run(inv.config, inv.out_dir, resume=inv.resume, overwrite=inv.overwrite)
    finally:
        torch.set_num_threads(threads)


def assert_cut_run_resumes_as_the_whole(argv: list[str], whole: dict, out: Path) -> None:
    """The job ``argv`` run for 2 of ``whole``'s 4 steps into ``out``, then resumed to 4, records
    what the uninterrupted run recorded (timings aside)."""
    run_job([*argv, "--steps", "2", "--checkpoint-every", "2", "--out-dir", str(out)])
    resumed = run_job([*argv, "--steps", "4", "--checkpoint-every", "2", "--out-dir", str(out), "--resume"])
    strip = lambda r: {k: v for k, v in r.items() if not k.startswith(("timing/", "perf/", "time"))}  # noqa: E731
    assert [strip(r) for r in resumed["records"]] == [strip(r) for r in whole["records"]]


def one_line_error(done, status: int = 1) -> str:
    """The one ``grpo_math: …`` line a finished script run printed for a user error (no traceback)."""
    assert done.returncode == status, done.stdout + done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("grpo_math: "), done.stderr
    return lines[0]
