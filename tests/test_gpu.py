"""The CUDA paths a user runs: fused capturable AdamW, the engine (eager and CUDA graphs, the sampler
inside the graph, graphs per bucket of rows, the compiled decoding step), the lean forward, GRPO
steps (KL loss; skipped rows, mini- and micro-batches) and a PPO step against the same steps on the
CPU, a LoRA step and merged LoRA decoding, an FSDP2 rank over NCCL, the main job in float32 and
bfloat16 (and with LoRA), and the Ray executor on the GPU when Ray is installed.

Skipped without a GPU (CI has none): a device mix-up (a CPU index into a CUDA tensor) is
invisible on a CPU, so run these first on any GPU machine: ``python3 -m pytest tests/test_gpu.py``.
"""

import functools
import json
import socket
import subprocess
import sys
from pathlib import Path

import attrs
import pytest
import torch

from purerl.algo.aggregation import SumCount
from purerl.algo.kl_control import make_kl_controller
from purerl.assembly.stages import stage_settings_of
from purerl.config.job import JobConfig
from purerl.models import (
    critic_from_causal_lm,
    response_logits,
    response_logprobs,
    value_and_grad,
)
from purerl.optim import adamw, chain, clip_by_global_norm, warmup_cosine_schedule
from purerl.rollout.backends.torch import TorchEngine
from purerl.rollout.sampling import SamplingParams
from purerl.state import RngState, TrainState
from purerl.step import grpo_step, ppo_step
from purerl.tiny import random_sequences, tiny_causal_lm
from purerl.tree import tree_clone, tree_map
from tests.jobs import step_config

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
ROOT = Path(__file__).resolve().parents[1]
STEP_CONFIGS = {
    # the old log-probs recomputed on the card too (the resolved rule skips it for this float32 engine)
    "kl loss": step_config(kl_loss_coef=0.1, micro_batch_rows=5, recompute_old_logprobs=True),
    # rows whose advantages are all zero skip the update (the path that once crashed on CUDA)
    "skipped rows, mini- and micro-batches": step_config(micro_batch_rows=3, mini_batch_rows=6, ppo_epochs=2,
                                                         recompute_old_logprobs=True),
}


@pytest.fixture(autouse=True)
def _exact_fp32_matmuls():
    torch.backends.cuda.matmul.allow_tf32 = False  # compare fp32 against fp32, not TF32
    yield


def test_fused_adamw_with_a_schedule_on_cuda_matches_torch_adamw():
    g = torch.Generator().manual_seed(0)
    params = {k: torch.randn(s, generator=g).cuda() for k, s in {"w": (64, 32), "b": (32,), "s": ()}.items()}
    grads = [{k: torch.randn(v.shape, generator=g).cuda() for k, v in params.items()} for _ in range(10)]
    schedule = warmup_cosine_schedule(1e-2, 3, 10, final_lr=1e-3)
    optimizer = adamw(schedule, weight_decay=0.1)
    ours, state = tree_clone(params), optimizer.init(params)
    for grad in grads:
        ours, state = optimizer.update(grad, state, ours)
    assert state.count.device.type == "cuda" and int(state.count) == 10

    ref = {k: torch.nn.Parameter(v.clone()) for k, v in params.items()}
    opt = torch.optim.AdamW(list(ref.values()), lr=1.0, weight_decay=0.1, fused=True)
    lr_sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: float(schedule(torch.tensor(float(step)))))
    for grad in grads:
        for k, p in ref.items():
            p.grad = grad[k].clone()
        opt.step()
        lr_sched.step()
    for k, p in ref.items():
        torch.testing.assert_close(ours[k], p.detach(), rtol=1e-5, atol=1e-6)


def _setup(config: JobConfig = STEP_CONFIGS["kl loss"]):
    model, params = tiny_causal_lm(hidden_size=64, seed=0, device="cuda")
    optimizer = chain(clip_by_global_norm(1.0), adamw(1e-3, weight_decay=0.01))
    kl = make_kl_controller("fixed", coef=0.001)
    step_fn = functools.partial(grpo_step, optimizer=optimizer, kl_controller=kl, **stage_settings_of(config))

    def fresh():
        p = tree_clone(params)
        return TrainState(policy=p, policy_opt=optimizer.init(p), kl=kl.init(), rng=RngState(0),
                          reference=tree_clone(p))

    engine = TorchEngine(model, eos_token_ids=[1], pad_token_id=0, device="cuda")
    engine.sync(params, 0)
    rollout = engine.generate(PROMPTS, SamplingParams(max_new_tokens=8, n=4, temperature=1.0), RngState(1), version=0)
    responses, mask = rollout.sequences.responses(), rollout.sequences.response_mask
    scores = ((responses % 2 == 0) & mask).float().sum(-1) / mask.sum(-1).clamp_min(1)
    scores[:4] = 0.5  # prompt 0's samples score alike: zero advantages
    return model, params, step_fn, fresh, rollout, scores


def _on_cpu(tree):
    return tree_map(lambda t: t.cpu() if isinstance(t, torch.Tensor) else t, tree)


def _assert_same_step(gpu, cpu, atol=1e-4):
    """States and metrics of one step on the GPU and on the CPU. One Adam step moves a weight by
    about lr = 1e-3 whatever the gradient's size, so where a gradient is ~0 the kernels' last-bit
    differences may move it differently: allow 10 % of lr."""
    (gpu_state, gpu_metrics), (cpu_state, cpu_metrics) = gpu, cpu
    for name, value in cpu_state.policy.items():
        torch.testing.assert_close(gpu_state.policy[name].cpu(), value, rtol=0, atol=atol)
    for key, value in cpu_metrics.items():
        assert gpu_metrics[key] == pytest.approx(value, rel=1e-4, abs=1e-5), key


def test_engine_behaviour_logprobs_equal_the_trainers_on_cuda():
    model, params, _, _, rollout, _ = _setup()
    assert rollout.sequences.input_ids.device.type == "cuda"
    mask = rollout.sequences.response_mask
    trainer = response_logprobs(model, params, rollout.sequences)
    torch.testing.assert_close(trainer[mask], rollout.behaviour_logprobs[mask], rtol=0, atol=1e-4)


def test_cuda_graph_decoding_samples_what_eager_decoding_samples(tiny_lm):
    model, params = tiny_lm(hidden_size=64, seed=0, device="cuda")
    rollouts = []
    for graphs in (True, False):
        engine = TorchEngine(model, eos_token_ids=[1], pad_token_id=0, device="cuda", cuda_graphs=graphs)
        engine.sync(params, 0)
        rollouts.append(engine.generate(PROMPTS, SamplingParams(max_new_tokens=12, n=3, temperature=1.0), RngState(2)))
    assert torch.equal(rollouts[0].sequences.input_ids, rollouts[1].sequences.input_ids)
    torch.testing.assert_close(rollouts[0].behaviour_logprobs, rollouts[1].behaviour_logprobs, rtol=0, atol=1e-5)


def test_the_sampler_inside_the_cuda_graph_samples_what_the_eager_sampler_samples(tiny_lm):
    """Issue 60: the step captured with the sampler inside (one replay = one token and its
    log-prob per row) against the same step captured giving logits, sampled eagerly after each
    replay: bit for bit, rows padded to the bucket (9 rows in 16), then cut (a row map, then a
    smaller bucket captured anew). The uniforms drawn on the card are the CPU's, bit for bit."""
    from purerl.models.families import decode
    from purerl.models.families.decode_graph import GraphPolicy, RowSampler, sampled
    from purerl.rollout.backends.torch import left_pad
    from purerl.rollout.sampling import TokenSampler, sample_keys, sample_uniforms, step_uniforms

    keys = sample_keys(RngState(3), range(3), 3)
    assert torch.equal(step_uniforms(keys.cuda(), torch.tensor([5], device="cuda")).cpu(),
                       sample_uniforms(RngState(3), range(3), 3, 6)[5])
    model, params = tiny_lm(hidden_size=64, seed=0, device="cuda")
    ids, mask = (x.cuda() for x in left_pad(PROMPTS, 0))
    positions = (mask.long().cumsum(-1) - 1).clamp_min(0)
    policy = GraphPolicy(sizes=(4, 8, 16), min_steps=1, shrink_steps=4, shrink_ratio=0.4)
    for sampling in (SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=20, top_p=0.9),
                     SamplingParams(temperature=0.0)):
        sampler = RowSampler(TokenSampler.of(sampling), None if sampling.greedy else keys.cuda(), start=2)
        runs = []
        for inside in (True, False):
            context = decode.decoding(model, params, ids, mask, positions, 3, ids.shape[1] + 12,
                                      graphs=policy, sampler=sampler if inside else None)
            steps = []
            with context if inside else sampled(context, sampler) as ((token, logp), advance, keep):
                position = positions[:, -1:].repeat_interleave(3, 0) + 1
                for step in range(12):
                    steps.append((token, logp))
                    if step in (2, 6):
                        kept = torch.arange(0, len(token), 2, device="cuda")
                        token, position = token[kept], position[kept]
                        keep(kept)
                    token, logp = advance(token, position)
                    position = position + 1
            runs.append(steps)
        for (token, logp), (want_token, want_logp) in zip(*runs):
            assert torch.equal(token, want_token) and torch.equal(logp, want_logp), sampling


@pytest.mark.parametrize("compile_decode", [False, True], ids=["graph", "compiled step in the graph"])
def test_graph_buckets_on_cuda_sample_what_eager_decoding_samples(tiny_lm, compile_decode):
    """Rows finishing at many steps leave the batch; the graph moves to smaller buckets (a policy
    that pays for any capture); with ``compile_decode`` the captured step is Triton's. The same
    tokens as eager decoding, the log-probs to rounding."""
    from purerl.models.families.decode_graph import GraphPolicy

    jaxtyping = pytest.importorskip("jaxtyping")
    model, params = tiny_lm(hidden_size=64, seed=0, device="cuda")
    sampling = SamplingParams(max_new_tokens=24, n=4, temperature=1.0, top_k=50)
    out = []
    jaxtyping.config.update("jaxtyping_disable", compile_decode)  # dynamo would trace the checks
    try:
        for graphs in (False, True):
            engine = TorchEngine(model, eos_token_ids=range(40, 55), pad_token_id=0, device="cuda", cuda_graphs=graphs,
                                 compile_decode=compile_decode and graphs,
                                 graphs=GraphPolicy(sizes=(4, 8, 16), min_steps=1, shrink_steps=8))
            engine.sync(params, 0)
            out.append(engine.generate(PROMPTS, sampling, RngState(2)))
    finally:
        jaxtyping.config.update("jaxtyping_disable", False)
    eager, graphed = out
    assert len(set(eager.sequences.response_mask.sum(-1).tolist())) > 3
    assert torch.equal(graphed.sequences.input_ids, eager.sequences.input_ids)
    torch.testing.assert_close(graphed.behaviour_logprobs, eager.behaviour_logprobs, rtol=0, atol=1e-4)


@pytest.mark.parametrize("graphs", [True, False], ids=["cuda-graphs", "eager"])
def test_an_interrupted_rollout_continued_on_cuda_is_the_uninterrupted_one(tiny_lm, graphs):
    """Interruptible rollouts on the GPU: rows stopped twice and continued on the same weights
    sample the uninterrupted rows (the continuation's draws are CPU-computed, then moved)."""
    from purerl.rollout.partial import Interruptible
    from purerl.rollout.queue import Weights

    model, params = tiny_lm(hidden_size=64, seed=0, device="cuda")
    engine = TorchEngine(model, eos_token_ids=[1], pad_token_id=0, device="cuda", cuda_graphs=graphs)
    engine.sync(params, 0)
    sampling = SamplingParams(max_new_tokens=16, n=3, temperature=1.0)
    whole = engine.generate(PROMPTS, sampling, RngState(2), version=0)
    polls = []

    def newer(version):
        polls.append(version)
        return Weights(version + 1, params) if len(polls) in (3, 9) else None

    interruptible = Interruptible(engine, newer, lambda w: engine.sync(w.payload, w.version))
    got = interruptible.generate(PROMPTS, sampling, RngState(2), version=0)
    assert interruptible.interruptions >= 1 and got.sequences.input_ids.device.type == "cuda"
    width = whole.sequences.response_length
    alive = whole.sequences.response_mask
    assert torch.equal(got.sequences.responses()[:, :width][alive], whole.sequences.responses()[alive])
    torch.testing.assert_close(got.behaviour_logprobs[:, :width][alive], whole.behaviour_logprobs[alive],
                               rtol=0, atol=1e-4)


@pytest.mark.parametrize("config", STEP_CONFIGS.values(), ids=STEP_CONFIGS.keys())
def test_a_grpo_step_on_cuda_matches_the_same_step_on_cpu(tiny_lm, config):
    model, params, step_fn, fresh, rollout, scores = _setup(config)
    gpu = step_fn(fresh(), rollout, scores, policy=model)
    cpu_model, _ = tiny_lm(hidden_size=64, seed=0)
    cpu = step_fn(_on_cpu(fresh()), _on_cpu(rollout), scores.cpu(), policy=cpu_model)
    _assert_same_step(gpu, cpu)
    if config.actor.kl_loss_coef == 0:
        assert gpu[1]["actor/skipped_rows_frac"] > 0


def test_a_lora_step_on_cuda_matches_the_same_step_on_cpu_and_the_engine_decodes_the_adapters(tiny_lm):
    from purerl.models.lora import LoraSpec, apply_lora

    base, params, step_fn, _, rollout, scores = _setup()
    model, adapters = apply_lora(base, params, LoraSpec(4, 8.0))
    optimizer = chain(clip_by_global_norm(1.0), adamw(1e-3, weight_decay=0.01))
    kl = make_kl_controller("fixed", coef=0.001)

    def fresh(tree):
        return TrainState(policy=tree, policy_opt=optimizer.init(tree), kl=kl.init(), rng=RngState(0), reference={})

    gpu = step_fn(fresh(tree_clone(adapters)), rollout, scores, policy=model)
    cpu_model, cpu_adapters = apply_lora(*tiny_lm(hidden_size=64, seed=0),
                                         LoraSpec(4, 8.0))
    cpu = step_fn(fresh(cpu_adapters), _on_cpu(rollout), scores.cpu(), policy=cpu_model)
    _assert_same_step(gpu, cpu)
    assert gpu[1]["actor/kl_loss"] == 0.0
    trained = gpu[0].policy
    for graphs in (True, False):  # merged decoding, captured or eager, samples what the trainer computes
        engine = TorchEngine(model, eos_token_ids=[1], pad_token_id=0, device="cuda", cuda_graphs=graphs)
        engine.sync(trained, 1)
        out = engine.generate(PROMPTS, SamplingParams(max_new_tokens=8, n=2, temperature=1.0), RngState(3), version=1)
        mask = out.sequences.response_mask
        torch.testing.assert_close(response_logprobs(model, trained, out.sequences)[mask],
                                   out.behaviour_logprobs[mask], rtol=0, atol=1e-4)


def test_a_ppo_step_with_a_critic_on_cuda_matches_the_same_step_on_cpu(tiny_lm):
    model, params, _, _, rollout, scores = _setup()
    optimizer = chain(clip_by_global_norm(1.0), adamw(1e-3))
    kl = make_kl_controller("adaptive", coef=0.01, target_kl=0.1, horizon=100)
    config = step_config(adv_estimator="gae", micro_batch_rows=4, mini_batch_rows=6, gamma=1.0, lam=0.95)
    results = []
    for device in ("cuda", "cpu"):
        policy, p = tiny_lm(hidden_size=64, seed=0, device=device)
        critic, c = critic_from_causal_lm(policy, p)
        state = TrainState(policy=p, policy_opt=optimizer.init(p), kl=kl.init(), rng=RngState(0),
                           reference=tree_clone(p), critic=c, critic_opt=optimizer.init(c))
        batch = (rollout, scores) if device == "cuda" else _on_cpu((rollout, scores))
        results.append(ppo_step(state, *batch, policy=policy, critic=critic, optimizer=optimizer,
                                critic_optimizer=optimizer, kl_controller=kl, **stage_settings_of(config)))
    _assert_same_step(*results)
    for name, value in results[1][0].critic.items():
        torch.testing.assert_close(results[0][0].critic[name].cpu(), value, rtol=0, atol=1e-4)


def test_the_lean_forward_equals_the_module_on_cuda(tiny_lm):
    model, params = tiny_lm(hidden_size=64, seed=0, device="cuda")
    seqs = tree_map(lambda t: t.cuda(), random_sequences(6, 5, 7, 128, seed=3))
    module = attrs.evolve(model, lean=False)
    assert model.lean

    def loss(m):
        def fn(p):
            logits = response_logits(m, p, seqs)
            return SumCount(logits.float().square().mean(-1)[seqs.response_mask].sum(), torch.tensor(1.0)), logits
        return value_and_grad(fn)(params)

    (_, lean_logits, lean_grads), (_, module_logits, module_grads) = loss(model), loss(module)
    mask = seqs.response_mask
    torch.testing.assert_close(lean_logits[mask], module_logits[mask], rtol=1e-5, atol=1e-5)
    for name, g in module_grads.items():
        torch.testing.assert_close(lean_grads[name], g, rtol=1e-4, atol=1e-6)


def _step_on_an_nccl_rank(model, step_fn, state, rollout, scores):
    """``step_fn`` on a one-rank FSDP2 group over NCCL, the policy and the reference sharded: the
    full policy after it and the metrics."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from purerl.executors.fsdp import ShardedCausalLM, full_params, shard_causal_lm, shard_like, sharded_value_and_grad

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cuda", (1,))
        module, sharded = shard_causal_lm(model, state.policy, mesh=mesh)
        ref_module, ref = shard_causal_lm(model, state.reference, mesh=mesh, trainable=False)
        sharded_model = ShardedCausalLM.of(model, [(module, sharded), (ref_module, ref)])
        state = TrainState(policy=sharded, policy_opt=shard_like(state.policy_opt, sharded), kl=state.kl,
                           rng=state.rng, reference=ref)
        state, metrics = step_fn(state, rollout, scores, policy=sharded_model,
                                 value_and_grad=sharded_value_and_grad(0, 1))
        return full_params(state.policy), metrics
    finally:
        dist.destroy_process_group()


def test_an_fsdp2_nccl_rank_matches_the_local_step_on_cuda():
    model, params, step_fn, fresh, rollout, scores = _setup(STEP_CONFIGS["skipped rows, mini- and micro-batches"])
    # against the local step through the HF module, as the FSDP rank runs it: the lean forward's
    # fused projections round differently on CUDA (last bits, see the test above), and where a
    # gradient is ~0 one Adam step turns that into a move of up to 2·lr
    local_state, local_metrics = step_fn(fresh(), rollout, scores, policy=attrs.evolve(model, lean=False))
    full, metrics = _step_on_an_nccl_rank(model, step_fn, fresh(), rollout, scores)
    for name, value in local_state.policy.items():
        torch.testing.assert_close(full[name], value, rtol=0, atol=1e-5)
    for key, value in local_metrics.items():
        assert metrics[key] == pytest.approx(value, rel=1e-4, abs=1e-5), key


def test_the_cuda_decoding_loop_syncs_with_the_host_only_every_few_steps(tiny_lm):
    import warnings

    model, params = tiny_lm(hidden_size=64, seed=0, device="cuda")
    engine = TorchEngine(model, eos_token_ids=[1], pad_token_id=0, device="cuda")
    engine.sync(params, 0)
    sampling = SamplingParams(max_new_tokens=64, n=4, temperature=1.0)
    engine.generate(PROMPTS, sampling, RngState(0))  # graph capture outside the count
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # setting the mode warns too ("a prototype feature")
        try:
            torch.cuda.set_sync_debug_mode("warn")
            engine.generate(PROMPTS, sampling, RngState(1))
        finally:
            torch.cuda.set_sync_debug_mode(0)
    syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message)]
    print(f"{len(syncs)} host syncs for 64 decoding steps")
    assert len(syncs) <= 64 // 8 + 8, syncs[:3]


def test_a_mixed_precision_step_on_an_fsdp2_nccl_rank_matches_the_local_mixed_step_on_cuda():
    from purerl.models import cast_floating

    model, params, step_fn, fresh, rollout, scores = _setup(STEP_CONFIGS["skipped rows, mini- and micro-batches"])
    mixed = attrs.evolve(model, lean=False, compute_dtype=torch.bfloat16)

    def narrow_reference():
        state = fresh()
        return attrs.evolve(state, reference=cast_floating(state.reference, torch.bfloat16))

    local_state, local_metrics = step_fn(narrow_reference(), rollout, scores, policy=mixed)
    full, metrics = _step_on_an_nccl_rank(mixed, step_fn, narrow_reference(), rollout, scores)
    assert all(v.dtype == torch.float32 for v in full.values())
    delta = torch.cat([(full[k] - params[k]).flatten() for k in params])
    local_delta = torch.cat([(local_state.policy[k] - params[k]).flatten() for k in params])
    assert torch.nn.functional.cosine_similarity(delta, local_delta, dim=0) > 0.95
    for key in ("actor/pg_loss", "actor/grad_norm"):
        assert metrics[key] == pytest.approx(local_metrics[key], rel=3e-2, abs=1e-4), key


def _main_job(out: Path, *flags: str) -> dict:
    subprocess.run([sys.executable, str(ROOT / "experiments" / "grpo_math.py"), "--tiny", "--device", "cuda",
                    "--steps", "3", "--eval-every", "2", "--checkpoint-every", "2", "--eval-size", "8",
                    "--no-progress", "--out-dir", str(out), *flags], check=True, timeout=600)
    return json.loads((out / "summary.json").read_text())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_main_job_runs_on_cuda(tmp_path, dtype):
    summary = _main_job(tmp_path, "--dtype", dtype, "--micro-batch", "3")
    assert summary["steps"] == 3 and (tmp_path / "checkpoints" / "step_00000002").is_dir()


def test_the_main_job_trains_lora_on_cuda_in_bfloat16(tmp_path):
    summary = _main_job(tmp_path, "--dtype", "bfloat16", "--lora-rank", "4", "--lr", "1e-3", "--kl-coef", "0.01")
    assert summary["steps"] == 3 and (tmp_path / "adapter" / "adapter_model.safetensors").is_file()


def test_the_main_job_runs_two_interruptible_generators_on_cuda(tmp_path):
    summary = _main_job(tmp_path, "--async", "--generators", "2", "--interruptible", "--max-staleness", "1")
    assert summary["steps"] == 3 and summary["async"]["trained"] == 3
    assert len(json.loads((tmp_path / "status.json").read_text())["generators"]) == 2


def test_the_main_job_runs_on_the_ray_executor_on_cuda(tmp_path):
    pytest.importorskip("ray")
    summary = _main_job(tmp_path, "--executor", "ray", "--train-ranks", "1", "--rollout-workers", "1",
                        "--gpus-per-worker", "0.5")
    assert summary["steps"] == 3


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "HF module"])
@pytest.mark.parametrize("shared", [False, True], ids=["every row", "shared prompts"])
def test_packed_forwards_on_cuda_equal_the_padded_ones(tiny_lm, shared, lean):
    """The packed stream's indexing (slots, the per-row attention, the scatter back) on the device,
    in the lean forward and through the HF module (whose masks read the rows off the positions)."""
    import attrs

    from tests.test_llama import grouped

    model, params = tiny_lm(seed=0, device="cuda")
    model = attrs.evolve(model, lean=lean)
    seqs = random_sequences(8, 7, 9, 128, seed=3)
    seqs = grouped(seqs, 4) if shared else seqs
    seqs = type(seqs)(*(x.cuda() for x in (seqs.input_ids, seqs.attention_mask, seqs.response_mask)))
    mask = seqs.response_mask
    out = {}
    for packed in (False, True):
        leaves = {k: v.clone().requires_grad_() for k, v in params.items()}
        logprobs = response_logprobs(attrs.evolve(model, packed=packed), leaves, seqs)
        logprobs[mask].sum().backward()
        out[packed] = logprobs, {k: v.grad for k, v in leaves.items()}
    torch.testing.assert_close(out[True][0][mask], out[False][0][mask], rtol=0, atol=1e-5)
    for name, grad in out[False][1].items():
        torch.testing.assert_close(out[True][1][name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_a_packed_critic_on_cuda_gives_the_padded_values(tiny_lm):
    import attrs

    from purerl.models import critic_from_causal_lm, response_values

    model, params = tiny_lm(seed=0, device="cuda")
    critic, critic_params = critic_from_causal_lm(model, params)
    critic_params["value_head.weight"] = torch.randn_like(critic_params["value_head.weight"])
    seqs = random_sequences(8, 7, 9, 128, seed=3)
    seqs = type(seqs)(*(x.cuda() for x in (seqs.input_ids, seqs.attention_mask, seqs.response_mask)))
    values = {p: response_values(attrs.evolve(critic, packed=p), critic_params, seqs) for p in (False, True)}
    cells = seqs.attention_mask[:, -seqs.response_length - 1:-1]
    torch.testing.assert_close(values[True][cells], values[False][cells], rtol=0, atol=1e-5)


def test_the_main_job_runs_packed_with_a_bfloat16_engine_on_cuda(tmp_path):
    summary = _main_job(tmp_path, "actor.packed_forwards=true", "rollout.engine_options.dtype=bfloat16")
    assert summary["steps"] == 3


def test_the_main_job_runs_ppo_with_the_critic_on_its_own_pool_on_cuda(tmp_path):
    pytest.importorskip("ray")
    summary = _main_job(tmp_path, "--executor", "ray", "--placement", "split_collocate", "--adv-estimator", "gae",
                        "--train-ranks", "1", "--rollout-workers", "1", "--gpus-per-worker", "0.3")
    assert summary["steps"] == 3


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_main_job_distils_from_a_teacher_on_cuda(tmp_path, dtype):
    from tests.jobs import tiny_teacher

    teacher = tiny_teacher(tmp_path / "teacher")
    summary = _main_job(tmp_path / "run", "--dtype", dtype, "--teacher", str(teacher), "distill.loss_coef=0.5",
                        "distill.top_k=8")
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert summary["steps"] == 3 and all(r["distill/reverse_kl"] > 0 and r["actor/distill_loss"] > 0 for r in rows)
