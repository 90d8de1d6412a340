"""The CUDA paths: fused capturable AdamW, the engine, a GRPO step, an FSDP2 rank over NCCL.

Skipped without a GPU (CI has none); run on a GPU machine with ``python3 -m pytest tests/test_gpu.py``.
"""

import functools
import socket

import pytest
import torch

from purerl.algo.kl_control import make_kl_controller
from purerl.model import causal_lm_from_config, response_logprobs
from purerl.optim import adamw, chain, clip_by_global_norm, warmup_cosine_schedule
from purerl.rollout.engine import TorchEngine
from purerl.rollout.sampling import SamplingParams
from purerl.state import RngState, TrainState
from purerl.step import StepConfig, grpo_step
from purerl.tiny import tiny_llama_config
from purerl.tree import tree_clone, tree_map

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]


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


def _setup():
    model, params = causal_lm_from_config(tiny_llama_config(hidden_size=64), seed=0, device="cuda")
    optimizer = chain(clip_by_global_norm(1.0), adamw(1e-3, weight_decay=0.01))
    kl = make_kl_controller("fixed", coef=0.001)
    step_fn = functools.partial(grpo_step, optimizer=optimizer, kl_controller=kl,
                                config=StepConfig(use_kl_loss=True, kl_loss_coef=0.1, micro_batch_rows=5))

    def fresh():
        p = tree_clone(params)
        return TrainState(policy=p, policy_opt=optimizer.init(p), kl=kl.init(), rng=RngState(0),
                          reference=tree_clone(p))

    engine = TorchEngine(model, eos_token_ids=[1], pad_token_id=0, device="cuda")
    engine.sync(params, 0)
    rollout = engine.generate(PROMPTS, SamplingParams(max_new_tokens=8, n=4), RngState(1), version=0)
    responses, mask = rollout.sequences.responses(), rollout.sequences.response_mask
    scores = ((responses % 2 == 0) & mask).float().sum(-1) / mask.sum(-1).clamp_min(1)
    return model, params, step_fn, fresh, rollout, scores


def test_engine_behaviour_logprobs_equal_the_trainers_on_cuda():
    model, params, _, _, rollout, _ = _setup()
    assert rollout.sequences.input_ids.device.type == "cuda"
    mask = rollout.sequences.response_mask
    trainer = response_logprobs(model, params, rollout.sequences)
    torch.testing.assert_close(trainer[mask], rollout.behaviour_logprobs[mask], rtol=0, atol=1e-4)


def test_cuda_graph_decoding_samples_what_eager_decoding_samples():
    model, params = causal_lm_from_config(tiny_llama_config(hidden_size=64), seed=0, device="cuda")
    rollouts = []
    for graphs in (True, False):
        engine = TorchEngine(model, eos_token_ids=[1], pad_token_id=0, device="cuda", cuda_graphs=graphs)
        engine.sync(params, 0)
        rollouts.append(engine.generate(PROMPTS, SamplingParams(max_new_tokens=12, n=3), RngState(2)))
    assert torch.equal(rollouts[0].sequences.input_ids, rollouts[1].sequences.input_ids)
    torch.testing.assert_close(rollouts[0].behaviour_logprobs, rollouts[1].behaviour_logprobs, rtol=0, atol=1e-5)


def test_a_grpo_step_on_cuda_matches_the_same_step_on_cpu():
    model, params, step_fn, fresh, rollout, scores = _setup()
    gpu_state, gpu_metrics = step_fn(fresh(), rollout, scores, policy=model)
    cpu = lambda t: t.cpu() if isinstance(t, torch.Tensor) else t  # noqa: E731
    cpu_model, _ = causal_lm_from_config(tiny_llama_config(hidden_size=64), seed=0)
    cpu_state, cpu_metrics = step_fn(tree_map(cpu, fresh()), tree_map(cpu, rollout), scores.cpu(), policy=cpu_model)
    # one Adam step moves a weight by about lr = 1e-3 whatever the gradient's size, so where a
    # gradient is ~0 the kernels' last-bit differences may move it differently: allow 10 % of lr
    for name, value in cpu_state.policy.items():
        torch.testing.assert_close(gpu_state.policy[name].cpu(), value, rtol=0, atol=1e-4)
    for key, value in cpu_metrics.items():
        assert gpu_metrics[key] == pytest.approx(value, rel=1e-4, abs=1e-5), key


def test_an_fsdp2_nccl_rank_matches_the_local_step_on_cuda():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from purerl.executors.fsdp import (
        ShardedCausalLM,
        full_params,
        shard_causal_lm,
        shard_like,
        sharded_value_and_grad,
    )

    model, params, step_fn, fresh, rollout, scores = _setup()
    local_state, local_metrics = step_fn(fresh(), rollout, scores, policy=model)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cuda", (1,))
        state = fresh()
        module, sharded = shard_causal_lm(model, state.policy, mesh=mesh)
        ref_module, ref = shard_causal_lm(model, state.reference, mesh=mesh, trainable=False)
        sharded_model = ShardedCausalLM.of(model, [(module, sharded), (ref_module, ref)])
        state = TrainState(policy=sharded, policy_opt=shard_like(state.policy_opt, sharded), kl=state.kl,
                           rng=state.rng, reference=ref)
        state, metrics = step_fn(state, rollout, scores, policy=sharded_model,
                                 value_and_grad=sharded_value_and_grad(0, 1))
        full = full_params(state.policy)
    finally:
        dist.destroy_process_group()
    for name, value in local_state.policy.items():
        torch.testing.assert_close(full[name], value, rtol=0, atol=1e-5)
    for key, value in local_metrics.items():
        assert metrics[key] == pytest.approx(value, rel=1e-4, abs=1e-5), key


def test_the_main_job_runs_on_cuda(tmp_path):
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "experiments" / "grpo_math.py"
    subprocess.run([sys.executable, str(script), "--tiny", "--device", "cuda", "--steps", "3", "--eval-every", "2",
                    "--checkpoint-every", "2", "--eval-size", "8", "--no-progress", "--out-dir", str(tmp_path)],
                   check=True, timeout=600)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 3 and (tmp_path / "checkpoints" / "step_00000002").is_dir()
