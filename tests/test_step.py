"""Composed GRPO and PPO steps on a tiny random model: on-policy invariants and short loops."""

import math

import pytest
import torch

from purerl.algo.estimators import ADVANTAGE_ESTIMATORS
from purerl.algo.kl_control import make_kl_controller
from purerl.algo.policy_loss import POLICY_LOSSES
from purerl.assembly.stages import experience_settings_of, shaping_of, stage_settings_of
from purerl.models import critic_from_causal_lm, response_logits
from purerl.optim import adamw, chain, clip_by_global_norm
from purerl.rollout.backends.torch import TorchEngine
from purerl.rollout.sampling import SamplingParams
from purerl.state import RngState, TrainState
from purerl.step import (
    grpo_step,
    make_experience,
    ppo_step,
    shape_rewards,
    token_level_scores,
)
from purerl.tiny import tiny_causal_lm, tiny_llama_config
from purerl.tree import tree_clone, tree_equal
from tests.jobs import step_config

CONFIG = tiny_llama_config()
PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]


def _setup(critic=False, kl=0.0):
    model, params = tiny_causal_lm(CONFIG, seed=0)
    optimizer = chain(clip_by_global_norm(1.0), adamw(1e-3, weight_decay=0.0))
    kl_controller = make_kl_controller("fixed", coef=0.001)
    state = TrainState(policy=params, policy_opt=optimizer.init(params), kl=kl_controller.init(),
                       rng=RngState(0), reference=tree_clone(params))
    value_model = None
    if critic:
        value_model, cparams = critic_from_causal_lm(model, params)
        state = TrainState(policy=params, policy_opt=optimizer.init(params), kl=kl_controller.init(),
                           rng=RngState(0), reference=tree_clone(params), critic=cparams,
                           critic_opt=optimizer.init(cparams))
    engine = TorchEngine(model, eos_token_ids=[1], pad_token_id=0)
    return model, optimizer, kl_controller, state, engine, value_model


def _scores(rollout):
    # a reward that prefers even token ids: learnable, varies within groups
    responses = rollout.sequences.responses()
    mask = rollout.sequences.response_mask
    return ((responses % 2 == 0) & mask).float().sum(-1) / mask.sum(-1).clamp_min(1)


def test_token_level_scores_sit_on_the_last_valid_token():
    mask = torch.tensor([[True, True, False], [True, False, True], [False, False, False]])
    out = token_level_scores(torch.tensor([1.0, 2.0, 3.0]), mask)
    assert out.tolist() == [[0.0, 1.0, 0.0], [0.0, 0.0, 2.0], [0.0, 0.0, 0.0]]


def test_first_on_policy_minibatch_has_ratio_one_no_clipping_and_zero_reference_kl():
    model, optimizer, kl_controller, state, engine, _ = _setup()
    engine.sync(state.policy, 0)
    rollout = engine.generate(PROMPTS, SamplingParams(max_new_tokens=8, n=4, temperature=1.0), RngState(1))
    config = step_config(kl_loss_coef=0.1, micro_batch_rows=5, recompute_old_logprobs=True)
    experience = make_experience(state, rollout, _scores(rollout), policy=model,
                                 settings=experience_settings_of(config))
    mask = rollout.sequences.response_mask
    # behaviour (engine) log-probs equal the trainer's, and the reference equals the policy at step 0
    torch.testing.assert_close(experience.old_logprobs[mask], rollout.behaviour_logprobs[mask], rtol=0, atol=1e-4)
    assert torch.equal(experience.ref_logprobs, experience.old_logprobs)
    _, metrics = grpo_step(state, rollout, _scores(rollout), policy=model, optimizer=optimizer,
                           kl_controller=kl_controller, **stage_settings_of(config))
    assert metrics["actor/ppo_kl"] == pytest.approx(0.0, abs=1e-6)
    assert metrics["actor/pg_clipfrac"] == 0.0
    assert metrics["actor/kl_loss"] == pytest.approx(0.0, abs=1e-7)
    assert metrics["rollout/logprob_gap_max"] < 1e-4


def _loop(step, config, steps=3):
    model, optimizer, kl_controller, state, engine, critic = _setup(critic=step is ppo_step)
    history = []
    for i in range(steps):
        engine.sync(state.policy, state.step)
        rollout = engine.generate(PROMPTS, SamplingParams(max_new_tokens=8, n=4, temperature=1.0), state.rng,
                                  version=state.step)
        kwargs = dict(policy=model, optimizer=optimizer, kl_controller=kl_controller, **stage_settings_of(config))
        if step is ppo_step:
            kwargs.update(critic=critic, critic_optimizer=optimizer)
        before = tree_clone(state.policy)
        state, metrics = step(state, rollout, _scores(rollout), **kwargs)
        assert not tree_equal(before, state.policy), "the policy did not change"
        assert state.step == i + 1
        history.append(metrics)
    return state, history


def test_grpo_loop_runs_three_steps():
    state, history = _loop(grpo_step, config=step_config(micro_batch_rows=4, mini_batch_rows=6, ppo_epochs=2))
    assert all(h["actor/rejected_updates"] == 0 for h in history)
    assert all(h["actor/grad_norm"] > 0 for h in history)


def test_ppo_loop_runs_three_steps_and_trains_the_critic():
    state, history = _loop(ppo_step, config=step_config(adv_estimator="gae", micro_batch_rows=6, gamma=1.0, lam=0.95))
    assert all("critic/vf_loss" in h and h["critic/grad_norm"] > 0 for h in history)
    assert state.critic is not None


def test_a_non_finite_loss_rejects_the_update_and_leaves_params_unchanged():
    model, optimizer, kl_controller, state, engine, _ = _setup()
    engine.sync(state.policy, 0)
    rollout = engine.generate(PROMPTS, SamplingParams(max_new_tokens=6, n=4, temperature=1.0), RngState(1))
    scores = _scores(rollout)
    # an overflowing weight: every forward gives NaN logits, so the loss is NaN
    poisoned = dict(state.policy)
    poisoned["model.norm.weight"] = torch.full_like(poisoned["model.norm.weight"], float("inf"))
    state = TrainState(policy=poisoned, policy_opt=state.policy_opt, kl=state.kl, rng=state.rng)
    before, opt_before = tree_clone(state.policy), tree_clone(state.policy_opt)
    new_state, metrics = grpo_step(state, rollout, scores, policy=model, optimizer=optimizer,
                                   kl_controller=kl_controller, **stage_settings_of(step_config()))
    assert metrics["actor/rejected_updates"] == 1
    assert tree_equal(new_state.policy, before) and tree_equal(new_state.policy_opt, opt_before)


@pytest.mark.parametrize("zero_groups", [(0,), (0, 1, 2)], ids=["one group", "every group"])
def test_rows_with_zero_advantage_skip_the_update_without_changing_it(zero_groups):
    # groups whose samples all score alike have zero GRPO advantages: leaving them out of
    # forward and backward must give the same params and optimizer state (two mini-batches, so
    # the second update starts from Adam moments the first one left)
    model, optimizer, kl_controller, state, engine, _ = _setup()
    engine.sync(state.policy, 0)
    rollout = engine.generate(PROMPTS, SamplingParams(max_new_tokens=8, n=4, temperature=1.0), RngState(1))
    scores = _scores(rollout)
    for g in zero_groups:
        scores[rollout.group == g] = 0.5
    results = []
    for skip in (True, False):
        config = step_config(micro_batch_rows=3, mini_batch_rows=6, compute_entropy=False,
                            skip_zero_advantage_rows=skip)
        new_state, metrics = grpo_step(tree_clone(state), rollout, scores, policy=model, optimizer=optimizer,
                                       kl_controller=kl_controller, **stage_settings_of(config))
        results.append((new_state, metrics))
    (skipped, m_skip), (full, m_full) = results
    experience = make_experience(state, rollout, scores, policy=model, settings=experience_settings_of(step_config()))
    advantages = shape_rewards(experience, state.kl, kl_controller, shaping=shaping_of(step_config()))[0].advantages
    zero_rows = (advantages == 0).all(-1)
    assert zero_rows.any()
    # with nothing else to forward, the first mini-batch still forwards one row: the weight-sync check
    forced = int(bool(zero_rows.all()))  # (one group: 4 zero rows never fill a 6-row mini-batch)
    assert m_skip["actor/skipped_rows_frac"] == pytest.approx((float(zero_rows.sum()) - forced) / len(zero_rows))
    assert ("actor/sync_gap" in m_skip) and m_skip["actor/sync_gap"] < 1e-4
    assert "actor/skipped_rows_frac" not in m_full
    for a, b in ((skipped.policy, full.policy), (skipped.policy_opt, full.policy_opt)):
        for x, y in zip(torch.utils._pytree.tree_leaves(a), torch.utils._pytree.tree_leaves(b)):
            torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-6)  # lr 1e-3: a wrong update is ~1e-3 off
    # every row skipped: the optimizer still takes its steps (Adam's moments and count move on)
    assert skipped.policy_opt[1].count.item() == full.policy_opt[1].count.item() == 2
    if not zero_rows.all():
        assert m_skip["actor/grad_norm"] == pytest.approx(m_full["actor/grad_norm"], rel=1e-5)


def test_an_entropy_bonus_keeps_zero_advantage_rows_in_the_update():
    model, optimizer, kl_controller, state, engine, _ = _setup()
    engine.sync(state.policy, 0)
    rollout = engine.generate(PROMPTS, SamplingParams(max_new_tokens=8, n=4, temperature=1.0), RngState(1))
    scores = torch.full((len(rollout.group),), 0.5)
    _, metrics = grpo_step(state, rollout, scores, policy=model, optimizer=optimizer, kl_controller=kl_controller,
                           **stage_settings_of(step_config(entropy_coeff=1e-3)))
    assert "actor/skipped_rows_frac" not in metrics and metrics["actor/grad_norm"] > 0


@pytest.mark.parametrize("mode", ["token-tis", "seq-tis"])
def test_a_behaviour_policy_half_as_likely_doubles_the_loss_and_its_gradient(mode):
    """Decoupled PPO: the rollout sampled by a policy whose probabilities are half the proximal
    ones gets importance weight 2 on every token (per token, or as a one-token sequence ratio)."""
    import math

    import attrs

    from purerl.models import response_logprobs

    model, optimizer, kl_controller, state, engine, _ = _setup()
    engine.sync(state.policy, 0)
    rollout = engine.generate(PROMPTS, SamplingParams(max_new_tokens=1, n=4, temperature=1.0), RngState(1))
    mask = rollout.sequences.response_mask
    old = response_logprobs(model, state.policy, rollout.sequences)
    stale = attrs.evolve(rollout, behaviour_logprobs=torch.where(mask, old - math.log(2.0), 0.0))
    metrics = {}
    # the proximal log-probs recomputed by the trainer, the behaviour ones the stale rollout's
    configs = {"plain": step_config(recompute_old_logprobs=True),
               mode: step_config(rollout_correction=mode, correction_cap=4.0, recompute_old_logprobs=True)}
    for name, config in configs.items():
        fresh = TrainState(policy=tree_clone(state.policy), policy_opt=optimizer.init(state.policy),
                           kl=kl_controller.init(), rng=RngState(0))
        _, metrics[name] = grpo_step(fresh, stale, _scores(rollout), policy=model, optimizer=optimizer,
                                     kl_controller=kl_controller, **stage_settings_of(config))
    assert metrics[mode]["rollout_corr/is_weight"] == pytest.approx(2.0, rel=1e-6)
    assert metrics[mode]["rollout_corr/is_changed_frac"] == 0.0
    assert metrics[mode]["actor/pg_loss"] == pytest.approx(2 * metrics["plain"]["actor/pg_loss"], rel=1e-5)
    assert metrics[mode]["actor/grad_norm"] == pytest.approx(2 * metrics["plain"]["actor/grad_norm"], rel=1e-5)
    assert "rollout_corr/is_weight" not in metrics["plain"]
    with pytest.raises(ValueError, match="rollout_correction: unknown rollout correction 'tis'"):
        step_config(rollout_correction="tis")


def test_critic_warmup_trains_the_critic_alone():
    model, optimizer, kl_controller, state, engine, critic = _setup(critic=True)
    engine.sync(state.policy, 0)
    rollout = engine.generate(PROMPTS, SamplingParams(max_new_tokens=8, n=4, temperature=1.0), RngState(1))
    config = step_config(adv_estimator="gae", micro_batch_rows=6, lam=0.95, critic_warmup=1)
    policy_before, critic_before = tree_clone(state.policy), tree_clone(state.critic)
    step = dict(policy=model, critic=critic, optimizer=optimizer, critic_optimizer=optimizer,
                kl_controller=kl_controller, **stage_settings_of(config))
    state, metrics = ppo_step(state, rollout, _scores(rollout), **step)
    assert tree_equal(state.policy, policy_before) and not tree_equal(state.critic, critic_before)
    assert metrics["actor/critic_warmup"] == 1.0 and "critic/vf_loss" in metrics
    state, metrics = ppo_step(state, rollout, _scores(rollout), **step)  # step 1: past the warm-up
    assert not tree_equal(state.policy, policy_before) and "actor/pg_loss" in metrics


def test_remax_reads_the_greedy_baselines_and_gdpo_the_reward_components():
    from purerl.batch import Rewards

    model, optimizer, kl_controller, state, engine, _ = _setup()
    engine.sync(state.policy, 0)
    rollout = engine.generate(PROMPTS, SamplingParams(max_new_tokens=8, n=4, temperature=1.0), RngState(1))
    scores = _scores(rollout)
    remax = step_config(adv_estimator="remax")
    bare = make_experience(state, rollout, scores, policy=model, settings=experience_settings_of(remax))
    with pytest.raises(ValueError, match="reward_baselines"):
        shape_rewards(bare, state.kl, kl_controller, shaping=shaping_of(remax))
    experience = make_experience(state, rollout, Rewards(scores, baselines=scores), policy=model,
                                 settings=experience_settings_of(remax))
    batch, _, _ = shape_rewards(experience, state.kl, kl_controller, shaping=shaping_of(remax))
    assert torch.equal(batch.advantages, torch.zeros_like(batch.advantages))  # the baseline is the score itself
    gdpo = step_config(adv_estimator="gdpo", gdpo_weights=(1.0, 0.0))
    two = Rewards(scores, components=torch.stack([scores, torch.randn_like(scores)], 1))
    one = Rewards(scores, components=scores[:, None])
    a2, _, _ = shape_rewards(make_experience(state, rollout, two, policy=model, settings=experience_settings_of(gdpo)),
                             state.kl, kl_controller, shaping=shaping_of(gdpo))
    a1, _, _ = shape_rewards(make_experience(state, rollout, one, policy=model,
                                             settings=experience_settings_of(step_config(adv_estimator="gdpo"))),
                             state.kl, kl_controller, shaping=shaping_of(step_config(adv_estimator="gdpo")))
    torch.testing.assert_close(a2.advantages, a1.advantages)  # a zero-weight component changes nothing


@pytest.mark.parametrize("loss", POLICY_LOSSES.names())
def test_every_registered_policy_loss_trains_in_a_step(loss):
    model, optimizer, kl_controller, state, engine, _ = _setup()
    engine.sync(state.policy, 0)
    rollout = engine.generate(PROMPTS, SamplingParams(max_new_tokens=8, n=4, temperature=1.0), RngState(1))
    before = tree_clone(state.policy)
    config = step_config(policy_loss=loss, micro_batch_rows=5, loss_options={"dro_beta": 0.1})
    state, metrics = grpo_step(state, rollout, _scores(rollout), policy=model, optimizer=optimizer,
                               kl_controller=kl_controller, **stage_settings_of(config))
    assert metrics["actor/rejected_updates"] == 0 and math.isfinite(metrics["actor/pg_loss"])
    assert not tree_equal(state.policy, before)


@pytest.mark.parametrize("estimator", [n for n in ADVANTAGE_ESTIMATORS.names() if n not in ("gae", "remax")])
def test_every_critic_free_estimator_trains_in_a_step(estimator):
    model, optimizer, kl_controller, state, engine, _ = _setup()
    engine.sync(state.policy, 0)
    rollout = engine.generate(PROMPTS, SamplingParams(max_new_tokens=8, n=4, temperature=1.0), RngState(1))
    config = step_config(adv_estimator=estimator, micro_batch_rows=5)
    experience = make_experience(state, rollout, _scores(rollout), policy=model,
                                 settings=experience_settings_of(config))
    if "optimal_token_baseline" in estimator:  # Σπ² of the policy that sampled, from the same forward
        logits = response_logits(model, state.policy, rollout.sequences)
        expected = torch.softmax(logits.float(), -1).square().sum(-1)
        mask = rollout.sequences.response_mask
        torch.testing.assert_close(experience.sum_pi_squared[mask], expected[mask], rtol=1e-5, atol=1e-6)
    state, metrics = grpo_step(state, rollout, _scores(rollout), policy=model, optimizer=optimizer,
                               kl_controller=kl_controller, **stage_settings_of(config))
    assert metrics["actor/rejected_updates"] == 0 and math.isfinite(metrics["critic/advantages/mean"])


def _guide_step(state, rollout, rewards, *, policy, loss):
    """The custom-steps guide's step (docs/guides/custom-steps.md), its settings all defaults."""
    from purerl.algo import PolicyLossSettings
    from purerl.step import ActorLoss, Batching, ExperienceSettings, Shaping, actor_update

    optimizer = chain(clip_by_global_norm(1.0), adamw(1e-3, weight_decay=0.0))
    kl_controller = make_kl_controller("fixed", coef=0.0)
    experience = make_experience(state, rollout, rewards, policy=policy, settings=ExperienceSettings())
    batch, _, metrics = shape_rewards(experience, state.kl, kl_controller,
                                      shaping=Shaping(ADVANTAGE_ESTIMATORS["grpo"].bound()))
    _, _, actor_metrics = actor_update(state.policy, optimizer.init(state.policy), batch, policy=policy,
                                       loss=loss or ActorLoss(POLICY_LOSSES["cispo"].bound(PolicyLossSettings())),
                                       batching=Batching(), optimizer=optimizer, rng=state.rng)
    return experience, {**metrics, **actor_metrics}


@pytest.mark.parametrize("told", ["the sampling temperature", "another temperature"])
def test_a_custom_step_on_defaults_scores_at_the_sampling_temperature_or_its_sync_check_stops_it(told):
    """The public helpers with their defaults score a rollout sampled at SamplingParams' default
    temperature at that temperature (the rollout carries it), report the engine-trainer gap, and
    fill the engine's log-probs so that ``ActorLoss.sync_tolerance`` checks the sync in a user's step:
    a rollout that misstates its temperature is off by far more than the tolerance, and flagged."""
    import attrs

    from purerl.algo import PolicyLossSettings
    from purerl.step import ActorLoss

    model, _, _, state, engine, _ = _setup()
    engine.sync(state.policy, state.step)
    sampling = SamplingParams(max_new_tokens=8, n=4)
    assert sampling.temperature != 1.0  # the default samples tempered
    rollout = engine.generate(PROMPTS, sampling, RngState(1))
    if told == "another temperature":
        rollout = attrs.evolve(rollout, temperature=1.0)
    loss = ActorLoss(POLICY_LOSSES["cispo"].bound(PolicyLossSettings()), sync_tolerance=0.005)
    experience, metrics = _guide_step(state, rollout, _scores(rollout), policy=model, loss=loss)
    assert experience.temperature == rollout.temperature and experience.on_policy
    assert "actor/sync_gap" in metrics and "rollout/logprob_gap_mean" in metrics
    if told == "the sampling temperature":
        assert metrics["rollout/logprob_gap_mean"] < 1e-4 and metrics["actor/sync_gap"] < 1e-4
        assert "actor/sync_failed" not in metrics
    else:
        assert metrics["rollout/logprob_gap_mean"] > 0.005 and metrics["actor/sync_failed"] == 1.0


def test_a_stale_rollout_is_not_sync_checked_in_a_custom_step():
    """Weights the update does not start from sampled the rollout: nothing to check the sync against."""
    import attrs

    from purerl.algo import PolicyLossSettings
    from purerl.step import ActorLoss

    model, _, _, state, engine, _ = _setup()
    engine.sync(state.policy, state.step)
    rollout = attrs.evolve(engine.generate(PROMPTS, SamplingParams(max_new_tokens=8, n=4), RngState(1)), version=-1)
    loss = ActorLoss(POLICY_LOSSES["cispo"].bound(PolicyLossSettings()), sync_tolerance=0.005)
    experience, metrics = _guide_step(state, rollout, _scores(rollout), policy=model, loss=loss)
    assert not experience.on_policy and "actor/sync_gap" not in metrics
