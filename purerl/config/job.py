"""The typed configuration of a training job: one frozen tree, each setting in one section.

Sections and what they own::

    model       the policy: HF folder or .gguf (default SmolLM2-135M-Instruct), or a tiny random one
    data        training / held-out prompts, prompts per step
    rollout     the engine and how responses are sampled (a :class:`~purerl.rollout.sampling.SamplingParams`)
    algorithm   advantage estimator and its settings, KL in the reward, off-policy correction, DAPO sampling
    actor       the policy update: optimiser, policy loss and its settings, clipping, aggregation, KL loss, batching
    critic      the value model of PPO (GAE): its weights, optimiser, value clip
    distill     on-policy distillation: the teacher, its advantage and loss term
    reward      rule reward function, learned reward model, their weights, overlong shaping, deadlines
    trainer     steps, evaluation, checkpoints, seed, critic warm-up, logging, samples.jsonl, health mode
    health      when the run-health monitor reports a symptom (cut responses, no signal, a dead reward, …)
    executor    local, or Ray (FSDP2 ranks, rollout and reward workers, timeouts)
    asynchronous  generation overlapping training, its staleness bound
    env         the task's environment: single-turn answers, or multi-turn tool episodes and their limits; the
                supervised warm-up before RL

Each section lives in :mod:`purerl.config.sections` (``executor`` and ``asynchronous`` in
:mod:`purerl.config.execution`, ``env`` in :mod:`purerl.config.environment`); :mod:`purerl.assembly` turns the
tree into the bound settings of the stages, the executor and the loops, and nothing below it names this class.
Each field has one default and one check (single-field bounds as attrs validators); rules across
sections are in :mod:`purerl.config.rules`. Names of registered functions are values: ``algorithm.adv_estimator`` is
any name in :data:`~purerl.algo.estimators.ADVANTAGE_ESTIMATORS`, ``actor.policy_loss`` any name in
:data:`~purerl.algo.policy_loss.POLICY_LOSSES`, so a newly registered estimator or loss is selectable at once; the
settings an estimator or loss reads are fields named like its keyword parameters (``algorithm.gamma``,
``actor.clip_low``, ``actor.loss_options.tau_pos``). Build one with :func:`purerl.config.loading.build` from files
and ``key=value`` overrides.
"""

import attrs

from purerl.config.environment import EnvConfig
from purerl.config.execution import PLACEMENTS, AsyncConfig, ExecutorConfig
from purerl.config.loading import section
from purerl.config.sections import (
    ActorConfig,
    AlgorithmConfig,
    CriticConfig,
    DataConfig,
    DistillConfig,
    HealthConfig,
    KLControlConfig,
    LossOptions,
    ModelConfig,
    RewardConfig,
    RolloutConfig,
    TrainerConfig,
)
from purerl.setting_facts import COUNTERFACTUAL, MAY_CHANGE, facts

__all__ = ["ActorConfig", "AlgorithmConfig", "AsyncConfig", "CriticConfig", "DataConfig", "DistillConfig",
           "EnvConfig", "ExecutorConfig", "HealthConfig", "JobConfig", "KLControlConfig", "LossOptions", "ModelConfig",
           "PLACEMENTS", "RewardConfig", "RolloutConfig", "TrainerConfig"]


@section
class JobConfig:
    """A training job's configuration: one section per field (the module's docstring says what each
    owns; every key: the site's settings reference)."""

    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    rollout: RolloutConfig = RolloutConfig()
    algorithm: AlgorithmConfig = attrs.field(default=AlgorithmConfig(), metadata=facts(replay=COUNTERFACTUAL))
    actor: ActorConfig = attrs.field(default=ActorConfig(), metadata=facts(replay=COUNTERFACTUAL))
    critic: CriticConfig = attrs.field(default=CriticConfig(), metadata=facts(replay=COUNTERFACTUAL))
    distill: DistillConfig = attrs.field(default=DistillConfig(), metadata=facts(replay=COUNTERFACTUAL))
    reward: RewardConfig = RewardConfig()
    trainer: TrainerConfig = TrainerConfig()
    health: HealthConfig = attrs.field(default=HealthConfig(), metadata=facts(resume=MAY_CHANGE))
    executor: ExecutorConfig = attrs.field(default=ExecutorConfig(), metadata=facts(resume=MAY_CHANGE))
    asynchronous: AsyncConfig = AsyncConfig()
    env: EnvConfig = EnvConfig()
