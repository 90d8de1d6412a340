"""Routing replay on a perturbed engine: how often the trainer's experts differ from the engine's, and
how far the two forwards' log-probs of the sampled tokens drift apart, with replay off and on.

A tiny random Qwen3-MoE (transformers' ``Qwen3MoeConfig``: hidden 64, 3 layers, 2 of them sparse,
8 experts, top-2) scores random sequences twice: as the engine, perturbed, recording its experts;
and as the trainer (float32, the true weights), with and without replaying the engine's experts. The
perturbations: the engine's router weights with Gaussian noise (``router+x``: x times their mean
magnitude), and the engine computing in bfloat16 (``bfloat16``). Printed per perturbation: the share
of tokens whose experts differ (sparse layers, positions both forwards computed) and the mean
``|Δ log-prob|`` over response tokens, each replay off / on, and their ratio.

Then the same through the pipeline: the embedded engine (``TorchEngine``, perturbed as above) samples
groups of 4 for 3 prompts (12 new tokens, temperature 1), and one step of the custom-steps guide
(``make_experience``, ``shape_rewards``, ``actor_update``) reports ``rollout/routing_mismatch`` (the
share of token-layers where the trainer's router disagrees with the engine's record) and
``actor/sync_gap`` (the engine's log-probs against the update's first forward), replay off / on.

    python3 bench/routing_replay.py [--rows 32] [--seeds 0-4]
    python3 bench/routing_replay.py --smoke     # 4 rows, one seed: not a measurement
"""

import argparse
import sys

import torch
from transformers import Qwen3MoeConfig

from purerl.batch import Sequences
from purerl.models.families import decoder
from purerl.models.families.moe import Routing, routing_mismatch
from purerl.tiny import random_sequences, tiny_causal_lm

VOCAB, TOP, LAYERS = 128, 2, 3
SPARSE = [0, 2]
SMOKE = ["--rows", "4", "--seeds", "0"]
"""What ``--smoke`` stands for: the smallest sizes that run every step of the bench."""


def _model(seed: int):
    config = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=32, moe_intermediate_size=32,
                            num_experts=8, num_experts_per_tok=TOP, norm_topk_prob=True, mlp_only_layers=[1],
                            max_position_embeddings=256, pad_token_id=0, eos_token_id=1, bos_token_id=2,
                            initializer_range=0.1)
    model, params = tiny_causal_lm(config, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    return model, {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in params.items()}


def _logprobs(model, params, seqs: Sequences, routing: Routing) -> torch.Tensor:
    computed = {k: v.to(next(iter(params.values())).dtype) for k, v in model.computed(params).items()}
    logits = decoder.response_logits(computed, model.buffers["model.rotary_emb.inv_freq"],
                                     decoder.layout_of(model.config), seqs.input_ids, seqs.attention_mask,
                                     seqs.position_ids(), seqs.response_length, None, None, routing)
    return logits.float().log_softmax(-1).gather(-1, seqs.responses()[..., None])[..., 0]


def _engine_params(params, perturbation: str, seed: int):
    if perturbation == "bfloat16":
        return {k: v.bfloat16() for k, v in params.items()}
    scale = float(perturbation.removeprefix("router+"))
    g = torch.Generator().manual_seed(seed + 7)
    return {k: v + scale * v.abs().mean() * torch.randn(v.shape, generator=g) if k.endswith("mlp.gate.weight") else v
            for k, v in params.items()}


def measure(perturbation: str, seed: int, rows: int) -> dict[str, float]:
    model, params = _model(seed)
    seqs = random_sequences(rows, 12, 16, VOCAB, seed=seed + 3)
    blank = torch.full((*seqs.input_ids.shape, LAYERS, TOP), -1, dtype=torch.int16)
    engine = blank.clone()
    with torch.no_grad():
        behaviour = _logprobs(model, _engine_params(params, perturbation, seed), seqs, Routing(record=engine))
        out = {}
        for replay in (False, True):
            trainer = blank.clone()
            logprobs = _logprobs(model, params, seqs, Routing(replay=engine if replay else None, record=trainer))
            key = "on" if replay else "off"
            out[f"gap_{key}"] = (logprobs - behaviour)[seqs.response_mask].abs().mean().item()
            out[f"mismatch_{key}"] = routing_mismatch(engine[:, :, SPARSE], trainer[:, :, SPARSE]).item()
    return out


def step_metrics(perturbation: str, seed: int, replay: bool) -> dict[str, float]:
    import attrs

    from purerl.algo import PolicyLossSettings
    from purerl.algo.estimators import ADVANTAGE_ESTIMATORS
    from purerl.algo.kl_control import make_kl_controller
    from purerl.algo.policy_loss import POLICY_LOSSES
    from purerl.optim import adamw
    from purerl.rollout.backends.torch import TorchEngine
    from purerl.rollout.sampling import SamplingParams
    from purerl.state import RngState, TrainState
    from purerl.step import (
        ActorLoss,
        Batching,
        ExperienceSettings,
        Shaping,
        actor_update,
        make_experience,
        shape_rewards,
    )

    model, params = _model(seed)
    engine = TorchEngine(model, eos_token_ids=[1], pad_token_id=0, dtype="bfloat16" if perturbation == "bfloat16"
                         else None)
    engine.sync(params if perturbation == "bfloat16" else _engine_params(params, perturbation, seed), 0)
    rollout = engine.generate([[5, 6, 7, 8], [9, 10], [11, 12, 13]],
                              SamplingParams(max_new_tokens=12, n=4, temperature=1.0), RngState(seed))
    responses, mask = rollout.sequences.responses(), rollout.sequences.response_mask
    scores = ((responses % 2 == 0) & mask).float().sum(-1) / mask.sum(-1).clamp_min(1)
    policy = attrs.evolve(model, routing_replay=replay)
    state = TrainState(policy=params, policy_opt=(), kl=(), rng=RngState(seed))
    experience = make_experience(state, rollout, scores, policy=policy, settings=ExperienceSettings())
    batch, _, metrics = shape_rewards(experience, state.kl, make_kl_controller("fixed", coef=0.0),
                                      shaping=Shaping(ADVANTAGE_ESTIMATORS["grpo"].bound()))
    optimizer = adamw(1e-6)
    loss = ActorLoss(POLICY_LOSSES["cispo"].bound(PolicyLossSettings()), sync_tolerance=100.0)
    _, _, actor = actor_update(params, optimizer.init(params), batch, policy=policy, loss=loss, batching=Batching(),
                               optimizer=optimizer, rng=state.rng)
    return {"mismatch": metrics["rollout/routing_mismatch"], "sync_gap": actor["actor/sync_gap"]}


def _seeds(text: str) -> list[int]:
    lo, _, hi = text.partition("-")
    return list(range(int(lo), int(hi or lo) + 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--seeds", default="0-4")
    parser.add_argument("--smoke", action="store_true",
                        help=f"seconds, not a measurement: {' '.join(SMOKE)} (flags given win)")
    args = parser.parse_args()
    if args.smoke:
        args = parser.parse_args([*SMOKE, *sys.argv[1:]])
    torch.set_num_threads(1)
    print("| engine perturbation | experts differ, replay off | on | mean abs Δ log-prob, replay off | on | off/on |")
    print("|---|---|---|---|---|---|")
    for perturbation in ("router+0.1", "router+0.5", "bfloat16"):
        runs = [measure(perturbation, seed, args.rows) for seed in _seeds(args.seeds)]
        mean = {k: sum(r[k] for r in runs) / len(runs) for k in runs[0]}
        print(f"| {perturbation} | {mean['mismatch_off']:.1%} | {mean['mismatch_on']:.1%} | {mean['gap_off']:.2e} "
              f"| {mean['gap_on']:.2e} | {mean['gap_off'] / mean['gap_on']:.1f}× |")
    print()
    print("| engine perturbation | rollout/routing_mismatch, replay off | on | actor/sync_gap, replay off | on "
          "| off/on |")
    print("|---|---|---|---|---|---|")
    for perturbation in ("router+0.1", "router+0.5", "bfloat16"):
        runs = {replay: [step_metrics(perturbation, seed, replay) for seed in _seeds(args.seeds)]
                for replay in (False, True)}
        mean = {(replay, k): sum(r[k] for r in runs[replay]) / len(runs[replay])
                for replay in runs for k in runs[replay][0]}
        print(f"| {perturbation} | {mean[False, 'mismatch']:.1%} | {mean[True, 'mismatch']:.1%} "
              f"| {mean[False, 'sync_gap']:.2e} | {mean[True, 'sync_gap']:.2e} "
              f"| {mean[False, 'sync_gap'] / mean[True, 'sync_gap']:.1f}× |")


if __name__ == "__main__":
    main()
