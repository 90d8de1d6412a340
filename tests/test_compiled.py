"""``actor.compile``: the lean padded forward (the cast to the compute dtype included) and the
log-probs compiled by ``torch.compile`` compute what the eager code computes: float32 to float
rounding, bfloat16 as close to float32 as the eager bfloat16 forward is. (Inductor's C++ backend
here; on a GPU, Triton: ``bench/bench_update.py --compile`` prints the same gap on the 0.5 B model.)"""

import attrs
import jaxtyping
import pytest
import torch

from purerl.algo.aggregation import aggregate_loss
from purerl.algo.logprobs import logprobs_from_logits
from purerl.models import response_logprobs, value_and_grad
from purerl.tiny import random_sequences, tiny_llama_config
from tests.jobs import parse

# dynamo reads .grad of the graph's non-leaf tensors while it traces (harmless; the suite makes warnings errors)
pytestmark = pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf:UserWarning")

CONFIG = tiny_llama_config(vocab_size=96, hidden_size=32, layers=1, num_attention_heads=4, num_key_value_heads=2,
                           intermediate_size=64)


@pytest.fixture(autouse=True)
def _untyped():
    """The suite's runtime type checks off: dynamo would trace them on its fake tensors."""
    jaxtyping.config.update("jaxtyping_disable", True)
    yield
    jaxtyping.config.update("jaxtyping_disable", False)


def _logprobs_and_gradient(model, params, seqs, weights):
    def loss(p):
        logp = response_logprobs(model, p, seqs, temperature=0.7)
        return aggregate_loss(-weights * logp, seqs.response_mask), logp

    _, logp, grads = value_and_grad(loss)(params)
    return logp, torch.cat([g.flatten() for g in grads.values()])


def _relative(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.slow
def test_the_compiled_forward_and_log_probs_compute_the_eager_ones(tiny_lm):
    model, params = tiny_lm(CONFIG, seed=0)
    seqs = random_sequences(4, 6, 7, CONFIG.vocab_size, seed=1)
    weights = torch.randn(seqs.response_mask.shape, generator=torch.Generator().manual_seed(2))
    logp, grad = _logprobs_and_gradient(model, params, seqs, weights)
    logp_c, grad_c = _logprobs_and_gradient(attrs.evolve(model, compiled=True), params, seqs, weights)
    assert (logp_c - logp).abs().max() < 1e-5
    assert _relative(grad_c, grad) < 1e-5
    bf16 = attrs.evolve(model, compute_dtype=torch.bfloat16)
    logp_b, grad_b = _logprobs_and_gradient(bf16, params, seqs, weights)
    logp_bc, grad_bc = _logprobs_and_gradient(attrs.evolve(bf16, compiled=True), params, seqs, weights)
    assert grad_bc.dtype == torch.float32  # gradients of the float32 masters
    eager_gap, compiled_gap = _relative(grad_b, grad), _relative(grad_bc, grad)
    assert 0 < compiled_gap < max(2 * eager_gap, 1e-2), (eager_gap, compiled_gap)
    assert (logp_bc - logp).abs().max() < 2 * (logp_b - logp).abs().max() + 1e-2


@pytest.mark.slow
def test_compiled_log_probs_keep_a_confident_tokens_precision():
    """The compiled kernels keep the eager blocks' formulas: ``log p`` and ``1 − p`` of a token
    holding nearly all the mass stay accurate in float32 (a plain ``z_y − logsumexp z`` rounds
    the gradient to 0)."""
    logits = torch.tensor([[[20.0, 3.0, 1.0], [0.5, 0.2, 0.1]]], requires_grad=True)
    labels = torch.tensor([[0, 2]])
    exact = torch.log_softmax(logits.double(), -1).gather(-1, labels[..., None]).squeeze(-1)
    grads = []
    for compiled in (False, True):
        logp = logprobs_from_logits(logits, labels, compiled=compiled)
        (grad,) = torch.autograd.grad(logp.sum(), logits)
        assert torch.allclose(logp.double(), exact, rtol=1e-6, atol=0), compiled
        assert grad[0, 0, 0] > 0 and torch.allclose(grad[0, 0, 0].double(), 1 - exact[0, 0].exp(), rtol=1e-4), compiled
        grads.append(grad)
    assert torch.allclose(grads[1], grads[0], rtol=1e-5, atol=1e-12)


def test_actor_compile_reaches_the_policy(tiny_lm):
    from purerl.assembly.models import _adapted

    model, params = tiny_lm(CONFIG, seed=0)
    assert _adapted(parse(["actor.compile=true"]).config, model, params)[0].compiled
    assert not _adapted(parse([]).config, model, params)[0].compiled
