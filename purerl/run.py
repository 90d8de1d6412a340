"""A config becomes a run: data, reward, model, state, step function, executor, training, evaluation,
summary and export, in a run folder that resumes.

:func:`run` is the whole job (``experiments/grpo_math.py`` is its command line); the pieces it
assembles are importable alone for scripts of their own::

    config = resolve(build(JobConfig, load_file("examples/ppo_gae.toml")))
    summary = run(config, "runs/ppo")
"""

import copy
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import torch

from purerl.config.job import JobConfig
from purerl.config.loading import to_dict
from purerl.data.cursor import DataCursor
from purerl.data.math_problems import train_eval_split
from purerl.data.records import DataError, PromptRecord, encode_prompts, load_records
from purerl.episodes import ChatCodec, TemplateError
from purerl.episodes.adapters import environment
from purerl.episodes.calculator import demonstration
from purerl.episodes.rollout import EpisodeLimits
from purerl.executors.base import Executor, ExecutorError
from purerl.executors.local import LocalExecutor
from purerl.io.checkpoint import latest_checkpoint, load_checkpoint
from purerl.io.metrics import MetricsLog
from purerl.io.run_folder import RunFolder, check_resume_config, save_run_config
from purerl.loop.async_train import train_async
from purerl.loop.evaluation import evaluate
from purerl.loop.recording import record_reward_errors
from purerl.loop.sampling import Episodes, Task
from purerl.loop.train import train
from purerl.loop.warm_up import warm_up
from purerl.models import (
    CausalLM,
    Critic,
    Params,
    cast_floating,
    causal_lm_from_config,
    critic_from_causal_lm,
    load_causal_lm,
    smollm2_gguf,
)
from purerl.models.hf import export_hf
from purerl.models.lora import LoraSpec, apply_lora, export_peft
from purerl.rewards import RewardFn, math_reward, reward_function
from purerl.rollout.engine import make_engine
from purerl.state import RngState, TrainState
from purerl.step.recipes import actor_optimizer, critic_optimizer, kl_controller_of, step_function
from purerl.tiny import char_tokenizer, tiny_llama_config
from purerl.tree import tree_clone

__all__ = ["MAY_CHANGE_ON_RESUME", "check_context", "engine_options", "episodes_of", "initial_state", "load_critic",
           "load_policy", "load_records_of", "load_tasks", "make_executor", "reward_of", "run"]

MAY_CHANGE_ON_RESUME = {"trainer.steps", "trainer.eval_every", "trainer.checkpoint_every", "trainer.log",
                        "trainer.progress", "trainer.threads", "trainer.samples_per_step", "trainer.sample_chars",
                        "model.device", "actor.micro_batch_rows",
                        "actor.offload_params", "actor.offload_optimizer",
                        "rollout.engine_options", "executor"}
"""Settings a resumed run may change (a section name covers its keys); all others must equal the
run's ``config.json``."""


def load_records_of(config: JobConfig) -> tuple[list[PromptRecord], list[PromptRecord], dict[str, int]]:
    """Training and held-out records (before any model loads: data errors come first). With train
    files and no eval files, the held-out rows are drawn from the train files and not trained on."""
    data, seed = config.data, config.trainer.seed
    if not data.train_files:
        train_records, eval_records = train_eval_split(data.train_size, data.eval_size, seed=seed,
                                                       difficulties=tuple(data.difficulty))
        return train_records, eval_records, {}
    train_records = load_records(list(data.train_files))
    if data.eval_files:
        return train_records, load_records(list(data.eval_files))[: data.eval_size], {}
    if len(train_records) <= data.eval_size:
        raise DataError(f"data.train_files have {len(train_records)} rows: too few to hold out data.eval_size "
                        f"{data.eval_size} for evaluation; give data.eval_files or a smaller data.eval_size")
    order = torch.randperm(len(train_records), generator=torch.Generator().manual_seed(seed)).tolist()
    held_out = set(order[: data.eval_size])
    print(f"evaluating on {data.eval_size} rows held out of the training files (not trained on)", flush=True)
    return ([r for i, r in enumerate(train_records) if i not in held_out],
            [train_records[i] for i in sorted(held_out)], {"eval_rows_held_out_of_data": data.eval_size})


def reward_of(config: JobConfig) -> RewardFn:
    """``reward.fn``: a built-in reward by name or a user's ``module:function``."""
    try:
        return reward_function(config.reward.fn, format_bonus=config.reward.format_bonus)
    except ValueError as err:
        raise DataError(f"reward.fn: {err}") from None


def episodes_of(config: JobConfig, tokenizer: Any, reward_fn: RewardFn, options: dict[str, Any]) -> Episodes | None:
    """How the tasks' episodes are played (``env``), None for single-turn answers. ``options``:
    :func:`engine_options` (EOS and padding ids)."""
    env_config = config.env
    if not env_config.multi_turn:
        return None
    try:
        env = environment(env_config.name, answer_fn=reward_fn, tools=env_config.tools, format=env_config.format)
    except ValueError as err:
        raise DataError(f"env.name: {err}") from None
    try:
        codec = ChatCodec(tokenizer, eos_token_ids=options["eos_token_ids"])
    except TemplateError as err:
        raise DataError(f"env.name {env_config.name}: the tokenizer's chat template cannot grow episodes: {err}") from None
    limits = EpisodeLimits(max_turns=env_config.max_turns, max_tokens=env_config.max_tokens,
                           step_timeout=env_config.step_timeout, tool_bonus=env_config.tool_bonus,
                           per_turn_rewards=env_config.per_turn_rewards)
    tools = getattr(env, "chat_tools", None)
    template_kwargs = {"tools": tools} if env_config.format == "json" and tools else {}
    return Episodes(env, codec, limits, template_kwargs, options["pad_token_id"])


def load_tasks(config: JobConfig, train_records: list[PromptRecord], eval_records: list[PromptRecord],
               tokenizer: Any, reward_fn: RewardFn,
               episodes: Episodes | None = None) -> tuple[Task, Task, dict[str, int]]:
    """The training and held-out tasks (prompts longer than ``data.max_prompt_tokens`` skipped and
    counted), played as ``episodes`` when given. Held-out metrics: ``accuracy`` by the reward
    function, ``strict_accuracy`` by the strict math reward."""
    counts, tasks = {}, []
    decode = _decoder(tokenizer)
    for name, records in (("train", train_records), ("eval", eval_records)):
        encoded = encode_prompts(records, tokenizer, max_prompt_tokens=config.data.max_prompt_tokens)
        if not encoded.ids:
            raise DataError(f"every {name} prompt is longer than data.max_prompt_tokens {config.data.max_prompt_tokens}")
        counts[f"{name}_prompts"] = len(encoded.ids)
        counts[f"{name}_skipped_overlong"] = encoded.skipped
        tasks.append(Task(encoded.ids, [records[i] for i in encoded.record_index], reward_fn, decode,
                          {"accuracy": reward_fn, "strict_accuracy": math_reward}, episodes))
    return tasks[0], tasks[1], counts


def _decoder(tokenizer: Any) -> Callable[[list[int]], str]:
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


def _driver_device(config: JobConfig) -> str:
    """Where this process keeps the weights: ``model.device`` for the local executor; the CPU under
    Ray, whose workers take GPUs through ``executor.gpus_per_worker`` (the driver only ships them)."""
    return config.model.device if config.executor.kind == "local" else "cpu"


def load_policy(config: JobConfig) -> tuple[CausalLM, Params, Any]:
    """The policy (``model.path``, the default GGUF, or a tiny random one) and its tokenizer: float32
    master weights, computing in ``model.dtype``."""
    if config.model.tiny:
        tokenizer = char_tokenizer()
        context = {"max_position_embeddings": max(256, config.env.max_tokens)} if config.env.multi_turn else {}
        model, params = causal_lm_from_config(tiny_llama_config(vocab_size=len(tokenizer), hidden_size=64, **context),
                                              seed=config.trainer.seed, device=_driver_device(config))
        return (*_adapted(config, model, params), tokenizer)
    from transformers import AutoTokenizer

    path = Path(config.model.path) if config.model.path else smollm2_gguf()
    if path.suffix == ".gguf":
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    else:
        tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "left"
    model, params = load_causal_lm(path, device=_driver_device(config))
    return (*_adapted(config, model, params), tokenizer)


def compute_dtype(config: JobConfig) -> torch.dtype | None:
    """The dtype the forwards compute in when it is not the float32 of the master weights."""
    return None if config.model.dtype == "float32" else getattr(torch, config.model.dtype)


def _adapted(config: JobConfig, model: CausalLM, params: Params) -> tuple[CausalLM, Params]:
    """``model`` computing in ``model.dtype`` (mixed precision: the float32 ``params`` stay the
    masters); with ``actor.packed_forwards``, its training forwards packed; with
    ``actor.lora_rank``, the LoRA policy on that base (held in the compute dtype: it is never
    updated) and its float32 adapters."""
    actor = config.actor
    model = attrs.evolve(model, packed=actor.packed_forwards, compute_dtype=compute_dtype(config))
    if not actor.lora_rank:
        return model, params
    try:
        model, adapters = apply_lora(model, params, LoraSpec(actor.lora_rank, actor.lora_alpha,
                                                             tuple(actor.lora_targets)), seed=config.trainer.seed)
    except ValueError as err:
        raise DataError(f"actor.lora_targets: {err}") from None
    return attrs.evolve(model, frozen=cast_floating(model.frozen, model.compute_dtype)), adapters


def load_critic(config: JobConfig, model: CausalLM, params: Params) -> tuple[Critic | None, Params | None]:
    """The value model when the estimator reads values: a zero value head on a copy of the policy's
    backbone (a LoRA policy's base), or on the base of ``critic.model``, packed with
    ``actor.packed_forwards``; (None, None) otherwise."""
    if not config.algorithm.estimator.needs_values:
        return None, None
    params = params if model.lora is None else model.frozen
    if config.critic.model:
        policy_vocab = model.config.vocab_size
        model, params = load_causal_lm(Path(config.critic.model), device=_driver_device(config))
        if model.config.vocab_size < policy_vocab:
            raise DataError(f"critic.model {config.critic.model}: vocabulary of {model.config.vocab_size} tokens, "
                            f"smaller than the policy's {policy_vocab}: it cannot read the policy's token ids")
    critic, critic_params = critic_from_causal_lm(model, params)
    critic_params = {k: v.float() for k, v in critic_params.items()}  # masters (a LoRA base is held narrower)
    return attrs.evolve(critic, packed=config.actor.packed_forwards, compute_dtype=compute_dtype(config)), critic_params


def initial_state(config: JobConfig, params: Params, critic_params: Params | None = None) -> TrainState:
    """Step 0: the policy and its optimizer state, a frozen reference copy when a KL term reads it
    (with LoRA, ``{}``: the base itself, no copy), the critic and its optimizer state when there is
    one, the KL controller, RNG and data cursor."""
    reference = None
    if config.actor.kl_loss_coef > 0 or config.algorithm.use_kl_in_reward:  # frozen: kept as it computes
        reference = {} if config.actor.lora_rank else tree_clone(cast_floating(params, compute_dtype(config)))
    state = TrainState(policy=params, policy_opt=actor_optimizer(config).init(params),
                       kl=kl_controller_of(config).init(), rng=RngState(config.trainer.seed),
                       data=DataCursor(config.trainer.seed), reference=reference)
    if critic_params is not None:
        state = attrs.evolve(state, critic=critic_params, critic_opt=critic_optimizer(config).init(critic_params))
    return state


def engine_options(config: JobConfig, model: CausalLM, tokenizer: Any) -> dict[str, Any]:
    """The rollout engine's keyword arguments: end-of-sequence and padding ids, ``decode``, and
    ``rollout.engine_options``."""
    eos_id = model.config.eos_token_id
    eos = {tokenizer.eos_token_id, *([eos_id] if isinstance(eos_id, int) else (eos_id or []))}
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return dict(eos_token_ids=sorted(e for e in eos if e is not None), pad_token_id=pad, decode=_decoder(tokenizer),
                **config.rollout.engine_options)


def make_executor(config: JobConfig, model: CausalLM, critic: Critic | None, options: dict[str, Any]) -> Executor:
    """The local executor (with an engine per generator when asynchronous), or the Ray one,
    which builds the step function on each rank from the config."""
    rollout, executor = config.rollout, config.executor
    if executor.kind == "local":
        engine = make_engine(rollout.engine, model, device=config.model.device, **options)
        generators = []
        for _ in range(config.asynchronous.generators if config.asynchronous.enable else 0):
            own = attrs.evolve(model, module=copy.deepcopy(model.module))  # no module shared with another thread
            generators.append(make_engine(rollout.engine, own, device=config.model.device, **options))
        return LocalExecutor(step_function(config), model, engine, generator_engines=generators, critic=critic,
                             reward_model=config.reward.model)
    import functools

    from purerl.executors.ray import RayExecutor

    ray_init = {"_temp_dir": str(Path(executor.ray_temp_dir).resolve())} if executor.ray_temp_dir else None
    from purerl.executors.fsdp import Offload

    ray_executor = RayExecutor(None, model, engine_kwargs=options, config=executor, engine=rollout.engine,
                               reward_model=config.reward.model, ray_init=ray_init, critic=critic,
                               make_step_fn=functools.partial(step_function, config),
                               offload=Offload(config.actor.offload_params, config.actor.offload_optimizer),
                               generators=config.asynchronous.generators if config.asynchronous.enable else 0,
                               generate_timeout=config.asynchronous.generate_timeout)
    return ray_executor


def check_context(config: JobConfig, model: CausalLM) -> None:
    """Refuse prompts and responses that together exceed the model's context (``DataError``)."""
    context = getattr(model.config, "max_position_embeddings", None)
    if config.env.multi_turn and context is not None and config.env.max_tokens > context:
        raise DataError(f"env.max_tokens {config.env.max_tokens} exceeds the model's context of {context} "
                        "(max_position_embeddings)")
    needed = config.data.max_prompt_tokens + config.rollout.max_new_tokens
    if context is not None and needed > context:
        raise DataError(f"data.max_prompt_tokens {config.data.max_prompt_tokens} + rollout.max_new_tokens "
                        f"{config.rollout.max_new_tokens} = {needed} tokens exceed the model's context of {context} "
                        "(max_position_embeddings)")


def run(config: JobConfig, out_dir: str | Path, *, resume: bool = False, overwrite: bool = False,
        stop: threading.Event | None = None) -> dict[str, Any]:
    """The job: hold the run folder (one run at a time), load data, reward and model (before
    anything is written), claim the folder, build the state, the step and the executor, evaluate
    (or resume), train, evaluate, export. Returns the summary (also in ``summary.json``), with the
    metrics records under ``records``. A start that fails before its first step leaves the folder
    as it was. ``config`` must be resolved (:func:`purerl.config.rules.resolve`)."""
    if config.trainer.threads:
        torch.set_num_threads(config.trainer.threads)
    run_dir = Path(out_dir)
    with RunFolder(run_dir) as folder:
        try:
            summary = _run_in(folder, config, resume, overwrite, stop)
        except BaseException:
            if not folder.trained():
                folder.undo()
            raise
        records = summary.pop("records")
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    return {**summary, "records": records}


def _run_in(folder: RunFolder, config: JobConfig, resume: bool, overwrite: bool,
            stop: threading.Event | None) -> dict[str, Any]:
    """:func:`run` in the folder it holds: everything is loaded and checked before the folder is
    claimed."""
    run_dir = folder.path
    folder.check(resume=resume, overwrite=overwrite)
    recorded = to_dict(config)
    if resume and not check_resume_config(run_dir, recorded, MAY_CHANGE_ON_RESUME):
        print(f"--resume: {run_dir} records no settings (config.json) in this layout to check against", flush=True)
    wall_start = time.time()
    train_records, eval_records, data_counts = load_records_of(config)
    reward_fn = reward_of(config)
    model, params, tokenizer = load_policy(config)
    check_context(config, model)
    options = engine_options(config, model, tokenizer)
    episodes = episodes_of(config, tokenizer, reward_fn, options)
    train_task, eval_task, counts = load_tasks(config, train_records, eval_records, tokenizer, reward_fn, episodes)
    if config.env.sft_steps and episodes is not None and not hasattr(episodes.env, "tools"):  # before any work
        raise DataError(f"env.sft_steps: environment {config.env.name} writes no demonstrations (only calculator "
                        "does): set env.sft_steps=0")
    critic, critic_params = load_critic(config, model, params)
    state = initial_state(config, params, critic_params)
    for leftover in folder.begin(overwrite=overwrite):
        print(f"removed {leftover}, an unfinished checkpoint write", flush=True)
    if not resume or not (run_dir / "config.json").exists():
        save_run_config(run_dir, recorded)
    sft: dict[str, Any] = {}
    if config.env.sft_steps and not (resume and latest_checkpoint(run_dir / "checkpoints") is not None):
        state, sft = _warm_up(config, state, model, options, train_task, eval_task)
    with make_executor(config, model, critic, options) as executor:
        summary = _train_and_evaluate(config, run_dir, resume, executor, state, train_task, eval_task, stop)
        state = summary.pop("_state")
        policy = executor.full_state(state).policy
        export = export_hf(model, policy, run_dir / "export", tokenizer)
        adapter = {}
        if model.lora is not None:
            base = str(config.model.path or ("tiny" if config.model.tiny else smollm2_gguf()))
            adapter = {"adapter": str(export_peft(model, policy, run_dir / "adapter", base_model=base))}
    return {**summary, **counts, **data_counts, **sft, "wall_seconds": time.time() - wall_start, "export": str(export),
            **adapter, "config": recorded}


def _warm_up(config: JobConfig, state: TrainState, model: CausalLM, options: dict[str, Any], train_task: Task,
             eval_task: Task) -> tuple[TrainState, dict[str, Any]]:
    """The SFT warm-up (:func:`~purerl.loop.warm_up.warm_up`) on the driver, with the held-out
    accuracy before it (greedy, the embedded engine on the driver's weights) in its report."""
    device = _driver_device(config)
    engine = make_engine("torch", model, device=device,
                         **{k: options[k] for k in ("eos_token_ids", "pad_token_id", "decode")})
    engine.sync(state.policy, 0)
    before = evaluate(engine, eval_task, version=0, max_new_tokens=config.rollout.max_new_tokens,
                      reward_timeout=config.reward.timeout, batch_timeout=config.reward.batch_timeout)
    engine.close()
    print(f"before the SFT warm-up: held-out greedy accuracy {before['val/accuracy']:.3f}", flush=True)
    env = train_task.episodes.env
    state, report = warm_up(state, train_task, config, model, lambda r: demonstration(r, env), device=device)
    print(f"SFT warm-up: {report['sft_steps']} steps, loss {report['sft_loss_first']:.3f} -> "
          f"{report['sft_loss_last']:.3f} in {report['sft_seconds']:.0f} s", flush=True)
    return state, {"sft": {**report, "accuracy_before_sft": before["val/accuracy"],
                           "evaluation_before_sft": {k: v for k, v in before.items() if k.startswith("val/")}}}


def _write_workers(executor: Executor, run_dir: Path) -> None:
    """The PIDs of a Ray executor's workers, once started (the roles' pools too), in ``workers.json``."""
    if hasattr(executor, "worker_pids"):
        (run_dir / "workers.json").write_text(json.dumps(executor.worker_pids()))


def _read_baseline(path: Path) -> float | None:
    """The step-0 accuracy recorded in ``baseline.json`` (None when it is missing)."""
    if not path.exists():
        return None
    try:
        return float(json.loads(path.read_text())["val/accuracy"])
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError) as err:
        raise DataError(f"{path}: not the baseline evaluation a run writes ({type(err).__name__}: {err}); delete it "
                        "to resume without a step-0 accuracy") from None


def _train_and_evaluate(config: JobConfig, run_dir: Path, resume: bool, executor: Executor, state: TrainState,
                        train_task: Task, eval_task: Task, stop: threading.Event | None) -> dict[str, Any]:
    """Baseline evaluation (or resume), training, final evaluation; the summary, with the final
    (driver's) state under ``_state``."""
    log = MetricsLog(run_dir, tuple(config.trainer.log), config=to_dict(config))

    def evaluate_on_engine(state: TrainState) -> dict[str, Any]:
        with executor.engine(executor.newest(state.step), "evaluate") as engine:
            return evaluate(engine, eval_task, version=state.step, max_new_tokens=config.rollout.max_new_tokens,
                            reward_timeout=config.reward.timeout, batch_timeout=config.reward.batch_timeout,
                            score=executor.score, sample_chars=config.trainer.sample_chars)

    evaluated: dict[int, dict[str, Any]] = {}  # the newest evaluation: the final one is asked for twice

    def evaluate_fn(state: TrainState) -> dict[str, Any]:
        if state.step in evaluated:
            return dict(evaluated[state.step])
        broken = set(getattr(executor, "broken", ()))  # Ray: generators waiting for new workers
        try:
            result = evaluate_on_engine(state)
        except ExecutorError:
            if set(getattr(executor, "broken", ())) == broken:
                raise
            result = evaluate_on_engine(state)  # a generator's workers died under it: once more, on another's
        evaluated.clear()
        evaluated[state.step] = result
        return dict(result)

    baseline = run_dir / "baseline.json"
    if resume and (checkpoint := latest_checkpoint(run_dir / "checkpoints")) is not None:
        state = executor.start(load_checkpoint(checkpoint, state))
        _write_workers(executor, run_dir)
        log.truncate_after(state.step)
        before = _read_baseline(baseline)
        print(f"resumed from {checkpoint} at step {state.step}"
              + ("" if baseline.exists() else f" ({baseline} is missing: no step-0 accuracy to compare with)"),
              flush=True)
    else:
        log.clear()
        state = executor.start(state)
        _write_workers(executor, run_dir)
        first = evaluate_fn(state)
        record_reward_errors(run_dir, 0, first)
        log.write_samples(0, first)
        baseline.write_text(json.dumps(first))
        before = first["val/accuracy"]
        print(f"step 0 held-out greedy accuracy {before:.3f} (strict {first['val/strict_accuracy']:.3f}) on "
              f"{len(eval_task.records)} problems", flush=True)

    report = None
    common = dict(executor=executor, task=train_task, config=config, run_dir=run_dir, log=log,
                  evaluate_fn=evaluate_fn, stop=stop)
    if config.asynchronous.enable:
        state, report = train_async(state, **common)
    else:
        state = train(state, **common)
    log.close()
    records = MetricsLog.read(log.path)
    if records and "val/accuracy" in records[-1]:
        final = records[-1]
    else:
        final = evaluate_fn(state)
        record_reward_errors(run_dir, state.step, final)
        log.write_samples(state.step, final)
    after = final["val/accuracy"]
    gain = None if before is None else 100 * (after - before)
    print(f"held-out greedy accuracy {'?' if before is None else f'{before:.3f}'} -> {after:.3f}"
          + ("" if gain is None else f" ({gain:+.1f} points)"), flush=True)
    async_report = {}
    if report is not None:
        histogram = {str(k): v for k, v in report["staleness_histogram"].items()}
        async_report = {"async": {**report, "staleness_histogram": histogram}}
    return {"model": "tiny" if config.model.tiny else str(config.model.path or smollm2_gguf()),
            "algorithm": config.algorithm.adv_estimator, "policy_loss": config.actor.policy_loss,
            "steps": state.step, "eval_problems": len(eval_task.records), "accuracy_before": before,
            "accuracy_after": after, "accuracy_gain_points": gain,
            "strict_accuracy_after": final.get("val/strict_accuracy"),
            "final_evaluation": {k: v for k, v in final.items() if k.startswith("val/")}, **async_report,
            "records": records,
            "_state": state}
