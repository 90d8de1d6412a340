"""Packed training forwards (``actor.packed_forwards``): the rows' valid tokens run as one stream,
attention stays inside each row, and the log-probs, entropies, values and gradients are the
padded forward's (float64 here, so "equal" means to 1e-10) and each row's computed alone, on
both paths: the lean family's forward and the HF module's (and the critic's backbone).

A packed forward is where peers corrupted log-probs silently: a ``torch.roll`` over the packed
stream gave each sequence's last token the next sequence's first token as its label (verl#6475);
a missing position reset shifted rotary positions (OpenRLHF#217). The oracle here is each row run
by itself with no padding at all, and the last response token of every row is checked on its own.
"""

import attrs
import pytest
import torch

from purerl.algo.logprobs import entropy_from_logits, logprobs_from_logits
from purerl.batch import Sequences
from purerl.models import response_logits, shared_prompts
from purerl.models import value_and_grad as pure_value_and_grad
from purerl.tiny import random_sequences, tiny_causal_lm
from purerl.tree import tree_clone
from tests.test_llama import grouped

PATHS = ["lean", "HF module", "HF module, checkpointed"]


def _model(packed: bool, path: str = "lean"):
    """The tiny Llama in float64 (perturbed weights), through the lean forward or its HF module
    (with activation checkpointing: the module's path)."""
    model, params = tiny_causal_lm(seed=0, activation_checkpointing="checkpointed" in path)
    g = torch.Generator().manual_seed(1)
    params = {k: (v + 0.02 * torch.randn(v.shape, generator=g)).double() for k, v in params.items()}
    model = attrs.evolve(model, packed=packed, lean=path == "lean",
                         buffers={k: v.double() for k, v in model.buffers.items()})
    return model, params


def _extremes(seqs: Sequences) -> Sequences:
    """The same rows with row 0's response cut to one token and row 1's prompt and response full
    (no padding at all), besides the others' left-padded prompts and right-padded responses."""
    p = seqs.input_ids.shape[1] - seqs.response_length
    ids, mask, response = seqs.input_ids.clone(), seqs.attention_mask.clone(), seqs.response_mask.clone()
    mask[0, p + 1:] = response[0, 1:] = False
    ids[0, p + 1:] = 0
    mask[1] = response[1] = True
    ids[1] = torch.where(ids[1] == 0, 5, ids[1])
    return Sequences(ids, mask, response[:, :])


def _alone(model, params, seqs: Sequences, i: int) -> torch.Tensor:
    """Row ``i``'s response log-probs from a forward over that row's attended tokens alone."""
    mask = seqs.attention_mask[i]
    ids = seqs.input_ids[i][mask][None]
    responses = int(seqs.response_mask[i].sum())
    single = Sequences(ids, torch.ones_like(ids, dtype=torch.bool), torch.ones((1, responses), dtype=torch.bool))
    logits = response_logits(attrs.evolve(model, packed=False), params, single)
    return logprobs_from_logits(logits, single.responses())[0]


SEQS = {
    "left-padded prompts, right-padded responses": lambda: random_sequences(6, 7, 9, 128, seed=3),
    "a one-token response and a row with no padding": lambda: _extremes(random_sequences(6, 7, 9, 128, seed=3)),
    "shared prompts": lambda: grouped(random_sequences(8, 7, 9, 128, seed=4), 4),
}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("layout", list(SEQS))
def test_packed_logprobs_entropies_and_gradients_equal_the_padded_ones_and_each_row_alone(layout, path):
    seqs = SEQS[layout]()
    assert (shared_prompts(seqs) is not None) == (layout == "shared prompts")
    mask = seqs.response_mask
    g = torch.Generator().manual_seed(2)
    weights = torch.randn(mask.shape, generator=g, dtype=torch.float64)
    out = {}
    for packed in (False, True):
        model, params = _model(packed, path)

        def loss(p, seqs=seqs, model=model):
            logits = response_logits(model, p, seqs)
            logprobs = logprobs_from_logits(logits, seqs.responses())
            entropy = entropy_from_logits(logits)
            total = ((logprobs + 0.1 * entropy) * weights)[mask].sum()
            from purerl.algo.aggregation import SumCount

            return SumCount(total, torch.tensor(1.0, dtype=torch.float64)), (logprobs, entropy)

        _, (logprobs, entropy), grads = pure_value_and_grad(loss)(params)
        out[packed] = logprobs, entropy, grads
    (padded_lp, padded_h, padded_g), (packed_lp, packed_h, packed_g) = out[False], out[True]
    torch.testing.assert_close(packed_lp[mask], padded_lp[mask], rtol=0, atol=1e-10)
    torch.testing.assert_close(packed_h[mask], padded_h[mask], rtol=0, atol=1e-10)
    # The norms compute in float32 even here (as HF's RMSNorm does). Packed through the HF module,
    # the rows run their shared prompt each (the padded forward runs it once): a prompt's gradient
    # then passes the float32 norms' backward per row, not summed over its rows first, and rounds
    # differently (~3e-8 relative; row-wise sharing is exact to 1e-15 otherwise)
    rounded = path == "HF module" and layout == "shared prompts"  # (checkpointed: the padded forward shares none)
    for name, grad in padded_g.items():
        tolerance = dict(rtol=0, atol=1e-7 * float(grad.abs().max())) if rounded else dict(rtol=1e-9, atol=1e-11)
        torch.testing.assert_close(packed_g[name], grad, **tolerance, msg=name)
    model, params = _model(True, path)
    for i in range(len(seqs)):
        alone = _alone(model, params, seqs, i)
        n = len(alone)
        torch.testing.assert_close(packed_lp[i, :n], alone, rtol=0, atol=1e-10)
        assert abs(float(packed_lp[i, n - 1] - alone[-1])) < 1e-10  # the last label is the row's own


@pytest.mark.parametrize("path", PATHS)
def test_no_token_attends_across_a_row_and_a_rolled_label_would_be_caught(path):
    seqs = random_sequences(4, 5, 8, 128, seed=5)
    model, params = _model(True, path)
    before = response_logits(model, params, seqs)
    ids = seqs.input_ids.clone()
    ids[1] = torch.where(seqs.attention_mask[1], (ids[1] + 7) % 125 + 3, ids[1])  # another row 1
    after = response_logits(model, params, Sequences(ids, seqs.attention_mask, seqs.response_mask))
    for row in (0, 2, 3):
        torch.testing.assert_close(after[row], before[row], rtol=0, atol=1e-12)
    assert not torch.allclose(after[1], before[1])
    # the oracle sees a verl#6475-style bug: each row's last label taken from the next row's first token
    logprobs = logprobs_from_logits(before, seqs.responses())
    rolled_labels = seqs.responses().clone()
    for i in range(len(seqs) - 1):
        last = int(seqs.response_mask[i].sum()) - 1
        rolled_labels[i, last] = seqs.input_ids[i + 1][seqs.attention_mask[i + 1]][0]
    rolled = logprobs_from_logits(before, rolled_labels)
    for i in range(len(seqs) - 1):
        last = int(seqs.response_mask[i].sum()) - 1
        alone = _alone(model, params, seqs, i)
        assert abs(float(logprobs[i, last] - alone[-1])) < 1e-10
        assert abs(float(rolled[i, last] - alone[-1])) > 1e-3


STEPS = {"grpo, fixed rows": (None, False), "grpo, token budget": (40, False), "ppo with a critic": (40, True)}


@pytest.mark.parametrize("step", list(STEPS))
def test_a_step_with_packed_forwards_equals_the_padded_step(step):
    """The whole step (old and reference log-probs, KL loss, clipped update over micro-batches,
    fixed rows or a token budget; PPO: the critic's values and update too): the same metrics and
    params as padded, to float32 rounding (Adam divides by the gradients' scale: params to 1e-5,
    as across FSDP ranks)."""
    from purerl.assembly.stages import stage_settings_of
    from purerl.rollout.sampling import SamplingParams
    from purerl.state import RngState
    from purerl.step import grpo_step, ppo_step
    from tests.jobs import step_config
    from tests.test_step import PROMPTS, _scores, _setup

    max_tokens, ppo = STEPS[step]
    model, optimizer, kl_controller, state, engine, critic = _setup(critic=ppo)
    engine.sync(state.policy, 0)
    rollout = engine.generate(PROMPTS, SamplingParams(max_new_tokens=8, n=4, temperature=1.0), RngState(1))
    # the old log-probs recomputed (a forward of the policy, packed or not), as the docstring says
    config = step_config(kl_loss_coef=0.1, micro_batch_rows=5, max_tokens_per_micro_batch=max_tokens,
                         recompute_old_logprobs=True, **(dict(adv_estimator="gae", lam=0.95) if ppo else {}))
    results = {}
    for packed in (False, True):
        kwargs = dict(policy=attrs.evolve(model, packed=packed), optimizer=optimizer, kl_controller=kl_controller,
                      **stage_settings_of(config))
        if ppo:
            kwargs.update(critic=attrs.evolve(critic, packed=packed), critic_optimizer=optimizer)
        results[packed] = (ppo_step if ppo else grpo_step)(tree_clone(state), rollout, _scores(rollout), **kwargs)
    (padded, padded_metrics), (packed, packed_metrics) = results[False], results[True]
    assert packed_metrics.keys() == padded_metrics.keys()
    assert not ppo or "critic/vf_loss" in padded_metrics
    for key, value in padded_metrics.items():
        assert packed_metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    for name, value in padded.policy.items():
        torch.testing.assert_close(packed.policy[name], value, rtol=0, atol=1e-5)  # Adam: grads to ~1e-7
    for name, value in (padded.critic or {}).items():
        torch.testing.assert_close(packed.critic[name], value, rtol=0, atol=1e-5)


@pytest.mark.parametrize("layout", list(SEQS))
def test_packed_critic_values_and_gradients_equal_the_padded_ones(layout):
    """The critic (HF backbone + value head) packed: values at every response cell whose input is a
    token, and the value loss's gradients, as padded; a perturbed row leaves the others' values."""
    from purerl.models import critic_from_causal_lm, response_values

    seqs = SEQS[layout]()
    model, params = _model(False, "HF module")
    critic, critic_params = critic_from_causal_lm(model, params)
    critic = attrs.evolve(critic, buffers={k: v.double() for k, v in critic.buffers.items()})
    g = torch.Generator().manual_seed(6)
    critic_params["value_head.weight"] = torch.randn(critic_params["value_head.weight"].shape, generator=g).double()
    targets = torch.randn(seqs.response_mask.shape, generator=g, dtype=torch.float64)
    cells = seqs.attention_mask[:, -seqs.response_length - 1:-1]
    out = {}
    for packed in (False, True):
        packed_critic = attrs.evolve(critic, packed=packed)

        def loss(p, c=packed_critic):
            from purerl.algo.aggregation import SumCount

            values = response_values(c, p, seqs).double()
            return SumCount(((values - targets) ** 2)[seqs.response_mask].sum(), torch.tensor(1.0)), values

        out[packed] = pure_value_and_grad(loss)(critic_params)
    (_, padded, padded_g), (_, packed, packed_g) = out[False], out[True]
    torch.testing.assert_close(packed[cells], padded[cells], rtol=0, atol=1e-10)
    assert (packed[~cells] == 0).all()
    for name, grad in padded_g.items():
        torch.testing.assert_close(packed_g[name], grad, rtol=1e-9, atol=1e-11, msg=name)
    ids = seqs.input_ids.clone()
    ids[1] = torch.where(seqs.attention_mask[1], (ids[1] + 7) % 125 + 3, ids[1])
    other = response_values(attrs.evolve(critic, packed=True), critic_params,
                            Sequences(ids, seqs.attention_mask, seqs.response_mask))
    rows = [r for r in range(len(seqs)) if r != 1]
    torch.testing.assert_close(other[rows], packed[rows].float(), rtol=0, atol=1e-12)


def test_the_sharded_models_keep_packing():
    """The Ray executor's sharded policy and critic pack when their skeletons do: the lean ones over sharded
    params, and the FSDP2 wrappers of HF modules no family computes."""
    from purerl.executors.fsdp import ShardedCausalLM, ShardedCritic, ShardedLeanCritic, ShardedLeanLM, _as
    from purerl.models import critic_from_causal_lm

    model, params = _model(True)
    critic, _ = critic_from_causal_lm(model, params)
    for packed in (False, True):
        assert _as(ShardedLeanLM, attrs.evolve(model, packed=packed)).packed == packed
        assert _as(ShardedLeanCritic, attrs.evolve(critic, packed=packed)).backbone().packed == packed
        assert ShardedCausalLM.of(attrs.evolve(model, packed=packed, lean=False), []).packed == packed
        sharded = ShardedCritic.of(attrs.evolve(critic, packed=packed, lean=False), [])
        assert sharded.packed == packed and sharded.owners == {}


def test_a_module_whose_masks_ignore_the_row_boundaries_is_refused(monkeypatch):
    """Through the HF module, packing rests on transformers reading the rows off the positions; a
    module that does not (here: the detection switched off) would let rows attend to each other.
    The first packed forward checks it, once per module, and refuses."""
    import transformers.masking_utils

    from purerl.models import rows

    seqs = random_sequences(4, 5, 8, 128, seed=5)
    model, params = _model(True, "HF module")
    monkeypatch.setattr(transformers.masking_utils, "find_packed_sequence_indices", lambda positions: None)
    with pytest.raises(ValueError, match="lets a packed row attend to the row before it"):
        response_logits(model, params, seqs)
    monkeypatch.undo()
    response_logits(model, params, seqs)  # checked once: passes, then remembered
    assert model.module in rows._KEEPS_ROWS_APART


def test_a_critic_whose_masks_ignore_the_row_boundaries_is_refused(monkeypatch):
    import transformers.masking_utils

    from purerl.models import critic_from_causal_lm, response_values

    seqs = random_sequences(4, 5, 8, 128, seed=5)
    model, params = _model(False, "HF module")
    critic, critic_params = critic_from_causal_lm(model, params)
    critic = attrs.evolve(critic, packed=True, buffers={k: v.double() for k, v in critic.buffers.items()},
                          lean=False)  # its HF module: the lean forward keeps rows apart itself
    critic_params["value_head.weight"] = torch.randn(critic_params["value_head.weight"].shape,
                                                     generator=torch.Generator().manual_seed(0)).double()
    monkeypatch.setattr(transformers.masking_utils, "find_packed_sequence_indices", lambda positions: None)
    with pytest.raises(ValueError, match="lets a packed row attend to the row before it"):
        response_values(critic, critic_params, seqs)
    monkeypatch.undo()
    response_values(critic, critic_params, seqs)
