"""The job's command line: flags are shorthands for config keys, ``section.key=value`` overrides
any key, ``--config`` files come first. Every error is one line naming the key (and its flag).

    defaults ← --config files (in order) ← flags ← section.key=value overrides → resolve → rules
"""

import argparse
import json
import re
import sys
from collections.abc import Sequence
from typing import Any

import attrs

from purerl.config.job import JobConfig
from purerl.config.loading import ConfigError, build, load_file, merge, nest, overrides, to_dict
from purerl.config.rules import problems, resolve

__all__ = ["FLAGS", "Invocation", "job_parser", "parse_command_line"]

# the flags of the command line: shorthands for config keys (``--lr 1e-6`` is ``actor.lr=1e-6``); a flag offers the
# values its setting's validator names (``choices=None``: none listed, the config's check names the close ones)
FLAGS: list[tuple[str, str, dict]] = [
    ("--model", "model.path", dict(help="HF model directory or .gguf file (default: SmolLM2-135M-Instruct GGUF)")),
    ("--tiny", "model.tiny", dict(action="store_const", const=True, help="a tiny random model, character tokenizer")),
    ("--device", "model.device", dict(help="cpu, cuda, cuda:1, … (auto: the GPU when there is one)")),
    ("--dtype", "model.dtype", dict()),
    ("--data", "data.train_files", dict(nargs="*", help="verl-format training files (.parquet/.jsonl); default "
                                                        "procedural problems")),
    ("--eval-data", "data.eval_files", dict(nargs="*", help="verl-format held-out files; default: procedural, or with "
                                                            "--data, --eval-size rows held out of it")),
    ("--train-size", "data.train_size", dict(type=int, help="procedural training problems")),
    ("--eval-size", "data.eval_size", dict(type=int, help="held-out problems evaluated")),
    ("--data-seed", "data.seed", dict(type=int, help="the procedural problems and the held-out rows; "
                                                     "--seed draws the rest")),
    ("--difficulty", "data.difficulty", dict(type=int, nargs="+", help="procedural difficulty levels")),
    ("--max-prompt-tokens", "data.max_prompt_tokens", dict(type=int)),
    ("--prompt-format", "data.prompt_format", dict(help="chat: the tokenizer's chat "
                                                   "template; plain: role: content lines, for a base model")),
    ("--few-shot", "data.few_shot", dict(type=int, help="worked examples shown before every prompt (for a base "
                                                        "model)")),
    ("--prompts-per-step", "data.prompts_per_step", dict(type=int)),
    ("--samples-per-prompt", "rollout.n", dict(type=int)),
    ("--max-new-tokens", "rollout.max_new_tokens", dict(type=int)),
    ("--temperature", "rollout.temperature", dict(type=float)),
    ("--top-p", "rollout.top_p", dict(type=float)),
    ("--engine", "rollout.engine", dict(help="rollout engine: torch (embedded) "
                                                                     "or vllm (needs vLLM; README: vLLM)")),
    ("--adv-estimator", "algorithm.adv_estimator", dict(choices=None, help="advantage estimator (grpo; gae trains "
                                                                           "a critic: PPO)")),
    ("--rollout-correction", "algorithm.rollout_correction",
     dict(help="importance weights from the engine's log-probs to the trainer's "
                                               "(default token-tis with --async, else none)")),
    ("--correction-cap", "algorithm.correction_cap", dict(type=float, help="largest importance weight (> 0)")),
    ("--lr", "actor.lr", dict(type=float)),
    ("--warmup-steps", "actor.warmup_steps", dict(type=int)),
    ("--policy-loss", "actor.policy_loss", dict(choices=None, help="policy loss (vanilla: PPO clip)")),
    ("--teacher", "distill.teacher", dict(help="distil from this teacher (HF folder or .gguf sharing the tokenizer): "
                                               "its per-token reverse KL as the advantage (README: Distillation)")),
    ("--kl-coef", "actor.kl_loss_coef", dict(type=float, help="KL-to-reference loss coefficient (0: no reference)")),
    ("--clip-high", "actor.clip_high", dict(type=float, help="upper clip ratio (DAPO clip-higher)")),
    ("--lora-rank", "actor.lora_rank", dict(type=int, help="train LoRA adapters of this rank (0: every weight); "
                                                          "use a ~10x larger --lr")),
    ("--micro-batch", "actor.micro_batch_rows", dict(type=int, help="rows per forward/backward")),
    ("--strict-answers", "reward.fn", dict(action="store_const", const="strict",
                                           help="count only answers after '####' or boxed (else the last number)")),
    ("--reward-fn", "reward.fn", dict(help="lenient, strict, or module:function / file.py:function")),
    ("--format-bonus", "reward.format_bonus", dict(type=float, help="with --strict-answers: reward for any '####' "
                                                                    "answer, right or wrong")),
    ("--reward-model", "reward.model", dict(help="a local HF sequence-classification model scoring responses")),
    ("--steps", "trainer.steps", dict(type=int)),
    ("--eval-every", "trainer.eval_every", dict(type=int)),
    ("--checkpoint-every", "trainer.checkpoint_every", dict(type=int)),
    ("--seed", "trainer.seed", dict(type=int)),
    ("--log", "trainer.log", dict(nargs="*")),
    ("--threads", "trainer.threads", dict(type=int, help="torch CPU threads (0: torch's default)")),
    ("--no-progress", "trainer.progress", dict(action="store_const", const=False)),
    ("--executor", "executor.kind", dict(help="local: one process; ray: FSDP2 "
                                                                       "training ranks + rollout workers")),
    ("--ray-address", "executor.ray_address", dict(help="join this Ray cluster ('auto' or host:port)")),
    ("--placement", "executor.placement", dict(help="where each role lives (Ray): split, "
                                                                             "colocated = hybrid_engine, "
                                                                             "fully_collocated, split_collocate, "
                                                                             "standalone")),
    ("--train-ranks", "executor.train_ranks", dict(type=int)),
    ("--rollout-workers", "executor.rollout_workers", dict(type=int)),
    ("--reward-workers", "executor.reward_workers", dict(type=int, help="CPU workers scoring rewards (0: driver)")),
    ("--gpus-per-worker", "executor.gpus_per_worker", dict(type=float)),
    ("--cpus-per-worker", "executor.cpus_per_worker", dict(type=float)),
    ("--sync-checksum", "executor.sync_checksum", dict(action="store_const", const=True)),
    ("--step-timeout", "executor.step_timeout", dict(type=float, help="seconds before a silent rank ends the run")),
    ("--ray-temp-dir", "executor.ray_temp_dir", dict(help="temp/log folder of a locally started Ray")),
    ("--async", "asynchronous.enable", dict(action="store_const", const=True,
                                            help="a generator samples with published weights while the trainer "
                                                 "updates")),
    ("--max-staleness", "asynchronous.max_staleness", dict(type=int)),
    ("--stale-policy", "asynchronous.stale_policy", dict()),
    ("--queue-batches", "asynchronous.queue_batches", dict(type=int)),
    ("--generators", "asynchronous.generators", dict(type=int, help="independent generator loops (--async)")),
    ("--interruptible", "asynchronous.interruptible", dict(action="store_const", const=True,
                                                           help="generators continue open rows on newer weights")),
    ("--env", "env.name", dict(help="the task's environment: single_turn, calculator, or module:name of "
                                    "an environment (purerl's Env or a TRL environment_factory class)")),
    ("--no-tool", "env.tools", dict(action="store_const", const=False, help="the environment without its tools "
                                                                           "(the baseline)")),
    ("--max-turns", "env.max_turns", dict(type=int, help="model turns per episode")),
    ("--tool-bonus", "env.tool_bonus", dict(type=float, help="reward per tool call that did not fail")),
    ("--sft-steps", "env.sft_steps", dict(type=int, help="supervised warm-up steps on demonstrations before RL")),
    ("--sft-data", "env.sft_data", dict(nargs="+", help="the warm-up's demonstrations (.jsonl/.parquet): TRL's "
                                                       "messages or prompt+completion rows, or verl's SFT columns")),
    ("--sft-prompt-key", "env.sft_prompt_key", dict(help="verl SFT data: the prompt column (or a dotted path into a "
                                                         "dict column: extra_info.question)")),
    ("--sft-response-key", "env.sft_response_key", dict(help="verl SFT data: the response column (or a dotted "
                                                             "path: extra_info.answer)")),
]
FLAG_OF = {key: flag for flag, key, _ in FLAGS if key != "reward.fn"}
_OVERRIDE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)+=")
_KEY = re.compile(r"^([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)")


@attrs.frozen
class Invocation:
    """A parsed command line: the resolved config, and how to run it (not part of the config)."""

    config: JobConfig
    out_dir: str
    resume: bool = False
    overwrite: bool = False
    debug: bool = False


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, without the usage block
        self.exit(2, f"{self.prog}: error: {message}\n")


def with_flags(message: str) -> str:
    """``message`` with the flag of each config key it names added after the key
    (``trainer.steps must be ≥ 1`` → ``trainer.steps (--steps) must be ≥ 1``)."""
    return re.sub(r"(?<![\w.-])([a-z_]+\.[a-z_]+)(?=\s)",
                  lambda m: f"{m[1]} ({FLAG_OF[m[1]]})" if m[1] in FLAG_OF else m[1], message, count=1)


def job_parser(*, prog: str, description: str | None = None, default_out_dir: str) -> argparse.ArgumentParser:
    """The job's argument parser: the run's own flags and :data:`FLAGS` (``section.key=value``
    overrides are taken apart before it parses)."""
    ap = _Parser(prog=prog, description=description, formatter_class=argparse.RawDescriptionHelpFormatter,
                 epilog="Any config key may be set as section.key=value (e.g. actor.lr=1e-6 "
                        "algorithm.adv_estimator=rloo); keys: purerl/config/job.py, examples in examples/")
    ap.add_argument("--config", action="append", default=[], metavar="FILE",
                    help="a TOML/YAML config file (repeatable; later files win)")
    ap.add_argument("--out-dir", default=default_out_dir,
                    help="the run's folder: config, metrics, samples, checkpoints, the export")
    ap.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --out-dir")
    ap.add_argument("--overwrite", action="store_true", help="replace the run in --out-dir (default: refuse)")
    ap.add_argument("--debug", action="store_true", help="full tracebacks instead of one-line errors")
    ap.add_argument("--print-config", action="store_true", help="print the resolved config (JSON) and exit")
    ap.add_argument("--engine-option", action="append", default=[], metavar="KEY=VALUE",
                    help="an option of the rollout engine, repeatable: e.g. gpu_memory_utilization=0.4")
    for flag, key, kwargs in FLAGS:
        kwargs = dict(kwargs)  # FLAGS is shared by every parse
        if "choices" not in kwargs and "action" not in kwargs:
            kwargs["choices"] = _choices(key)
        shown = {} if "action" in kwargs or "choices" in kwargs else {"metavar": key.rsplit(".", 1)[-1].upper()}
        text = f"{kwargs.pop('help', '')} [{key}{_default_shown(key, kwargs)}]".strip()
        ap.add_argument(flag, dest=key, default=None, help=text, **shown, **kwargs)
    return ap


def parse_command_line(argv: Sequence[str] | None = None, *, prog: str, description: str | None = None,
                       default_out_dir: str) -> Invocation:
    """The job's command line: defaults ← ``--config`` files ← flags ← ``section.key=value``
    overrides, each checked as it is applied; then the resolved config's rules, before anything
    loads. Errors exit with status 2 and one line (``--print-config``: print the config and exit)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = job_parser(prog=prog, description=description, default_out_dir=default_out_dir)
    items = [a for a in argv if _OVERRIDE.match(a)]
    args = ap.parse_args([a for a in argv if not _OVERRIDE.match(a)])
    for key in ("data.train_files", "data.eval_files"):
        if getattr(args, key) == []:
            ap.error(f"{FLAG_OF[key]} needs at least one file")
    if args.resume and args.overwrite:
        ap.error("--resume and --overwrite exclude each other")
    try:
        engine_options = dict(_engine_option(text) for text in args.engine_option)
        flags = merge(*(nest(key, getattr(args, key)) for _, key, _ in FLAGS if getattr(args, key) is not None))
        if engine_options:
            flags = merge(flags, nest("rollout.engine_options", engine_options))
        files = [_checked_file(path) for path in args.config]
        config = resolve(build(JobConfig, merge(*files, flags, overrides(items))))
    except ConfigError as err:
        ap.error(with_flags(str(err)))
    if found := problems(config):
        ap.error("; ".join(with_flags(problem) for problem in found))
    if args.print_config:
        print(json.dumps(to_dict(config), indent=1))
        ap.exit(0)
    return Invocation(config, args.out_dir, args.resume, args.overwrite, args.debug)


def _choices(key: str) -> list[str] | None:
    """The values the setting ``key`` accepts where its validator names them (``one_of``, alone or over a
    tuple's items): the flag offers what the config checks, spelled once."""
    section, name = key.split(".")
    check = attrs.fields_dict(type(getattr(JobConfig(), section)))[name].validator
    check = getattr(check, "member_validator", check)  # attrs' deep_iterable: each item's check
    check = getattr(check, "validator", check)  # attrs' optional: the value's check where it is not None
    names = getattr(check, "choices", None)
    return None if names is None else list(names())


def _default_shown(key: str, kwargs: dict) -> str:
    """``", default X"`` for a flag's help, from the config's own default (none for switches, empty values)."""
    if "action" in kwargs:
        return ""
    value: Any = JobConfig()
    for part in key.split("."):
        value = getattr(value, part)
    if value is None or value == () or value == "":
        return ""
    return f", default {' '.join(map(str, value)) if isinstance(value, tuple) else value}"


def _checked_file(path: str) -> dict[str, Any]:
    """A config file's layer, checked alone first, so that an error names the file."""
    layer = load_file(path)
    try:
        build(JobConfig, layer)
    except ConfigError as err:
        raise ConfigError(f"config file {path}: {err}") from None
    return layer


def _engine_option(text: str) -> tuple[str, Any]:
    """``KEY=VALUE`` with VALUE read as JSON when it parses (numbers, true/false), else a string."""
    key, sep, value = text.partition("=")
    if not sep or not key.isidentifier():
        raise ConfigError(f"--engine-option wants KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value
