"""The assembly: a job's config as the bound settings of its stages (settings bound once)."""

import pickle

import pytest
import torch

from purerl.algo.policy_loss import POLICY_LOSSES
from purerl.assembly.stages import (
    actor_loss_of,
    advantage_estimator,
    critic_batching_of,
    policy_loss,
    shaping_of,
    stage_settings_of,
)
from purerl.checks import SettingError
from purerl.config.job import ActorConfig, AlgorithmConfig, CriticConfig, JobConfig, LossOptions
from purerl.config.rules import resolve


@pytest.mark.parametrize("estimator", ["grpo", "gae", "rloo", "remax", "optimal_token_baseline"])
def test_every_stage_setting_pickles_and_comes_back_equal(estimator):
    """A Ray rank gets the step's settings by pickle: each record (the estimator's and the loss's
    too) must come back equal, whatever the registry's decorator did to the module's names."""
    settings = stage_settings_of(JobConfig(algorithm=AlgorithmConfig(adv_estimator=estimator)))
    assert pickle.loads(pickle.dumps(settings)) == settings


def test_a_bound_loss_computes_what_the_loss_computes_with_the_sections():
    g = torch.Generator().manual_seed(0)
    logp, old, adv = (torch.randn(3, 5, generator=g) for _ in range(3))
    mask = torch.rand(3, 5, generator=g) > 0.3
    for name in ("vanilla", "cispo", "sapo", "geo_mean", "gpg"):
        actor = ActorConfig(policy_loss=name, clip_high=0.3, loss_agg="seq-mean-token-mean")
        bound = actor.loss.bound(actor, actor.loss_options)
        want = POLICY_LOSSES[name](logp, old, adv, mask, actor, actor.loss_options)
        got = bound(logp, old, adv, mask)
        assert torch.equal(got.loss.total, want.loss.total) and torch.equal(got.loss.count, want.loss.count), name


def test_a_script_binds_a_loss_or_an_estimator_with_the_sections_defaults_for_the_rest():
    loss = policy_loss("cispo", clip_low=1.0)
    defaults = ActorConfig()
    assert dict(loss.settings) == {"clip_low": 1.0, "clip_high": defaults.clip_high}
    assert (loss.loss_agg, loss.loss_norm) == (defaults.loss_agg, defaults.loss_norm)
    assert dict(policy_loss("sapo", tau_pos=2.0).settings) == {"tau_pos": 2.0, "tau_neg": LossOptions().tau_neg}
    assert dict(advantage_estimator("gae", lam=0.9).settings) == {"gamma": 1.0, "lam": 0.9}
    with pytest.raises(ValueError, match="policy loss 'cispo' has no settings tau_pos"):
        policy_loss("cispo", tau_pos=2.0)
    with pytest.raises(ValueError, match="advantage estimator 'rloo' has no settings flavour"):
        advantage_estimator("rloo", flavour=1)
    with pytest.raises(SettingError, match="clip_low"):
        policy_loss("vanilla", clip_low=-1.0)  # checked as the config checks it


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
    assert loss.policy_loss.name == "gspo" and dict(loss.policy_loss.settings)["clip_high"] == 0.4
    assert loss.entropy_coeff == 0.01 and loss.temperature == config.rollout.temperature
    assert shaping_of(JobConfig()).kl_penalty is None
