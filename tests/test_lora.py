"""LoRA: adapters are the only trained leaves; step 0 is the base exactly; the lean forward, the
HF module, the merged weights, the engines, FSDP2 ranks, checkpoints and the PEFT export all
compute the same adapted policy."""

import json
from pathlib import Path

import attrs
import pytest
import torch
from safetensors.torch import load_file

from purerl.algo.aggregation import SumCount
from purerl.algo.kl_control import make_kl_controller
from purerl.assembly.stages import stage_settings_of
from purerl.data.cursor import DataCursor
from purerl.executors.local import LocalExecutor
from purerl.io.checkpoint import latest_checkpoint, load_checkpoint
from purerl.models import response_logits, response_logprobs, value_and_grad
from purerl.models.hf import export_hf
from purerl.models.lora import LoraSpec, apply_lora, export_peft
from purerl.optim import adamw, chain, clip_by_global_norm
from purerl.rollout.backends.torch import TorchEngine
from purerl.rollout.sampling import SamplingParams
from purerl.run import load_policy
from purerl.state import RngState, TrainState
from purerl.step import grpo_step
from purerl.tiny import random_sequences, tiny_causal_lm
from purerl.tree import tree_clone, tree_leaves
from tests.jobs import SMALL, assert_cut_run_resumes_as_the_whole, parse, run_job, step_config

ENGINE = dict(eos_token_ids=[1], pad_token_id=0)
ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]


def _lora(dtype=torch.float32, rank=4, targets=None):
    model, params = tiny_causal_lm(seed=0, dtype=dtype)
    spec = LoraSpec(rank, 8.0) if targets is None else LoraSpec(rank, 8.0, targets)
    lm, adapters = apply_lora(model, params, spec, seed=3)
    return model, params, lm, adapters


def _trained(adapters, seed=0, size=0.3):
    """Adapters as after training: every ``lora_B`` non-zero."""
    g = torch.Generator().manual_seed(seed)
    return {k: v + size * torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in adapters.items()}


def _masked(logits, seqs):
    return logits * seqs.response_mask[..., None]  # padding positions compute garbage in both forwards


def test_at_step_zero_the_lora_policy_is_the_base_exactly_and_its_reference_costs_no_copy():
    model, params, lm, adapters = _lora()
    assert set(adapters) == {f"model.layers.{i}.{part}.lora_{ab}.weight" for i in range(2) for ab in "AB"
                             for part in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                          "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
    assert all(not v.any() for k, v in adapters.items() if "lora_B" in k)
    assert all(v.abs().sum() > 0 for k, v in adapters.items() if "lora_A" in k)
    seqs = random_sequences(6, 5, 4, 128, seed=1)
    for lean in (True, False):  # (the two forwards differ at padding positions, so each is compared to its own)
        base = response_logits(attrs.evolve(model, lean=lean), params, seqs)
        view = attrs.evolve(lm, lean=lean)
        assert torch.equal(response_logits(view, adapters, seqs), base)
        assert torch.equal(response_logits(view, {}, seqs), base)  # {}: the reference, adapters off
    # the frozen base is the loaded params themselves: no second copy of the model
    assert all(lm.frozen[k].data_ptr() == params[k].data_ptr() for k in params)


def test_the_lean_forward_and_the_hf_module_compute_the_same_adapted_logits_and_gradients():
    model, params, lm, adapters = _lora(torch.float64)
    adapters = _trained(adapters)
    seqs = random_sequences(6, 5, 4, 128, seed=2)
    weights = torch.randn(seqs.response_mask.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)

    def loss_fn(view):
        def fn(p):
            logp = response_logprobs(view, p, seqs)
            return SumCount((weights * logp * seqs.response_mask).sum(), seqs.response_mask.sum()), None
        return fn

    lean, hf = lm, attrs.evolve(lm, lean=False)
    torch.testing.assert_close(_masked(response_logits(lean, adapters, seqs), seqs),
                               _masked(response_logits(hf, adapters, seqs), seqs), rtol=0, atol=1e-12)
    merged = response_logits(model, lm.merged(adapters), seqs)
    torch.testing.assert_close(_masked(merged, seqs), _masked(response_logits(lean, adapters, seqs), seqs),
                               rtol=0, atol=1e-12)
    assert not torch.allclose(_masked(merged, seqs), _masked(response_logits(model, params, seqs), seqs))
    _, _, g_lean = value_and_grad(loss_fn(lean))(adapters)
    _, _, g_hf = value_and_grad(loss_fn(hf))(adapters)
    assert set(g_lean) == set(adapters)
    for name in adapters:
        assert g_lean[name].abs().sum() > 0, name
        torch.testing.assert_close(g_lean[name], g_hf[name], rtol=1e-9, atol=1e-12)


def test_targets_choose_the_adapted_layers_and_an_unknown_target_is_refused(tiny_lm):
    _, _, lm, adapters = _lora(targets=("q_proj", "v_proj"))
    assert {k.split(".")[-3] for k in adapters} == {"q_proj", "v_proj"}
    seqs = random_sequences(4, 5, 4, 128, seed=3)
    adapters = _trained(adapters)
    torch.testing.assert_close(_masked(response_logits(lm, adapters, seqs), seqs),
                               _masked(response_logits(attrs.evolve(lm, lean=False), adapters, seqs), seqs),
                               rtol=1e-5, atol=1e-5)
    model, params = tiny_lm(seed=0)
    with pytest.raises(ValueError, match="match no linear layer"):
        apply_lora(model, params, LoraSpec(4, 8.0, ("qproj",)))


def _grpo(kl_loss_coef=0.1):
    optimizer = chain(clip_by_global_norm(1.0), adamw(1e-2, weight_decay=0.01))
    kl = make_kl_controller("fixed", coef=0.001)
    config = step_config(kl_loss_coef=kl_loss_coef, micro_batch_rows=4)
    import functools

    return (functools.partial(grpo_step, optimizer=optimizer, kl_controller=kl, **stage_settings_of(config)),
            optimizer, kl)


def _even_tokens(rollout):
    responses, mask = rollout.sequences.responses(), rollout.sequences.response_mask
    return ((responses % 2 == 0) & mask).float().sum(-1) / mask.sum(-1).clamp_min(1)


def test_a_grpo_step_trains_the_adapters_only_with_zero_kl_at_step_zero():
    _, params, lm, adapters = _lora()
    base = tree_clone(params)
    step_fn, optimizer, kl = _grpo()
    state = TrainState(policy=adapters, policy_opt=optimizer.init(adapters), kl=kl.init(), rng=RngState(0),
                       data=DataCursor(0), reference={})
    # the optimizer state holds moments of the adapters only (the base has none)
    adam = state.policy_opt[-1]
    assert set(adam.mu) == set(adam.nu) == set(adapters)
    executor = LocalExecutor(step_fn, lm, TorchEngine(lm, **ENGINE))
    state = executor.start(state)
    with executor.engine(executor.newest(0)) as engine:
        rollout = engine.generate(PROMPTS, SamplingParams(max_new_tokens=6, n=4, temperature=1.0), RngState(1),
                                  version=0)
    state, metrics = executor.step(state, rollout, _even_tokens(rollout))
    assert metrics["actor/kl_loss"] == 0.0  # before the first update the policy is the reference
    assert metrics["actor/grad_norm"] > 0
    assert set(state.policy) == set(adapters)
    assert all(torch.equal(lm.frozen[k], base[k]) for k in base)  # the base received nothing
    assert all(state.policy[k].any() for k in adapters if "lora_B" in k)


def test_the_engine_decodes_the_adapted_policy_merged_through_both_decoders():
    model, params, lm, adapters = _lora()
    adapters = _trained(adapters, size=0.5)
    sampling = SamplingParams(max_new_tokens=8, n=2, temperature=1.0)

    def tokens(view, p, **options):
        engine = TorchEngine(view, **ENGINE, **options)
        engine.sync(p, 1)
        return engine.generate(PROMPTS, sampling, RngState(4), version=1).sequences.input_ids

    adapted = tokens(lm, adapters)
    assert torch.equal(adapted, tokens(model, lm.merged(adapters)))
    assert torch.equal(adapted, tokens(lm, adapters, lean=False))
    assert not torch.equal(adapted, tokens(model, params))  # the adapters did reach the decoder


def test_the_peft_export_loads_with_peft_and_gives_the_trainers_logits(tmp_path):
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    model, params, lm, adapters = _lora()
    adapters = _trained(adapters)
    export_hf(model, params, tmp_path / "base")
    folder = export_peft(lm, adapters, tmp_path / "adapter", base_model=str(tmp_path / "base"))
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8.0
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    adapted = peft.PeftModel.from_pretrained(base, folder).eval()
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11]])
    with torch.no_grad():
        logits = adapted(input_ids=ids).logits
    seqs = random_sequences(1, 3, 4, 128, seed=0)
    seqs = attrs.evolve(seqs, input_ids=ids, attention_mask=torch.ones_like(ids, dtype=torch.bool))
    ours = response_logits(lm, adapters, seqs)
    torch.testing.assert_close(logits[:, 2:-1], ours, rtol=1e-5, atol=1e-5)
    # the merged HF export is the same policy
    export_hf(lm, adapters, tmp_path / "merged")
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")(input_ids=ids).logits
    torch.testing.assert_close(merged, logits, rtol=1e-5, atol=1e-5)


def test_the_job_trains_lora_exports_its_adapter_and_resumes_bit_exactly(tmp_path):
    # a constant learning rate: the run cut at step 2 has the schedule of the 4-step one
    # a reward that varies between samples (the tiny model's answers are all wrong): the adapters move
    argv = ["--tiny", "--lora-rank", "4", "--lr", "1e-3", "--kl-coef", "0.05", *SMALL, "--warmup-steps", "0",
            "actor.min_lr_ratio=1.0", f"reward.fn={ROOT / 'tests' / 'golden' / 'reward.py'}:digit_fraction"]
    full = run_job([*argv, "--steps", "4", "--checkpoint-every", "2", "--out-dir", str(tmp_path / "full")])
    assert full["adapter"] == str(tmp_path / "full" / "adapter")
    tensors = load_file(tmp_path / "full" / "adapter" / "adapter_model.safetensors")
    assert tensors and all(k.startswith("base_model.model.model.layers.") for k in tensors)
    assert any(v.any() for k, v in tensors.items() if "lora_B" in k)  # trained
    # the checkpoint holds the adapters and their optimizer state, not the base
    config = parse([*argv, "--out-dir", str(tmp_path / "full")]).config
    lm, adapters, _ = load_policy(config)
    checkpoint = latest_checkpoint(tmp_path / "full" / "checkpoints")
    stored = sum(p.stat().st_size for p in checkpoint.rglob("*") if p.is_file())
    base_bytes = sum(t.numel() * t.element_size() for t in lm.frozen.values())
    adapter_bytes = sum(t.numel() * t.element_size() for t in adapters.values())
    assert 3 * adapter_bytes <= stored < base_bytes, (stored, adapter_bytes, base_bytes)  # full FT: ≥ 3 × base

    assert_cut_run_resumes_as_the_whole(argv, full, tmp_path / "cut")
    again = load_file(tmp_path / "cut" / "adapter" / "adapter_model.safetensors")
    assert all(torch.equal(again[k], tensors[k]) for k in tensors)


def test_a_lora_target_that_matches_nothing_stops_the_job_naming_the_setting(tmp_path):
    from purerl.data.records import DataError

    with pytest.raises(DataError, match="actor.lora_targets"):
        run_job(["--tiny", "--lora-rank", "2", *SMALL, "--steps", "1", "--out-dir", str(tmp_path / "r"),
                 "actor.lora_targets=[\"attn\"]"])


def test_checkpoints_restore_the_adapters(tmp_path):
    from purerl.io.checkpoint import save_checkpoint

    _, _, lm, adapters = _lora()
    step_fn, optimizer, kl = _grpo()
    state = TrainState(policy=_trained(adapters), policy_opt=optimizer.init(adapters), kl=kl.init(), rng=RngState(0),
                       reference={})
    save_checkpoint(tmp_path, state, step=1)
    template = TrainState(policy=adapters, policy_opt=optimizer.init(adapters), kl=kl.init(), rng=RngState(0),
                          reference={})
    loaded = load_checkpoint(latest_checkpoint(tmp_path), template)
    assert loaded.reference == {}
    assert all(torch.equal(a, b) for a, b in zip(tree_leaves(loaded.policy), tree_leaves(state.policy)))


def _make_lora_step_fn():
    return _grpo()[0]


@pytest.mark.slow
def test_fsdp2_ranks_train_the_adapters_like_the_local_step_and_rollout_workers_sample_the_adapted_policy(ray_cluster):
    import sys

    from ray import cloudpickle

    from purerl.config.job import ExecutorConfig
    from purerl.executors.ray import RayExecutor, RaySetup, StepFactory
    from purerl.executors.wire import params_digest
    from purerl.tree import tree_equal

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # rank processes cannot import tests/
    _, _, lm, adapters = _lora()
    step_fn, optimizer, kl = _grpo()

    def fresh():
        a = tree_clone(adapters)
        return TrainState(policy=a, policy_opt=optimizer.init(a), kl=kl.init(), rng=RngState(0), data=DataCursor(0),
                          reference={})

    config = ExecutorConfig(kind="ray", train_ranks=2, rollout_workers=1, placement="split", sync_checksum=True,
                            step_timeout=120, sync_timeout=60)
    sampling = SamplingParams(max_new_tokens=6, n=4, temperature=1.0)
    with RayExecutor(StepFactory(_make_lora_step_fn), lm, RaySetup(engine_kwargs=ENGINE), config) as executor:
        state = executor.start(fresh())
        with executor.engine(executor.newest(0)) as engine:
            rollout = engine.generate(PROMPTS, sampling, RngState(1), version=0)
        # weight sync carries the adapters alone (the base reached each worker once, with the model)
        assert set(executor.last_sync_digests) == {params_digest(adapters)}
        scores = _even_tokens(rollout)
        state, metrics = executor.step(state, rollout, scores)
        ray_full = executor.full_state(state)
        with executor.engine(executor.newest(1)) as engine:
            remote = engine.generate(PROMPTS, sampling, RngState(2), version=1)

    local = LocalExecutor(step_fn, lm, TorchEngine(lm, **ENGINE))
    local_state, local_metrics = local.step(fresh(), rollout, scores)
    assert set(ray_full.policy) == set(adapters) and ray_full.reference == {}
    for name, value in local_state.policy.items():
        torch.testing.assert_close(ray_full.policy[name], value, rtol=0, atol=1e-5)
    assert metrics["actor/kl_loss"] == local_metrics["actor/kl_loss"] == 0.0
    for key, value in local_metrics.items():
        assert metrics[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
    # the rollout worker samples version 1: the trained adapters, merged into its own base
    engine = TorchEngine(lm, **ENGINE)
    engine.sync(ray_full.policy, 1)
    mine = engine.generate(PROMPTS, sampling, RngState(2), version=1)
    assert torch.equal(mine.sequences.input_ids, remote.sequences.input_ids)
    assert not tree_equal(ray_full.policy, adapters)


def test_lora_on_a_checkpointed_model_gives_the_same_gradients(tiny_lm):
    model, params = tiny_lm(seed=0, dtype=torch.float64)
    checkpointed, _ = tiny_lm(seed=0, dtype=torch.float64, activation_checkpointing=True)
    seqs = random_sequences(4, 5, 4, 128, seed=5)
    grads = []
    for skeleton in (model, checkpointed):
        lm, adapters = apply_lora(skeleton, params, LoraSpec(4, 8.0), seed=3)

        def loss_fn(p, lm=lm):
            logp = response_logprobs(lm, p, seqs)
            return SumCount((logp * seqs.response_mask).sum(), seqs.response_mask.sum()), None

        grads.append(value_and_grad(loss_fn)(_trained(adapters))[2])
    assert checkpointed.checkpointed
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("flags", [["--adv-estimator", "gae"], ["--async", "--max-staleness", "1"]],
                         ids=["ppo-with-a-critic", "async"])
def test_the_job_runs_lora_with_a_critic_and_asynchronously(tmp_path, flags):
    summary = run_job(["--tiny", "--lora-rank", "4", "--lr", "1e-3", "--kl-coef", "0.05", *SMALL, "--steps", "2",
                       "--out-dir", str(tmp_path / "r"), *flags])
    assert summary["steps"] == 2 and (tmp_path / "r" / "adapter" / "adapter_model.safetensors").is_file()
    records = summary["records"]
    assert all(r["actor/rejected_updates"] == 0 for r in records if "actor/rejected_updates" in r)
