"""purerl's GRPO update against TRL's ``GRPOTrainer`` on one identical batch: the same prompts, the
same sampled responses (some ended by EOS, some cut at the length limit), the same rewards, the
main job's settings (``experiments/grpo_math.py``: clip 0.2/0.28, token-mean, no KL, its sampling
temperature, lr 2e-5 with a 2-step warm-up and a cosine to 0.1×, global-norm clipping at 1.0, AdamW).

TRL's side is its own trainer: its ``rollout_func`` hands it the fixed responses, and its data
flow, advantages, loss, clipping, schedule and AdamW step do the rest. Both sides start from the
same weights; two steps run, so the warm-up's first step (lr 0 on both), AdamW's moments and
bias correction are all exercised. The tiny model's gradient norm (~0.8) stays under the main
job's clip of 1.0, where the main job's are mostly above it; so a second case clips at 0.25 and
runs four steps: every step is clipped, and steps 3 and 4 start from params that the clipped
updates moved.

Where the two differ on purpose (``DIFFERENCES``), the test accounts for the difference by name:
- the advantage's epsilon: purerl follows verl, ``(r − μ)/(σ + 1e-6)``; TRL divides by
  ``σ + 1e-4``. Both use the unbiased (N − 1) std of the group. AdamW's first steps are
  invariant to the scale of the gradient, so the params agree anyway; the gradients are compared
  after rescaling TRL's by the ratio of the denominators.
- left padding: TRL's training forward numbers positions from the padded start, purerl from each
  row's first token (RoPE depends on differences only, so the logits agree up to rounding); the
  prompts here have one length, so neither pads.
"""

import tempfile
from pathlib import Path

import pytest
import torch

trl = pytest.importorskip("trl")

from transformers import AutoModelForCausalLM  # noqa: E402

from purerl.assembly.stages import actor_batching_of, actor_optimizer, kl_controller_of, stage_settings_of  # noqa: E402
from purerl.batch import left_pad, rollout_of  # noqa: E402
from purerl.config.job import JobConfig  # noqa: E402
from purerl.config.loading import build  # noqa: E402
from purerl.models.hf import export_hf  # noqa: E402
from purerl.optim.base import Optimizer  # noqa: E402
from purerl.rollout.sampling import SamplingParams  # noqa: E402
from purerl.run import initial_state  # noqa: E402
from purerl.step import grpo_step  # noqa: E402
from purerl.step.experience import reference_logprobs  # noqa: E402
from purerl.tiny import char_tokenizer  # noqa: E402
from purerl.tree import tree_clone  # noqa: E402

DIFFERENCES = {"advantage epsilon": (1e-6, 1e-4), "positions under left padding": "none here: equal prompt lengths"}
PROMPTS = ["12+34=", "56-78=", "3*3="]
N, MAX_NEW, TEMPERATURE = 4, 10, SamplingParams().temperature
SETTINGS = {"rollout": {"temperature": TEMPERATURE, "n": N, "max_new_tokens": MAX_NEW},
            "data": {"prompts_per_step": len(PROMPTS)}, "trainer": {"steps": 30},
            "actor": {"lr": 2e-5, "warmup_steps": 2, "min_lr_ratio": 0.1, "clip_low": 0.2, "clip_high": 0.28,
                      "loss_agg": "token-mean", "grad_clip": 1.0, "weight_decay": 0.0, "micro_batch_rows": N * 2}}


def _batch(tokenizer):
    """Per prompt, ``N`` responses (ids) and their rewards: two groups with different spreads and
    one whose rewards are all equal (zero advantages: purerl skips its rows' forward and backward,
    TRL runs them; both count their tokens in the loss's denominator), responses of several
    lengths, ended by EOS or cut at ``MAX_NEW``."""
    eos = tokenizer.eos_token_id
    texts = [["46", "4 6", "47 is it", "0123456789"], ["-22", "-2 2", "22", "minus twenty"],
             ["6", "33", "nine or so", "3*3 is 6, 6+3"]]
    rewards = [[1.0, 0.5, 0.0, 0.0], [0.0, 1.0, 0.0, 0.5], [0.0] * N]  # one std: one factor between the epsilons
    responses = []
    for group in texts:
        for text in group:
            ids = tokenizer.encode(text, add_special_tokens=False)[:MAX_NEW]
            responses.append(ids + [eos] if len(ids) < MAX_NEW else ids)  # a cut response has no EOS
    return responses, [r for group in rewards for r in group]


def _settings(grad_clip: float) -> dict:
    return {**SETTINGS, "actor": {**SETTINGS["actor"], "grad_clip": grad_clip}}


def _purerl(model, params, tokenizer, responses, rewards, steps, grad_clip):
    """purerl's job step ``steps`` times on the batch; the params, and the raw gradient of each step."""
    config = build(JobConfig, _settings(grad_clip))
    prompt_ids, prompt_mask = left_pad([tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS],
                                       tokenizer.pad_token_id)
    width = max(map(len, responses))
    tokens = torch.full((len(responses), width), tokenizer.pad_token_id)
    alive = torch.zeros((len(responses), width), dtype=torch.bool)
    for row, ids in enumerate(responses):
        tokens[row, :len(ids)], alive[row, :len(ids)] = torch.tensor(ids), True
    reasons = torch.tensor([0 if ids[-1] == tokenizer.eos_token_id else 1 for ids in responses])
    rollout = rollout_of(prompt_ids, prompt_mask, tokens, torch.zeros(tokens.shape), alive, reasons, N, 0, TEMPERATURE)
    state = initial_state(config, params)
    optimizer, grads = actor_optimizer(config), []
    recording = Optimizer(optimizer.init,  # the gradients as they come: a donating chain clips them in place
                          lambda g, s, p, **k: (grads.append(tree_clone(g)), optimizer.update(g, s, p, **k))[1])
    for _ in range(steps):
        behaviour = reference_logprobs(model, state.policy, rollout.sequences, temperature=config.rollout.temperature,
                                       batching=actor_batching_of(config))
        step_rollout = rollout_of(prompt_ids, prompt_mask, tokens, behaviour, alive, reasons, N, state.step,
                                  config.rollout.temperature)
        state, metrics = grpo_step(state, step_rollout, torch.tensor(rewards), policy=model,
                                   optimizer=recording, kl_controller=kl_controller_of(config),
                                   **stage_settings_of(config))
    return state.policy, grads, metrics


def _trl(model, tokenizer, responses, rewards, steps, grad_clip, tmp):
    """TRL's trainer ``steps`` times on the batch (its rollout_func hands over the responses); the
    params, each step's raw gradient (before clipping) and its advantages."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    by_prompt = {p: responses[i * N:(i + 1) * N] for i, p in enumerate(PROMPTS)}
    reward_of = {tuple(ids): r for ids, r in zip(responses, rewards)}
    assert len(reward_of) == len(responses)

    def rollout_func(prompts, trainer):
        seen: dict[str, int] = {}
        completions = []
        for prompt in prompts:
            completions.append(by_prompt[prompt][seen.get(prompt, 0)])
            seen[prompt] = seen.get(prompt, 0) + 1
        return {"prompt_ids": [tokenizer.encode(p, add_special_tokens=False) for p in prompts],
                "completion_ids": completions, "logprobs": [[0.0] * len(c) for c in completions]}

    def reward(prompts, completions, completion_ids, **_):
        return [reward_of[tuple(ids)] for ids in completion_ids]

    grads, advantages = [], []

    class Capture(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            control.should_training_stop = state.global_step >= steps

    actor = SETTINGS["actor"]
    args = GRPOConfig(output_dir=tmp, use_cpu=True, bf16=False, max_steps=SETTINGS["trainer"]["steps"],
                      per_device_train_batch_size=N * len(PROMPTS), num_generations=N, max_completion_length=MAX_NEW,
                      learning_rate=actor["lr"], warmup_steps=actor["warmup_steps"],
                      lr_scheduler_type="cosine_with_min_lr",
                      lr_scheduler_kwargs={"min_lr_rate": actor["min_lr_ratio"]},
                      max_grad_norm=grad_clip, weight_decay=0.0, beta=0.0, loss_type="dapo", epsilon=0.2,
                      epsilon_high=0.28, temperature=TEMPERATURE, scale_rewards="group", report_to="none",
                      save_strategy="no", logging_steps=1, disable_tqdm=True, seed=0, shuffle_dataset=False)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, processing_class=tokenizer,
                          train_dataset=Dataset.from_dict({"prompt": PROMPTS}), rollout_func=rollout_func,
                          callbacks=[Capture()])
    compute_loss = trainer.compute_loss

    def capturing(model, inputs, *a, **k):
        advantages.append(inputs["advantages"].detach().clone())
        return compute_loss(model, inputs, *a, **k)

    trainer.compute_loss = capturing
    clip = trainer.accelerator.clip_grad_norm_

    def clip_capturing(parameters, *a, **k):
        parameters = list(parameters)
        grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})
        return clip(parameters, *a, **k)

    trainer.accelerator.clip_grad_norm_ = clip_capturing
    trainer.train()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, grads, advantages


@pytest.mark.parametrize("grad_clip, steps", [(1.0, 2), (0.25, 4)], ids=["main-job-clip", "clipped-4-steps"])
def test_one_batch_gives_trls_params_and_gradients_up_to_the_named_differences(tiny_lm, monkeypatch, grad_clip, steps):
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    tokenizer = char_tokenizer()
    model, params = tiny_lm(vocab_size=len(tokenizer) + 8, seed=0)
    start = {k: v.clone() for k, v in params.items()}
    responses, rewards = _batch(tokenizer)
    with tempfile.TemporaryDirectory() as tmp:
        hf = AutoModelForCausalLM.from_pretrained(export_hf(model, params, Path(tmp) / "start"))  # the same weights
        theirs, their_grads, their_advantages = _trl(hf, tokenizer, responses, rewards, steps, grad_clip, tmp)
    ours, our_grads, metrics = _purerl(model, params, tokenizer, responses, rewards, steps, grad_clip)
    assert metrics["actor/skipped_rows_frac"] == pytest.approx(1 / 3)  # the zero-advantage group skipped

    # the advantages: the same up to the epsilon in the denominator (both varied groups have one
    # std; the third group's are 0 on both sides)
    scores = torch.tensor(rewards).view(len(PROMPTS), N)
    std = float(scores.std(-1)[0])
    assert torch.allclose(scores.std(-1), torch.tensor([std, std, 0.0]))
    ours_eps, theirs_eps = DIFFERENCES["advantage epsilon"]
    factor = (std + ours_eps) / (std + theirs_eps)
    ours_adv = (scores - scores.mean(-1, keepdim=True)) / (std + ours_eps)
    expected = sorted((ours_adv * factor).flatten().tolist())
    assert sorted(their_advantages[0].flatten().tolist()) == pytest.approx(expected, rel=1e-6, abs=1e-7)

    # each step's raw gradient (before clipping): TRL's is purerl's times that factor
    assert len(our_grads) == len(their_grads) == steps
    norms = [float(torch.nn.utils.get_total_norm(list(step.values()))) for step in our_grads]
    assert all(n < 1.0 for n in norms) if grad_clip == 1.0 else all(n > 2 * grad_clip for n in norms), norms
    for step, (ours_g, theirs_g) in enumerate(zip(our_grads, their_grads), 1):
        assert ours_g.keys() == theirs_g.keys()
        for name, g in ours_g.items():
            scale = float(g.abs().max())
            assert scale > 0 and torch.allclose(g * factor, theirs_g[name], rtol=1e-5, atol=1e-6 * scale), (step, name)

    # the params after the steps: step 1 has lr 0 on both sides, step 2 lr / 2 with AdamW's moments
    # of both steps; AdamW's step is invariant to the gradient's scale, and a clipped gradient
    # has the clip's norm, so the epsilon drops out
    for name, value in ours.items():
        assert not torch.equal(value, start[name]), name  # every tensor took the update
        assert torch.allclose(value, theirs[name], rtol=1e-6, atol=1e-6 * float(start[name].abs().max())), name
