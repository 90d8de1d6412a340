"""The assembly: a job's config as the bound settings of its stages (settings bound once)."""

import pickle

import pytest
import torch

from purerl.algo import ADVANTAGE_ESTIMATORS, POLICY_LOSSES, AdvantageSettings, LossOptions, PolicyLossSettings
from purerl.algo.aggregation import SumCount
from purerl.algo.policy_loss import (
    cispo_policy_loss,
    geo_mean_policy_loss,
    gpg_policy_loss,
    sapo_policy_loss,
    vanilla_policy_loss,
)
from purerl.assembly.stages import (
    actor_loss_of,
    critic_batching_of,
    learning_rate_schedule,
    shaping_of,
    stage_settings_of,
    updates_per_step,
)
from purerl.checks import SettingError
from purerl.config.job import ActorConfig, AlgorithmConfig, CriticConfig, DataConfig, JobConfig, TrainerConfig
from purerl.config.rules import resolve
from purerl.optim import warmup_cosine_schedule


@pytest.mark.parametrize("estimator", ["grpo", "gae", "rloo", "remax", "optimal_token_baseline"])
def test_every_stage_setting_pickles_and_comes_back_equal(estimator):
    """A Ray rank gets the step's settings by pickle: each record (the estimator's and the loss's
    too) must come back equal, whatever the registry's decorator did to the module's names."""
    settings = stage_settings_of(JobConfig(algorithm=AlgorithmConfig(adv_estimator=estimator)))
    assert pickle.loads(pickle.dumps(settings)) == settings


def test_a_loss_bound_to_the_actor_section_computes_what_its_function_computes_with_those_settings():
    g = torch.Generator().manual_seed(0)
    logp, old, adv = (torch.randn(3, 5, generator=g) for _ in range(3))
    mask = torch.rand(3, 5, generator=g) > 0.3
    plain = {"vanilla": lambda: vanilla_policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.3, clip_c=3.0,
                                                    loss_agg="seq-mean-token-mean", loss_norm=None),
             "cispo": lambda: cispo_policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.3,
                                                loss_agg="seq-mean-token-mean", loss_norm=None),
             "sapo": lambda: sapo_policy_loss(logp, old, adv, mask, tau_pos=2.0, tau_neg=1.05),
             "geo_mean": lambda: geo_mean_policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.3),
             "gpg": lambda: gpg_policy_loss(logp, old, adv, mask, loss_agg="seq-mean-token-mean", loss_norm=None)}
    for name, want in plain.items():
        actor = ActorConfig(policy_loss=name, clip_high=0.3, loss_agg="seq-mean-token-mean",
                            loss_options=LossOptions(tau_pos=2.0))
        got, want = actor.loss.bound(actor)(logp, old, adv, mask), want()
        assert torch.equal(got.loss.total, want.loss.total) and torch.equal(got.loss.count, want.loss.count), name


def test_a_script_binds_a_loss_or_an_estimator_to_records_of_its_own():
    loss = POLICY_LOSSES["cispo"].bound(PolicyLossSettings(clip_low=1.0))
    assert loss.kwargs == {"clip_low": 1.0, "clip_high": 0.28, "loss_agg": "token-mean", "loss_norm": None}
    sapo = POLICY_LOSSES["sapo"].bound(PolicyLossSettings(loss_options=LossOptions(tau_pos=2.0)))
    assert sapo.kwargs == {"tau_pos": 2.0, "tau_neg": 1.05} and sapo.aggregation == "seq-mean-token-mean"
    assert ADVANTAGE_ESTIMATORS["gae"].bound(AdvantageSettings(lam=0.9)).settings.lam == 0.9
    with pytest.raises(SettingError, match="clip_low"):
        PolicyLossSettings(clip_low=-1.0)  # checked as the config checks it
    with pytest.raises(SettingError, match="lam"):
        AdvantageSettings(lam=2.0)


def test_every_loss_reads_only_settings_its_function_takes():
    """A reader naming a keyword its function lacks fails here, not at a user's assembly."""
    import inspect

    for name in POLICY_LOSSES.names():
        loss = POLICY_LOSSES[name]
        params = inspect.signature(loss.fn).parameters
        keywords = {n for n, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY} - {"is_weights",
                                                                                                  "generator"}
        assert set(loss.reads(PolicyLossSettings())) == keywords, name


def test_the_critics_token_budget_is_resolved_once_from_the_actors():
    config = JobConfig(algorithm=AlgorithmConfig(adv_estimator="gae"), actor=ActorConfig(max_tokens_per_micro_batch=64))
    assert resolve(config).critic.max_tokens_per_micro_batch == 64
    assert resolve(resolve(config)) == resolve(config)
    assert critic_batching_of(config).max_tokens == 64
    own = JobConfig(algorithm=AlgorithmConfig(adv_estimator="gae"), actor=ActorConfig(max_tokens_per_micro_batch=64),
                    critic=CriticConfig(max_tokens_per_micro_batch=32))
    assert critic_batching_of(own).max_tokens == 32
    assert resolve(JobConfig(actor=ActorConfig(max_tokens_per_micro_batch=64))).critic == CriticConfig()  # no critic


def test_the_settings_follow_the_config():
    config = JobConfig(algorithm=AlgorithmConfig(adv_estimator="rloo", use_kl_in_reward=True, kl_penalty="mse"),
                       actor=ActorConfig(policy_loss="gspo", clip_high=0.4, entropy_coeff=0.01))
    shaping, loss = shaping_of(config), actor_loss_of(config)
    assert shaping.estimator.name == "rloo" and shaping.kl_penalty == "mse" and shaping.correction == "none"
    assert loss.policy_loss.name == "gspo" and loss.policy_loss.settings.clip_high == 0.4
    assert loss.entropy_coeff == 0.01
    assert shaping_of(JobConfig()).kl_penalty is None


def test_the_learning_rate_schedule_spans_the_run_in_trainer_steps_whatever_the_mini_batches():
    """32 rows a step in mini-batches of 12 over 2 epochs: 6 updates a step, so the warm-up ends and the
    cosine reaches its floor at the trainer steps the config names, not 6 times sooner."""
    config = JobConfig(data=DataConfig(prompts_per_step=8), actor=ActorConfig(lr=1e-3, warmup_steps=2,
                       mini_batch_rows=12, ppo_epochs=2), trainer=TrainerConfig(steps=10))
    assert updates_per_step(config) == 6 and updates_per_step(JobConfig()) == 1
    lr = learning_rate_schedule(1e-3, 2, config)
    at = lambda update: float(lr(torch.tensor(float(update))))  # noqa: E731
    assert at(6) == pytest.approx(0.5e-3) and at(12) == pytest.approx(1e-3)  # warm-up over 2 trainer steps
    assert at(59) > at(60) == pytest.approx(1e-4)  # the floor at step 10's end, lr × min_lr_ratio
    plain = JobConfig(trainer=TrainerConfig(steps=10), actor=ActorConfig(warmup_steps=2))
    one, reference = learning_rate_schedule(2e-5, 2, plain), warmup_cosine_schedule(2e-5, 2, 10, final_lr=2e-5 * 0.1)
    assert [float(one(torch.tensor(float(s)))) for s in range(12)] == [  # one update a step: as before
        float(reference(torch.tensor(float(s)))) for s in range(12)]


@pytest.mark.slow  # the tiny model's first build imports transformers (~2 s)
def test_executors_take_the_runs_roles_as_one_record_built_by_the_assembly(tiny_lm):
    """Each executor's constructor stays small (the roles come as one record); a bare policy stands
    for a run with no other role; the assembly's roles carry the config's reward model and canary."""
    import inspect

    from purerl.assembly.executor import roles_of
    from purerl.config.loading import build
    from purerl.executors.base import Roles
    from purerl.executors.local import LocalExecutor
    from purerl.executors.ray.executor import RayExecutor
    from purerl.rollout.backends.torch import TorchEngine

    assert all(len(inspect.signature(cls.__init__).parameters) - 1 <= 5 for cls in (LocalExecutor, RayExecutor))
    model, _ = tiny_lm()
    bare = LocalExecutor(lambda *a, **k: None, model, TorchEngine(model, eos_token_ids=[1], pad_token_id=0))
    assert bare.effects == {"policy": model, "value_and_grad": bare.effects["value_and_grad"]}
    assert bare.broken == frozenset() and bare.worker_pids() == {}
    roles = roles_of(resolve(build(JobConfig, {})), model, None, None)
    assert roles.policy is model and roles.canary is not None and roles.reward_model is None
    off = roles_of(resolve(build(JobConfig, {"executor": {"sync_canary": False}})), model, None, None)
    assert off.canary is None and Roles.of(off) is off and Roles.of(model).canary is None


@pytest.mark.parametrize("lora", [0, 4], ids=["full", "LoRA"])
def test_activation_checkpointing_reaches_the_policy_and_the_critic_which_compute_what_they_did(lora):
    """``actor.activation_checkpointing`` makes the policy's and the critic's lean forwards recompute their layers
    in the backward; the values and the gradients are those of the forwards that keep their activations."""
    import attrs

    from purerl.assembly.models import load_critic, load_policy
    from purerl.config.loading import build
    from purerl.models import response_logprobs, response_values, value_and_grad
    from purerl.tiny import random_sequences

    config = resolve(build(JobConfig, {"model": {"tiny": True}, "algorithm": {"adv_estimator": "gae"},
                                       "actor": {"activation_checkpointing": True, "lora_rank": lora}}))
    model, params, _ = load_policy(config)
    critic, critic_params = load_critic(config, model, params)
    assert model.checkpointed and model.lean and critic.checkpointed and critic.lean
    seqs = random_sequences(4, 5, 6, model.config.vocab_size, seed=2)

    def total(fn):
        return lambda p, s: (lambda x: (SumCount(x[s.response_mask].sum(), torch.ones(())), None))(fn(p, s))

    for forward, of, tree in ((response_logprobs, model, params), (response_values, critic, critic_params)):
        got = value_and_grad(total(lambda p, s, of=of, forward=forward: forward(of, p, s)))(tree, seqs)
        plain = attrs.evolve(of, checkpointed=False)
        want = value_and_grad(total(lambda p, s, of=plain, forward=forward: forward(of, p, s)))(tree, seqs)
        assert torch.equal(got[0].total, want[0].total)
        assert all(torch.equal(got[2][k], want[2][k]) for k in tree)
