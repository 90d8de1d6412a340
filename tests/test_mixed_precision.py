"""Mixed precision (``model.dtype=bfloat16``): the forwards compute in bfloat16 on a cast of float32
master weights, which the optimizer updates with float32 moments. An update far below bfloat16's
resolution (lr 2e-5 on weights of ~0.02: bfloat16's spacing there is ~1.2e-4) moves the masters;
bfloat16 params would round it away."""

import functools
from pathlib import Path

import attrs
import pytest
import torch
from safetensors.torch import load_file

from purerl.algo.aggregation import aggregate_loss
from purerl.algo.kl_control import make_kl_controller
from purerl.assembly.stages import stage_settings_of
from purerl.config.job import ExecutorConfig
from purerl.executors.local import LocalExecutor
from purerl.models import cast_floating, response_logprobs, value_and_grad
from purerl.optim import adamw, chain, clip_by_global_norm
from purerl.rollout.backends.torch import TorchEngine
from purerl.rollout.sampling import SamplingParams
from purerl.run import load_policy
from purerl.state import RngState, TrainState
from purerl.step import grpo_step
from purerl.tree import tree_clone, tree_leaves
from tests.jobs import assert_cut_run_resumes_as_the_whole, parse, run_job, step_config

ROOT = Path(__file__).resolve().parents[1]
BF16 = torch.bfloat16
PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
ENGINE = dict(eos_token_ids=[1], pad_token_id=0)


def _even_tokens(rollout):
    responses, mask = rollout.sequences.responses(), rollout.sequences.response_mask
    return ((responses % 2 == 0) & mask).float().sum(-1) / mask.sum(-1).clamp_min(1)


def _make_step_fn(lr=1e-3):
    optimizer = chain(clip_by_global_norm(1.0), adamw(lr, weight_decay=0.0))
    # the old log-probs recomputed, as before and as a bfloat16 job resolves them (the config here
    # says float32: the bfloat16 compute is the model's, set on it, not the config's)
    config = step_config(kl_loss_coef=0.1, micro_batch_rows=4, recompute_old_logprobs=True)
    return functools.partial(grpo_step, optimizer=optimizer, kl_controller=make_kl_controller("fixed", coef=0.001),
                             **stage_settings_of(config)), optimizer


def _state(params, optimizer, compute_dtype=None):
    params = tree_clone(params)
    return TrainState(policy=params, policy_opt=optimizer.init(params),
                      kl=make_kl_controller("fixed", coef=0.001).init(), rng=RngState(0),
                      reference=tree_clone(cast_floating(params, compute_dtype)))


def _batch(model, params):
    engine = TorchEngine(model, **ENGINE)
    engine.sync(params, 0)
    rollout = engine.generate(PROMPTS, SamplingParams(max_new_tokens=8, n=4, temperature=1.0), RngState(3), version=0)
    return rollout, _even_tokens(rollout)


def test_float32_masters_take_an_update_that_bfloat16_params_round_away(tiny_lm):
    model, params = tiny_lm(seed=0)
    mixed = attrs.evolve(model, compute_dtype=BF16)
    rollout, scores = _batch(model, params)
    step_fn, optimizer = _make_step_fn(lr=2e-5)

    state, _ = step_fn(_state(params, optimizer, BF16), rollout, scores, policy=mixed)
    assert all(state.policy[k].dtype == torch.float32 for k in params)  # the masters stay float32
    assert {x.dtype for x in tree_leaves(state.policy_opt) if isinstance(x, torch.Tensor)} == {torch.float32}  # moments
    moved = torch.cat([(state.policy[k] != v).flatten() for k, v in params.items()])
    assert moved.float().mean() > 0.9  # nearly every master entry took its ≤ 2e-5 step
    # where |w| ≥ 2^-5 bfloat16's spacing is ≥ 2.4e-4: a copy entry moves only where its master sat
    # within the step of a rounding boundary
    big = torch.cat([(v.abs() >= 2**-5).flatten() for v in params.values()])
    copy = torch.cat([(cast_floating(state.policy, BF16)[k] != v.to(BF16)).flatten() for k, v in params.items()])
    assert big.sum() > 1000 and copy[big].float().mean() < 0.15

    # the same step on bfloat16 params (and moments): there, the update rounds away everywhere
    narrow = cast_floating(params, BF16)
    narrow_state, _ = step_fn(_state(narrow, optimizer), rollout, scores, policy=model)
    narrow_moved = torch.cat([(narrow_state.policy[k] != v).flatten() for k, v in narrow.items()])
    assert not narrow_moved[big].any()


def test_updates_below_bfloat16_resolution_accumulate_in_the_master_until_the_copy_moves():
    # lr 2e-5 on a weight of 1.0 (bfloat16's spacing just below it: 2^-8 ≈ 3.9e-3): AdamW steps by
    # ~lr against a constant gradient, so after ~100 steps the master crosses half a spacing
    optimizer = adamw(2e-5, weight_decay=0.0)
    masters, narrow = {"w": torch.ones(8)}, {"w": torch.ones(8, dtype=BF16)}
    m_state, n_state = optimizer.init(masters), optimizer.init(narrow)
    for step in range(150):
        masters, m_state = optimizer.update({"w": torch.ones(8)}, m_state, masters)
        narrow, n_state = optimizer.update({"w": torch.ones(8, dtype=BF16)}, n_state, narrow)
        if step == 0:
            assert (masters["w"] < 1).all() and (masters["w"].to(BF16) == 1).all()
    assert (masters["w"].to(BF16) < 1).all()  # the bfloat16 copy moved
    assert (narrow["w"] == 1).all()  # bfloat16 params never did


def test_a_mixed_precision_grpo_step_equals_the_float32_step_within_bfloat16_tolerance(tiny_lm):
    model, params = tiny_lm(seed=0)
    mixed = attrs.evolve(model, compute_dtype=BF16)
    rollout, scores = _batch(model, params)
    step_fn, optimizer = _make_step_fn()
    _, full = step_fn(_state(params, optimizer), rollout, scores, policy=model)
    _, half = step_fn(_state(params, optimizer, BF16), rollout, scores, policy=mixed)
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "critic/advantages/mean"):
        assert half[key] == pytest.approx(full[key], rel=3e-2, abs=1e-3), key
    # the gradients themselves, float32 in both: bfloat16's rounding apart
    seqs = rollout.sequences
    weights = torch.randn(seqs.response_mask.shape, generator=torch.Generator().manual_seed(0))
    grads = {}
    for name, m in (("float32", model), ("mixed", mixed)):
        def loss_fn(p, m=m):
            return aggregate_loss(-weights * response_logprobs(m, p, seqs), seqs.response_mask), None
        _, _, grads[name] = value_and_grad(loss_fn)(params)
    for k, g in grads["float32"].items():
        assert grads["mixed"][k].dtype == torch.float32
        assert (grads["mixed"][k] - g).norm() <= 5e-2 * g.norm() + 1e-6, k


@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_a_bfloat16_job_holds_float32_masters_exports_bfloat16_and_resumes_bit_exactly(tmp_path, lora):
    argv = ["--tiny", "--dtype", "bfloat16", "--lr", "1e-3", "--kl-coef", "0.05", "--prompts-per-step", "2",
            "--max-new-tokens", "8", "--eval-size", "4", "--train-size", "40", "--eval-every", "0", "--no-progress",
            "--threads", "1", "--warmup-steps", "0", "actor.min_lr_ratio=1.0",
            f"reward.fn={ROOT / 'tests' / 'golden' / 'reward.py'}:digit_fraction",
            *(["--lora-rank", "4"] if lora else [])]
    model, params, _ = load_policy(parse([*argv, "--out-dir", str(tmp_path / "x")]).config)
    assert model.compute_dtype == BF16 and all(v.dtype == torch.float32 for v in params.values())
    assert all(v.dtype == BF16 for v in model.frozen.values())  # a LoRA base is never updated: held narrow
    full = run_job([*argv, "--steps", "4", "--checkpoint-every", "2", "--out-dir", str(tmp_path / "full")])
    export = load_file(tmp_path / "full" / "export" / "model.safetensors")
    assert {v.dtype for v in export.values()} == {BF16}
    assert_cut_run_resumes_as_the_whole(argv, full, tmp_path / "cut")
    again = load_file(tmp_path / "cut" / "export" / "model.safetensors")
    assert all(torch.equal(again[k], export[k]) for k in export)


@pytest.mark.slow
def test_fsdp2_ranks_with_the_mixed_precision_policy_equal_the_local_step(tiny_lm, ray_cluster):
    from purerl.executors.ray import RaySetup, StepFactory
    from purerl.executors.ray import executor as ray_executor

    model, params = tiny_lm(seed=0)
    mixed = attrs.evolve(model, compute_dtype=BF16)
    rollout, scores = _batch(model, params)
    step_fn, optimizer = _make_step_fn()
    fresh = functools.partial(_state, params, optimizer, BF16)
    config = ExecutorConfig(kind="ray", train_ranks=2, rollout_workers=1, step_timeout=120, sync_timeout=60)
    with ray_executor.RayExecutor(StepFactory(lambda: _make_step_fn()[0]), mixed, RaySetup(engine_kwargs=ENGINE),
                                  config) as executor:
        state, metrics = executor.step(executor.start(fresh()), rollout, scores)
        ray_full = executor.full_state(state)
    local_state, local_metrics = LocalExecutor(step_fn, mixed, TorchEngine(mixed, **ENGINE)).step(fresh(), rollout,
                                                                                                  scores)
    assert all(ray_full.policy[k].dtype == torch.float32 for k in params)  # the shards are the masters
    assert all(ray_full.reference[k].dtype == BF16 for k in params)
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/kl_loss", "actor/entropy"):
        assert metrics[key] == pytest.approx(local_metrics[key], rel=3e-2, abs=1e-4), key
    # the same update: the ranks' rows and reductions round apart in bfloat16, Adam's first step is
    # ~lr·sign(g), so entries whose gradient is ~0 may step apart; the update as a whole agrees
    delta = torch.cat([(ray_full.policy[k] - params[k]).flatten() for k in params])
    local_delta = torch.cat([(local_state.policy[k] - params[k]).flatten() for k in params])
    assert torch.nn.functional.cosine_similarity(delta, local_delta, dim=0) > 0.95
