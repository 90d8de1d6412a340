"""Token-budget micro-batches: trimming a micro-batch's padding leaves every kept position's
logits as they were, the budget covers every row once, and the updates and the no-grad forwards
give what fixed-row micro-batches give (float64, up to summation order)."""

import attrs
import pytest
import torch

from purerl.assembly.stages import (
    actor_batching_of,
    actor_loss_of,
    critic_batching_of,
    experience_settings_of,
    value_loss_of,
)
from purerl.batch import Rollout, Sequences
from purerl.models import critic_from_causal_lm, response_logits
from purerl.optim import adamw, chain, clip_by_global_norm
from purerl.state import RngState
from purerl.step.experience import make_experience
from purerl.step.micro_batches import token_budget_rows, trimmed_sequences
from purerl.step.shaping import TrainBatch
from purerl.step.update import actor_update, critic_update
from purerl.tree import tree_clone
from tests.jobs import SMALL, run_job, step_config


def _long_tailed(rows=12, seed=0, vocab=128):
    """Left-padded prompts (2-7 tokens) and right-padded responses of long-tailed lengths (1-24)."""
    g = torch.Generator().manual_seed(seed)
    prompt_lens = torch.randint(2, 8, (rows,), generator=g)
    response_lens = torch.clamp(torch.exp(torch.randn(rows, generator=g) * 0.9 + 1.6).long(), 1, 24)
    response_lens[0] = 24  # one long row sets the padded width
    p, t = int(prompt_lens.max()), int(response_lens.max())
    ids = torch.randint(2, vocab, (rows, p + t), generator=g)
    attend = torch.zeros(rows, p + t, dtype=torch.bool)
    response = torch.zeros(rows, t, dtype=torch.bool)
    for i in range(rows):
        attend[i, p - prompt_lens[i]: p + response_lens[i]] = True
        response[i, : response_lens[i]] = True
    ids = torch.where(attend, ids, 0)
    return Sequences(ids, attend, response)


def _masked(logits, mask):
    return logits * mask[..., None]


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "hf-module"])
def test_trimming_a_micro_batch_keeps_every_used_positions_logits(tiny_lm, lean):
    model, params = tiny_lm(seed=0, dtype=torch.float64)
    model = attrs.evolve(model, lean=lean)
    seqs = _long_tailed()
    rows = torch.tensor([3, 5, 7])  # short rows: most of the batch's width is their padding
    part = seqs.rows(rows)
    cut, kept = trimmed_sequences(part)
    assert kept < seqs.response_length and cut.input_ids.shape[1] < part.input_ids.shape[1]
    assert torch.equal(cut.response_mask, part.response_mask[:, :kept]) and part.response_mask[:, kept:].sum() == 0
    full = response_logits(model, params, part)[:, :kept]
    torch.testing.assert_close(_masked(response_logits(model, params, cut), cut.response_mask),
                               _masked(full, cut.response_mask), rtol=0, atol=1e-12)


def test_the_budget_covers_every_row_once_within_the_budget():
    seqs = _long_tailed(rows=20, seed=1)
    prompt = seqs.attention_mask[:, : seqs.input_ids.shape[1] - seqs.response_length].sum(-1)
    for budget in (1, 30, 64, 10_000):
        parts = token_budget_rows(seqs, budget)
        assert sorted(torch.cat(parts).tolist()) == list(range(20))
        for part in parts:
            cut, kept = trimmed_sequences(seqs.rows(part))
            assert len(part) == 1 or cut.input_ids.numel() <= budget
            assert cut.input_ids.shape[1] == int(prompt[part].max()) + kept
    assert len(token_budget_rows(seqs, 10_000)) == 1 and len(token_budget_rows(seqs, 1)) == 20


def _batch(seqs, seed=0, with_values=False):
    g = torch.Generator().manual_seed(seed)
    shape = seqs.response_mask.shape
    advantages = torch.randn(shape, generator=g, dtype=torch.float64) * seqs.response_mask
    old = -torch.rand(shape, generator=g, dtype=torch.float64) - 4.0
    values = torch.randn(shape, generator=g, dtype=torch.float64) if with_values else None
    returns = torch.randn(shape, generator=g, dtype=torch.float64)
    return TrainBatch(seqs, old, old - 0.01, advantages, returns, values, temperature=1.0)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_token_budget_updates_give_the_fixed_row_gradient(tiny_lm, agg):
    model, params = tiny_lm(seed=0, dtype=torch.float64)
    seqs = _long_tailed(rows=12)
    batch = _batch(seqs)
    optimizer = chain(clip_by_global_norm(1.0), adamw(1e-3))
    results = []
    for budget in (None, 48):
        config = step_config(loss_agg=agg, micro_batch_rows=3, kl_loss_coef=0.1, entropy_coeff=0.01,
                             mini_batch_rows=6, max_tokens_per_micro_batch=budget)
        p = tree_clone(params)
        results.append(actor_update(p, optimizer.init(p), batch, policy=model, loss=actor_loss_of(config),
                                    batching=actor_batching_of(config), optimizer=optimizer, rng=RngState(0)))
    (fixed, _, fixed_metrics), (budgeted, _, budget_metrics) = results
    for name, value in fixed.items():
        torch.testing.assert_close(budgeted[name], value, rtol=1e-9, atol=1e-11)
    for key, value in fixed_metrics.items():
        assert budget_metrics[key] == pytest.approx(value, rel=1e-9, abs=1e-11), key


def test_token_budget_critic_updates_and_no_grad_forwards_equal_fixed_rows(tiny_lm):
    model, params = tiny_lm(seed=0, dtype=torch.float64)
    critic, critic_params = critic_from_causal_lm(model, params)
    g = torch.Generator().manual_seed(3)
    critic_params = {k: v + 0.05 * torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in critic_params.items()}
    seqs = _long_tailed(rows=10, seed=2)
    batch = _batch(seqs, with_values=True)
    optimizer = chain(clip_by_global_norm(1.0), adamw(1e-3))
    rollout = Rollout(seqs, torch.zeros(seqs.response_mask.shape, dtype=torch.float64),
                      torch.zeros(len(seqs), dtype=torch.long), torch.arange(len(seqs)) // 2, 0, 1.0)
    from purerl.state import TrainState

    state = TrainState(policy=params, policy_opt=None, kl=None, rng=RngState(0), reference=params,
                       critic=critic_params)
    results, experiences = [], []
    for budget in (None, 40):
        # GAE: a critic's estimator, so the critic's token budget (None) resolves to the actor's
        config = step_config(adv_estimator="gae", micro_batch_rows=4, recompute_old_logprobs=True,
                             max_tokens_per_micro_batch=budget)
        assert critic_batching_of(config).max_tokens == budget
        p = tree_clone(critic_params)
        results.append(critic_update(p, optimizer.init(p), batch, critic=critic, loss=value_loss_of(config),
                                     batching=critic_batching_of(config), optimizer=optimizer, rng=RngState(1)))
        experiences.append(make_experience(state, rollout, torch.zeros(len(seqs)), policy=model,
                                           settings=experience_settings_of(config), critic=critic))
    for name, value in results[0][0].items():
        torch.testing.assert_close(results[1][0][name], value, rtol=1e-9, atol=1e-11)
    mask = seqs.response_mask
    for field in ("old_logprobs", "ref_logprobs", "values"):
        a, b = getattr(experiences[0], field), getattr(experiences[1], field)
        torch.testing.assert_close(b[mask], a[mask], rtol=0, atol=1e-10)


def test_the_job_runs_with_a_token_budget(tmp_path):
    summary = run_job(["--tiny", *SMALL, "--steps", "2", "--out-dir", str(tmp_path / "r"),
                       "actor.max_tokens_per_micro_batch=64"])
    assert summary["steps"] == 2
    assert all(r["actor/rejected_updates"] == 0 for r in summary["records"])
