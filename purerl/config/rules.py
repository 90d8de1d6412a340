"""Rules across sections of the job's config, checked before anything loads, and the values a
run resolves once (what its run folder records).

Single settings are checked where they are defined (:mod:`purerl.config.job`); these rules
relate settings of several sections, or a setting and the world (files, installed packages).
What an estimator or loss needs comes from its record (:mod:`purerl.algo.estimators`,
:mod:`purerl.algo.policy_loss`), never from comparing its name.
"""

from pathlib import Path

import attrs

from purerl.config.job import CriticConfig, JobConfig
from purerl.data.math_problems import DIFFICULTIES
from purerl.executor_kinds import EXECUTORS
from purerl.rollout.engines import ENGINES

__all__ = ["COLD_MIN_PROBLEMS", "RESOLVED", "cold_start", "cold_start_skipped", "may_start_cold", "problems", "resolve"]

COLD_MIN_PROBLEMS = 32
"""Held-out problems below which a step-0 accuracy says too little to change ``rollout.n`` on."""


RESOLVED = ("model.device", "algorithm.rollout_correction", "actor.recompute_old_logprobs", "executor.rollout_workers",
            "reward.overlong_buffer", "trainer.threads", "critic.max_tokens_per_micro_batch")
"""The settings :func:`resolve` may change: an automatic default made explicit (``executor.rollout_workers``:
raised to the generators' count). A run records them resolved; its report shows them apart from the
settings it was given."""


NEXT_PLAIN_TURN = "\nuser:"
"""Where a plain prompt's next user turn begins (:func:`purerl.data.records.plain_text`)."""


def resolve(config: JobConfig) -> JobConfig:
    """Automatic values made explicit: ``model.device`` (``auto``: the GPU when there is one),
    ``algorithm.rollout_correction`` (None: ``token-tis`` when asynchronous, else ``none``) and
    ``actor.recompute_old_logprobs`` (None: recompute unless the engine's log-probs are exactly
    the trainer's: the embedded engine in float32, synchronous, no top-p, no correction; a
    bfloat16 decoder and a bfloat16 forward round differently) and
    ``executor.rollout_workers`` (asynchronous on Ray: at least one per generator),
    ``reward.overlong_buffer`` (None: a third of ``rollout.max_new_tokens``), ``trainer.threads``
    (0: the count torch uses here, recorded so a replay computes as the run did) and, with a
    critic, ``critic.max_tokens_per_micro_batch`` (None: the actor's token budget); with ``data.few_shot``
    examples in ``plain`` prompts, ``rollout.stop`` gains :data:`NEXT_PLAIN_TURN` (a base model goes on to write
    the next example). Resolving a resolved config changes nothing."""
    import torch  # here: reading a config (a --help, the docs, a report) imports no torch

    device = config.model.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    algorithm, actor, rollout = config.algorithm, config.actor, config.rollout
    correction = algorithm.rollout_correction
    if correction is None:
        correction = "token-tis" if config.asynchronous.enable else "none"
    recompute = actor.recompute_old_logprobs
    if recompute is None:
        recompute = (rollout.top_p < 1.0 or correction != "none" or config.asynchronous.enable
                     or not ENGINES[rollout.engine].exact_logprobs or config.model.dtype != "float32"
                     or rollout.engine_options.get("dtype") not in (None, config.model.dtype))
    executor = config.executor
    if config.asynchronous.enable:
        executor = attrs.evolve(executor, rollout_workers=max(executor.rollout_workers, config.asynchronous.generators))
    critic = config.critic
    if algorithm.estimator.needs_values and critic.max_tokens_per_micro_batch is None:
        critic = attrs.evolve(critic, max_tokens_per_micro_batch=actor.max_tokens_per_micro_batch)
    reward = config.reward
    if reward.overlong_buffer is None:
        reward = attrs.evolve(reward, overlong_buffer=rollout.max_new_tokens // 3)
    if config.data.few_shot and config.data.prompt_format == "plain" and NEXT_PLAIN_TURN not in rollout.stop:
        rollout = attrs.evolve(rollout, stop=(*rollout.stop, NEXT_PLAIN_TURN))
    trainer = config.trainer
    if not trainer.threads:
        trainer = attrs.evolve(trainer, threads=torch.get_num_threads())
    return attrs.evolve(config, model=attrs.evolve(config.model, device=device), reward=reward, trainer=trainer,
                        algorithm=attrs.evolve(algorithm, rollout_correction=correction),
                        actor=attrs.evolve(actor, recompute_old_logprobs=recompute), executor=executor, critic=critic,
                        rollout=rollout)


def problems(config: JobConfig) -> list[str]:
    """What is wrong with ``config`` as a whole, one message per problem, each naming its keys."""
    algorithm, actor, rollout, reward, trainer = (config.algorithm, config.actor, config.rollout, config.reward,
                                                  config.trainer)
    estimator = algorithm.estimator
    found = []
    executor = config.executor.of_kind
    if (actor.offload_params or actor.offload_optimizer) and not executor.offloads:
        able = ", ".join(name for name in EXECUTORS.names() if EXECUTORS[name].offloads)
        found.append("actor.offload_params/offload_optimizer: offloading moves FSDP2's shards to host memory, so it "
                     f"needs an executor that shards them (executor.kind {able}; the {executor.name} executor keeps "
                     "every tensor on model.device)")
    if estimator.grouped and rollout.n < 2:
        found.append(f"rollout.n {rollout.n}: {algorithm.adv_estimator} compares samples of a prompt, so it needs "
                     "≥ 2 (with 1, every advantage is 0 and nothing is learned)")
    device = config.model.device
    if device != "auto" and executor.computes_on_driver and (problem := _device_problem(device)) is not None:
        # an executor's workers may have the GPUs a driver lacks: they check there
        found.append(f"model.device {device}: {problem}")
    if not rollout.temperature > 0:
        found.append(f"rollout.temperature {rollout.temperature}: training needs sampling (> 0); greedy samples "
                     "of a prompt are all alike (evaluation is greedy already)")
    if reward.overlong_buffer is not None and reward.overlong_buffer > rollout.max_new_tokens:
        found.append(f"reward.overlong_buffer {reward.overlong_buffer} exceeds rollout.max_new_tokens "
                     f"{rollout.max_new_tokens}")
    if "dro_beta" in actor.loss.reads(actor) and actor.loss_options.dro_beta is None:
        found.append(f"actor.policy_loss={actor.policy_loss} needs actor.loss_options.dro_beta (> 0)")
    if not estimator.needs_values and (trainer.critic_warmup or config.critic != CriticConfig()):
        found.append("trainer.critic_warmup and the critic section need a critic: an estimator that reads values "
                     "(algorithm.adv_estimator=gae)")
    if trainer.critic_warmup >= trainer.steps:
        found.append(f"trainer.critic_warmup {trainer.critic_warmup} ≥ trainer.steps {trainer.steps}: the policy "
                     "would never train")
    if reward.batch_timeout < reward.timeout:
        found.append(f"reward.batch_timeout {reward.batch_timeout:g} is shorter than "
                     f"reward.timeout {reward.timeout:g}: no call could use its own deadline")
    if reward.format_bonus and reward.fn != "strict":
        found.append("reward.format_bonus applies to the strict reward: set reward.fn=strict")
    env = config.env
    if env.sft_data and not env.sft_steps:
        found.append("env.sft_data is read by the warm-up: set env.sft_steps (--sft-steps) to its number of steps")
    if (env.sft_prompt_key or env.sft_response_key) and not env.sft_data:
        found.append("env.sft_prompt_key and env.sft_response_key name columns of env.sft_data: give its files too")
    if algorithm.gdpo_weights is not None:
        if not estimator.weighs_components:
            found.append(f"algorithm.gdpo_weights: {algorithm.adv_estimator} does not read them")
        elif len(algorithm.gdpo_weights) != 1 + _uses_reward_model(config):
            found.append(f"algorithm.gdpo_weights has {len(algorithm.gdpo_weights)} weights for "
                         f"{1 + _uses_reward_model(config)} reward components (the rule reward, then the reward model)")
    if estimator.weighs_components and algorithm.use_kl_in_reward:
        found.append(f"{algorithm.adv_estimator} normalises each reward component (rule, model) alone: a KL penalty "
                     "in the reward would be ignored; use actor.kl_loss_coef (a KL loss) instead")
    if algorithm.dynamic_sampling and not estimator.grouped:
        found.append(f"algorithm.dynamic_sampling drops groups whose rewards are all equal: it needs an estimator "
                     f"that compares the samples of a prompt, not {algorithm.adv_estimator}")
    if any(level not in DIFFICULTIES for level in config.data.difficulty):
        found.append(f"data.difficulty levels are {', '.join(map(str, DIFFICULTIES))}, got "
                     f"{list(config.data.difficulty)}")
    found += _path_problems(config)
    found += _executor_problems(config)
    return found


def _device_problem(device: str) -> str | None:
    from purerl.machine import device_problem  # imports torch: a config that names no device is read without it

    return device_problem(device)


def _uses_reward_model(config: JobConfig) -> bool:
    return config.reward.model is not None and config.reward.model_weight != 0


def _path_problems(config: JobConfig) -> list[str]:
    found = []
    model = config.model
    if model.path and model.tiny:
        found.append("model.path and model.tiny exclude each other")
    for key, value in (("model.path", model.path), ("critic.model", config.critic.model),
                       ("reward.model", config.reward.model), ("distill.teacher", config.distill.teacher)):
        if value:
            found += _model_path_problems(key, Path(value), gguf=key != "reward.model")
    distill = config.distill
    if distill.teacher and distill.coef == 0 and distill.loss_coef == 0:
        found.append("distill.teacher is set but distill.coef and distill.loss_coef are both 0: nothing would use it")
    if config.critic.model and model.tiny:
        found.append("critic.model with model.tiny: the tiny policy's critic is its own backbone (leave it unset)")
    data = config.data
    for key, files in (("data.train_files", data.train_files), ("data.eval_files", data.eval_files)):
        for name in files:
            if not Path(name).is_file():
                found.append(f"{key} {name}: no such file")
            elif Path(name).suffix not in (".parquet", ".jsonl", ".json"):
                found.append(f"{key} {name}: unsupported file type (use .parquet or .jsonl)")
    if data.eval_files and not data.train_files:
        found.append("data.eval_files without data.train_files: the procedural problems have their own held-out set")
    return found


def _model_path_problems(key: str, path: Path, gguf: bool = True) -> list[str]:
    if not path.exists():
        return [f"{key} {path}: no such file or folder (give a local HF model folder"
                + (" or a .gguf file" if gguf else "") + "; models are not downloaded)"]
    if path.is_file() and (path.suffix != ".gguf" or not gguf):
        return [f"{key} {path}: a file that is not " + (".gguf (give an HF model folder or a .gguf file)" if gguf
                                                         else "an HF model folder")]
    if path.is_dir() and not (path / "config.json").is_file():
        return [f"{key} {path}: folder without config.json, not an HF model folder"]
    return []


def _executor_problems(config: JobConfig) -> list[str]:
    found = []
    executor = config.executor
    kind, engine = executor.of_kind, ENGINES[config.rollout.engine]
    if not engine.installed():
        found.append(f"rollout.engine={engine.name}: {engine.install_hint}")
    if kind.placements and executor.colocated:
        if config.asynchronous.enable:
            found.append(f"asynchronous training on the Ray executor needs rollout workers apart (executor.placement="
                         f"{executor.placement}: the ranks cannot generate while they train; split, split_collocate "
                         "or standalone)")
        if not engine.colocates:
            found.append(f"rollout.engine={engine.name} runs on rollout workers: executor.placement=split "
                         f"(not {executor.placement})")
    if kind.placements and executor.roles["reference"] != "train" and config.actor.lora_rank:
        found.append(f"executor.placement={executor.placement} puts the reference on a pool of its own, but a LoRA "
                     "policy's reference is its own base (adapters off): it lives with the actor")
    if config.actor.routing_replay:
        if not engine.records_routing:
            able = ", ".join(name for name in ENGINES.names() if ENGINES[name].records_routing)
            found.append(f"actor.routing_replay: rollout.engine={engine.name} does not record the experts it routes "
                         f"each token to (these engines do: {able})")
        if config.env.multi_turn:
            found.append("actor.routing_replay: episodes (env.multi_turn) do not record routing yet")
    generators = config.asynchronous.generators
    if config.asynchronous.interruptible:
        if not engine.interruptible:
            able = ", ".join(name for name in ENGINES.names() if ENGINES[name].interruptible)
            found.append(f"asynchronous.interruptible: rollout.engine={engine.name} cannot stop and continue a row "
                         f"(these engines can: {able})")
        if config.rollout.stop:
            found.append("asynchronous.interruptible with rollout.stop: a stop string could span the point where a "
                         "row is continued")
        if config.env.multi_turn:
            found.append("asynchronous.interruptible: episodes (env.multi_turn) are not continued across weights")
        if not config.asynchronous.enable:
            found.append("asynchronous.interruptible needs asynchronous training (--async)")
    if generators > 1 and not config.asynchronous.enable:
        found.append(f"asynchronous.generators={generators} needs asynchronous training (--async)")
    return found


def cold_start(config: JobConfig, accuracy: float | None, problems: int) -> tuple[JobConfig, str | None]:
    """The config a run trains with after its step-0 held-out greedy ``accuracy`` on ``problems`` problems,
    and the line that says what changed (None: nothing). A task the model cannot solve yet (accuracy under
    ``rollout.cold_below``) is sampled ``rollout.cold_n`` times per prompt where ``rollout.n`` is smaller;
    a ``--tiny`` model (random, for plumbing) and fewer than :data:`COLD_MIN_PROBLEMS` problems keep it."""
    rollout = config.rollout
    if not may_start_cold(config) or accuracy is None or problems < COLD_MIN_PROBLEMS or accuracy >= rollout.cold_below:
        return config, None
    line = (f"rollout.n {rollout.n} -> {rollout.cold_n}: the held-out greedy accuracy at step 0 is {accuracy:.1%}, "
            f"under rollout.cold_below={rollout.cold_below:g}: the model cannot solve this task yet, and groups of "
            f"{rollout.n} would mostly score alike (set rollout.cold_n=0 to keep rollout.n)")
    return attrs.evolve(config, rollout=attrs.evolve(rollout, n=rollout.cold_n)), line


def may_start_cold(config: JobConfig) -> bool:
    """Whether :func:`cold_start` can change ``config`` at all, whatever the step-0 accuracy."""
    return not config.model.tiny and config.rollout.n < config.rollout.cold_n


def cold_start_skipped(config: JobConfig) -> str | None:
    """The line a ``--tiny`` run prints at its start where the start's choice (:func:`cold_start`) would apply
    to a real model and does not to this one (None elsewhere): a user who tries a job tiny first learns the
    rule exists."""
    rollout = config.rollout
    if not config.model.tiny or rollout.n >= rollout.cold_n:
        return None
    return (f"--tiny: the start's choice is off (a real model that scores under rollout.cold_below="
            f"{rollout.cold_below:g} held out at step 0 is sampled in groups of rollout.cold_n={rollout.cold_n}, "
            f"not rollout.n={rollout.n}; a tiny random model always would)")
