"""A job's models and first state: the policy (float32 masters computing in ``model.dtype``, LoRA
when asked), the critic, a distillation teacher, an LLM judge, the train state at step 0 and the
rollout engine's options."""

from pathlib import Path
from typing import Any

import attrs
import torch

from purerl.assembly.data import decoder_of
from purerl.assembly.stages import actor_optimizer, critic_optimizer, kl_controller_of
from purerl.config.job import JobConfig
from purerl.data.records import DataError
from purerl.models import (
    CausalLM,
    Critic,
    Params,
    cast_floating,
    causal_lm_from_config,
    checkpoint_layers,
    critic_from_causal_lm,
    load_causal_lm,
    smollm2_gguf,
)
from purerl.models.families import FAMILIES, computed_by
from purerl.models.families.moe import has_experts
from purerl.models.gguf_cache import gguf_as_folder
from purerl.models.lora import LoraSpec, apply_lora
from purerl.models.special_ids import special_ids
from purerl.rewards.judge import Judge, JudgeSettings
from purerl.rollout.engine import make_engine
from purerl.state import TrainState
from purerl.step.roles import LocalTeacher
from purerl.tiny import char_tokenizer, tiny_llama_config
from purerl.tree import tree_clone

__all__ = ["compute_dtype", "driver_device", "engine_options", "forwards_line", "initial_state", "load_critic",
           "load_judge", "load_policy", "load_teacher"]


def driver_device(config: JobConfig) -> str:
    """Where this process keeps the weights: ``model.device`` where it computes the model (the local
    executor); else the CPU, and workers take GPUs (Ray's through ``executor.gpus_per_worker``; the driver
    only ships the weights)."""
    return config.model.device if config.executor.of_kind.computes_on_driver else "cpu"


def load_policy(config: JobConfig) -> tuple[CausalLM, Params, Any]:
    """The policy (``model.path``, the default GGUF, or a tiny random one) and its tokenizer: float32
    master weights, computing in ``model.dtype``. A loaded model's console line says what computes
    it (its lean family, or its HF module and why)."""
    if config.model.tiny:
        tokenizer = char_tokenizer()
        context = {"max_position_embeddings": max(256, config.env.max_tokens)} if config.env.multi_turn else {}
        model, params = causal_lm_from_config(tiny_llama_config(vocab_size=len(tokenizer), hidden_size=64, **context),
                                              seed=config.trainer.seed, device=driver_device(config))
        return (*_adapted(config, model, params), tokenizer)
    from transformers import AutoTokenizer

    path = _loadable(Path(config.model.path) if config.model.path else smollm2_gguf())
    if path.suffix == ".gguf":
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    else:
        tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "left"
    model, params = load_causal_lm(path, device=driver_device(config))
    print(computed_by(model), flush=True)
    return (*_adapted(config, model, params), tokenizer)


def _loadable(path: Path) -> Path:
    """A GGUF's converted folder when the cache has or makes one (:mod:`purerl.models.gguf_cache`)."""
    if path.suffix == ".gguf" and (converted := gguf_as_folder(path)) is not None:
        return converted
    return path


def load_teacher(config: JobConfig, model: CausalLM, tokenizer: Any) -> LocalTeacher | None:
    """``distill.teacher`` as a role computed here, frozen in the policy's compute dtype, its
    forwards packed as the policy's are (``actor.packed_forwards``); None without one. A teacher
    with fewer vocabulary rows than the policy's tokenizer has tokens, or whose tokenizer (saved in
    its folder, or in its GGUF file) maps tokens to other ids, raises a one-line ``DataError``; rows
    beyond the policy's are padding (one family's sizes differ in it), and its scores leave them out."""
    if not config.distill.teacher:
        return None
    path = _loadable(Path(config.distill.teacher))
    teacher, params = load_causal_lm(path, device=driver_device(config))
    where = f"distill.teacher {config.distill.teacher}"
    tokens = len(tokenizer) if hasattr(tokenizer, "__len__") else model.config.vocab_size
    if teacher.config.vocab_size < tokens:  # more rows than tokens is padding, which nothing samples
        raise DataError(f"{where}: vocabulary of {teacher.config.vocab_size} tokens, fewer than the policy's "
                        f"tokenizer's {tokens}: a teacher must share the policy's tokenizer")
    theirs = _tokenizer_vocab(path)
    if theirs is not None and hasattr(tokenizer, "get_vocab") and theirs != tokenizer.get_vocab():
        differ = sorted(set(theirs.items()) ^ set(tokenizer.get_vocab().items()))[:1]
        raise DataError(f"{where}: its tokenizer maps tokens to other ids than the policy's (e.g. {differ[0]!r}): "
                        "a teacher must share the policy's tokenizer")
    teacher = attrs.evolve(teacher, compute_dtype=compute_dtype(config), packed=config.actor.packed_forwards)
    vocab = model.config.vocab_size if teacher.config.vocab_size > model.config.vocab_size else None
    return LocalTeacher(teacher, cast_floating(params, compute_dtype(config)), vocab)


def load_judge(config: JobConfig) -> Judge | None:
    """``reward.judge``: the judge model behind an embedded engine of its own, frozen, greedy,
    on the driver's device; None without one. A folder without a tokenizer (or one without a
    chat template, or with more tokens than the model) is a one-line ``DataError``."""
    reward = config.reward
    if not reward.judge:
        return None
    from transformers import AutoTokenizer

    path, where = _loadable(Path(reward.judge)), f"reward.judge {reward.judge}"
    try:
        tokenizer = (AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name) if path.suffix == ".gguf"
                     else AutoTokenizer.from_pretrained(path))
    except (OSError, ValueError) as err:
        raise DataError(f"{where}: no tokenizer to render the judge's prompt ({type(err).__name__}: "
                        f"{str(err).splitlines()[0]})") from None
    if getattr(tokenizer, "chat_template", None) is None:
        raise DataError(f"{where}: its tokenizer has no chat template to render the judge's prompt")
    tokenizer.padding_side = "left"
    model, params = load_causal_lm(path, device=driver_device(config))
    if len(tokenizer) > model.config.vocab_size:
        raise DataError(f"{where}: its tokenizer has {len(tokenizer)} tokens, its model {model.config.vocab_size}")
    engine = make_engine("torch", model, **engine_options(config, model, tokenizer))
    engine.sync(cast_floating(params, compute_dtype(config)) if compute_dtype(config) else params, 0)
    settings = JudgeSettings(reward.judge_prompt, reward.judge_pattern, reward.judge_low, reward.judge_high,
                             reward.judge_max_new_tokens, reward.judge_timeout, reward.penalty)
    try:
        return Judge(engine, tokenizer, settings, name=where)
    except ValueError as err:
        raise DataError(str(err)) from None


def _tokenizer_vocab(path: Path) -> dict[str, int] | None:
    """The token → id map of the tokenizer saved with the model at ``path`` (a GGUF file carries its
    own); None when it has none."""
    from transformers import AutoTokenizer

    if path.suffix == ".gguf":
        return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name).get_vocab()
    names = ("tokenizer.json", "tokenizer_config.json")
    if not any((path / name).is_file() for name in names):
        return None
    return AutoTokenizer.from_pretrained(path).get_vocab()


def compute_dtype(config: JobConfig) -> torch.dtype | None:
    """The dtype the forwards compute in when it is not the float32 of the master weights."""
    return None if config.model.dtype == "float32" else getattr(torch, config.model.dtype)


def _adapted(config: JobConfig, model: CausalLM, params: Params) -> tuple[CausalLM, Params]:
    """``model`` computing in ``model.dtype`` (mixed precision: the float32 ``params`` stay the
    masters); with ``actor.packed_forwards``, its training forwards packed; with
    ``actor.lora_rank``, the LoRA policy on that base (held in the compute dtype: it is never
    updated) and its float32 adapters."""
    actor = config.actor
    if actor.routing_replay and not (model.lean and has_experts(model.config)):
        raise DataError(f"actor.routing_replay: {computed_by(model)}; routing replay needs a mixture-of-experts "
                        "model computed by a lean family (qwen3_moe)")
    model = attrs.evolve(model, packed=actor.packed_forwards, compute_dtype=compute_dtype(config),
                         compiled=actor.compile, routing_replay=actor.routing_replay,
                         fused_head=actor.fused_head)
    if actor.lora_rank:
        try:
            model, params = apply_lora(model, params, LoraSpec(actor.lora_rank, actor.lora_alpha,
                                                               tuple(actor.lora_targets)), seed=config.trainer.seed)
        except ValueError as err:
            raise DataError(f"actor.lora_targets: {err}") from None
        model = attrs.evolve(model, frozen=cast_floating(model.frozen, model.compute_dtype))
    return _checkpointed(config, model), params


def _checkpointed(config: JobConfig, model: Any) -> Any:
    """``model`` (a causal LM or a critic) with its layers' activations checkpointed where
    ``actor.activation_checkpointing`` says: a lean forward's own (``checkpointed``), an HF module's by
    wrapping its layers (:func:`~purerl.models.checkpointing.checkpoint_layers`)."""
    if not config.actor.activation_checkpointing or model.checkpointed:
        return model
    if not model.lean:
        checkpoint_layers(model.module, rebind=True)
    return attrs.evolve(model, checkpointed=True)


def load_critic(config: JobConfig, model: CausalLM, params: Params) -> tuple[Critic | None, Params | None]:
    """The value model when the estimator reads values: a zero value head on a copy of the policy's
    backbone (a LoRA policy's base), or on the base of ``critic.model``, packed with
    ``actor.packed_forwards``; (None, None) otherwise."""
    if not config.algorithm.estimator.needs_values:
        return None, None
    params = params if model.lora is None else model.frozen
    if config.critic.model:
        policy_vocab = model.config.vocab_size
        model, params = load_causal_lm(Path(config.critic.model), device=driver_device(config))
        if model.config.vocab_size < policy_vocab:
            raise DataError(f"critic.model {config.critic.model}: vocabulary of {model.config.vocab_size} tokens, "
                            f"smaller than the policy's {policy_vocab}: it cannot read the policy's token ids")
    critic, critic_params = critic_from_causal_lm(model, params)
    critic_params = {k: v.float() for k, v in critic_params.items()}  # masters (a LoRA base is held narrower)
    critic = attrs.evolve(critic, packed=config.actor.packed_forwards, compute_dtype=compute_dtype(config))
    return _checkpointed(config, critic), critic_params


def forwards_line(config: JobConfig, model: CausalLM, critic: Critic | None) -> str:
    """The line a run starts with that says what computes each role's forwards, on which executor: a lean
    family's forward (on a sharding executor's ranks over sharded params, gathered layer by layer; its LM head
    fused with the scores read from it, :mod:`purerl.models.scores`), or the HF module, whose logits are held
    whole (FSDP2-sharded there)."""
    kind = config.executor.of_kind
    ranks = config.executor.train_ranks if kind.shards_updates else 1

    def by(lean: bool, family_name: str | None) -> str:
        if not lean:
            return "its HF module, its logits held whole" + (f" (FSDP2-sharded over {ranks} ranks)" if ranks > 1
                                                            else "")
        return f"the lean family {family_name!r}" + (f" (params sharded over {ranks} ranks, gathered per layer)"
                                                     if ranks > 1 else "")

    def name(family: Any) -> str | None:
        return next((n for n in FAMILIES.names() if FAMILIES[n] is family), None)

    reference = config.actor.kl_loss_coef > 0 or config.algorithm.use_kl_in_reward
    roles = [f"policy{' and reference' if reference else ''}: {by(model.lean, name(model.family))}"]
    if critic is not None:
        roles.append(f"critic: {by(critic.lean, name(critic.family))} with a value head")
    checkpointed = ", activation checkpointing" if model.checkpointed else ""
    return f"forwards on the {kind.name} executor{checkpointed}: " + "; ".join(roles)


def initial_state(config: JobConfig, params: Params, critic_params: Params | None = None) -> TrainState:
    """Step 0: the policy and its optimizer state, a frozen reference copy when a KL term reads it
    (with LoRA, ``{}``: the base itself, no copy), the critic and its optimizer state when there is
    one, the KL controller, RNG and data cursor."""
    reference = None
    if config.actor.kl_loss_coef > 0 or config.algorithm.use_kl_in_reward:  # frozen: kept as it computes
        reference = {} if config.actor.lora_rank else tree_clone(cast_floating(params, compute_dtype(config)))
    state = TrainState.initial(params, actor_optimizer(config), kl_controller_of(config), seed=config.trainer.seed,
                               reference=reference)
    if critic_params is not None:
        state = attrs.evolve(state, critic=critic_params, critic_opt=critic_optimizer(config).init(critic_params))
    return state


def engine_options(config: JobConfig, model: CausalLM, tokenizer: Any) -> dict[str, Any]:
    """The rollout engine's keyword arguments: end-of-sequence and padding ids, ``decode``, and
    ``rollout.engine_options``."""
    ids = special_ids(model.config, tokenizer)
    return dict(eos_token_ids=list(ids.eos), pad_token_id=ids.pad, decode=decoder_of(tokenizer),
                **config.rollout.engine_options)
