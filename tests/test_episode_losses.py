"""Observation tokens in the maths: no loss, no KL, no gradient, skipped by GAE; the SFT step
learns only the sampled tokens."""

import pytest
import torch

from purerl.algo.advantages import gae_advantages
from purerl.algo.logprobs import logprobs_from_logits
from purerl.assembly.stages import actor_batching_of, actor_loss_of, actor_optimizer, shaping_of
from purerl.episodes import ChatCodec
from purerl.episodes.calculator import calculator_env, demonstration
from purerl.episodes.rollout import episode_of_transcript, episodes_rollout
from purerl.models import response_logits
from purerl.models import value_and_grad as pure_value_and_grad
from purerl.state import RngState
from purerl.step.sft import sft_update
from purerl.step.shaping import TrainBatch
from purerl.step.update import _actor_loss
from purerl.tiny import char_tokenizer, tiny_causal_lm, tiny_llama_config
from tests.jobs import step_config


def _episodes_batch(rows: int = 3):
    """Sequences of calculator demonstrations (observation tokens inside each response) and a tiny
    model that reads them."""
    from purerl.data.math_problems import math_problems

    tokenizer = char_tokenizer(chatml=True)
    codec, env = ChatCodec(tokenizer), calculator_env()
    played = [episode_of_transcript(codec, demonstration(r, env), stop=env.stop)
              for r in math_problems(rows, seed=1, difficulties=(5,))]
    sequences = episodes_rollout(played, range(rows), pad_token_id=0, version=0, temperature=1.0).sequences
    config = tiny_llama_config(vocab_size=len(tokenizer), hidden_size=32, max_position_embeddings=1024)
    model, params = tiny_causal_lm(config, seed=0)
    return sequences, model, params


def test_observation_tokens_add_no_loss_no_kl_and_no_gradient():
    sequences, model, params = _episodes_batch()
    mask = sequences.response_mask
    response_attends = sequences.attention_mask[:, -sequences.response_length:]
    observation = response_attends & ~mask
    assert observation.any() and mask.any()
    g = torch.Generator().manual_seed(0)
    noise = lambda: torch.randn(mask.shape, generator=g)  # noqa: E731

    def batch(at_observations: float) -> TrainBatch:  # anything at observation positions: it must not matter
        junk = torch.where(observation, at_observations, 0.0)
        return TrainBatch(sequences, torch.where(mask, -1.0 + 0.1 * base[0], 0.0) + junk,
                          torch.where(mask, -1.2 + 0.1 * base[1], 0.0) + junk,
                          torch.where(mask, base[2], 0.0) + 50 * junk, torch.zeros(mask.shape), None,
                          temperature=1.0)

    base = [noise(), noise(), noise()]
    config = step_config(kl_loss_coef=0.5, entropy_coeff=0.01, policy_loss="vanilla")
    grad_fn = pure_value_and_grad(_actor_loss(model, actor_loss_of(config), RngState(0)))
    results = [grad_fn(params, batch(value)) for value in (0.0, 3.0)]
    (loss_a, aux_a, grads_a), (loss_b, aux_b, grads_b) = results
    assert torch.equal(loss_a.total, loss_b.total) and torch.equal(loss_a.count, loss_b.count)
    assert loss_a.count == mask.sum()  # the loss averages over sampled tokens only
    assert torch.equal(aux_a["kl_loss"].total, aux_b["kl_loss"].total) and aux_a["kl_loss"].total != 0
    for name in grads_a:
        assert torch.equal(grads_a[name], grads_b[name]), name
    # and the gradient w.r.t. the log-prob of an observation token is exactly zero
    logp = logprobs_from_logits(response_logits(model, params, sequences), sequences.responses()).detach()
    logp.requires_grad_(True)
    out = config.actor.loss(logp, batch(0.0).old_logprobs, batch(0.0).advantages, mask, config.actor)
    out.loss.total.backward()
    assert logp.grad[observation].eq(0).all() and logp.grad[mask].ne(0).any()


def test_gae_with_observation_tokens_masked_equals_gae_with_them_deleted():
    g = torch.Generator().manual_seed(3)
    b, t = 4, 12
    mask = torch.rand((b, t), generator=g) > 0.35
    mask[:, 0] = True
    rewards = torch.where(mask, torch.randn((b, t), generator=g), 0.0)
    values = torch.randn((b, t), generator=g)
    adv, ret = gae_advantages(rewards, values, mask, gamma=0.97, lam=0.9, whiten=False)
    for row in range(b):
        kept = mask[row].nonzero().squeeze(1)
        full = torch.ones((1, len(kept)), dtype=torch.bool)
        a, r = gae_advantages(rewards[row, kept][None], values[row, kept][None], full, gamma=0.97, lam=0.9,
                              whiten=False)
        assert torch.allclose(adv[row, kept], a[0], atol=1e-6) and torch.allclose(ret[row, kept], r[0], atol=1e-6)
        assert adv[row][~mask[row]].eq(0).all()


def test_the_sft_step_learns_the_sampled_tokens_of_demonstrations():
    sequences, model, params = _episodes_batch()
    config = step_config(lr=3e-3, warmup_steps=0, micro_batch_rows=2)
    optimizer = actor_optimizer(config)
    state = optimizer.init(params)

    def nll(p) -> torch.Tensor:  # the mean NLL of the sampled tokens, computed directly
        with torch.no_grad():
            logp = logprobs_from_logits(response_logits(model, p, sequences), sequences.responses())
        return -logp[sequences.response_mask].mean()

    first = nll(params)
    losses = []
    for _ in range(5):
        params, state, metrics = sft_update(params, state, sequences, policy=model, optimizer=optimizer,
                                            batching=actor_batching_of(config))
        losses.append(metrics["sft/loss"])
    assert abs(losses[0] - float(first)) < 1e-4  # the step's loss is the sampled tokens' NLL
    assert losses[-1] < losses[0] - 0.5 and float(nll(params)) < losses[-1]


def test_per_turn_rewards_sit_on_each_turns_last_token_and_sum_to_the_score():
    from purerl.algo.kl_control import make_kl_controller
    from purerl.episodes.env import StepResult
    from purerl.episodes.rollout import Episode, turn_token_rewards
    from purerl.step.experience import Experience
    from purerl.step.shaping import shape_rewards

    episodes = []
    for first, second in ((0.25, 1.0), (0.25, 0.0), (0.0, 0.0), (0.5, 1.0)):
        e = Episode([7, 7], 2)
        e.append([3, 4, 5], sampled=True, logprobs=[-1.0] * 3)
        e.add(StepResult(None, (), first, False))
        e.append([9, 9], sampled=False)
        e.append([6, 1], sampled=True, logprobs=[-1.0] * 2)
        e.add(StepResult(None, (), second, True))
        episodes.append(e)
    rollout = episodes_rollout(episodes, [0, 0, 1, 1], pad_token_id=0, version=0, temperature=1.0)
    scores = torch.tensor([e.reward + 0.1 for e in episodes])  # e.g. a tool bonus beyond the turns' rewards
    tokens = turn_token_rewards(episodes, scores, rollout.sequences.response_length)
    assert tokens[0].tolist() == pytest.approx([0, 0, 0.25, 0, 0, 0, 1.1])
    assert torch.allclose(tokens.sum(-1), scores)

    def advantages(estimator: str, token_rewards) -> torch.Tensor:
        config = step_config(adv_estimator=estimator, gamma=0.9)
        mask = rollout.sequences.response_mask
        zeros = torch.zeros(mask.shape)
        experience = Experience(rollout.sequences, rollout.group, scores, zeros, zeros, None, None,
                                token_rewards=token_rewards, temperature=1.0, on_policy=True)
        batch, _, _ = shape_rewards(experience, make_kl_controller("fixed").init(), make_kl_controller("fixed"),
                                    shaping=shaping_of(config))
        return batch.advantages

    # GRPO reads each row's sum: the same advantages; a discounted token-level estimator sees the turns
    assert torch.equal(advantages("grpo", tokens), advantages("grpo", None))
    assert not torch.allclose(advantages("reinforce_plus_plus", tokens), advantages("reinforce_plus_plus", None))
