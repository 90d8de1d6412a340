"""Routing replay on a perturbed engine: how often the trainer's experts differ from the engine's, and
how far the two forwards' log-probs of the sampled tokens drift apart, with replay off and on.

A tiny random Qwen3-MoE (transformers' ``Qwen3MoeConfig``: hidden 64, 3 layers, 2 of them sparse,
8 experts, top-2) scores random sequences twice: as the engine, perturbed, recording its experts;
and as the trainer (float32, the true weights), with and without replaying the engine's experts. The
perturbations: the engine's router weights with Gaussian noise (``router+x``: x times their mean
magnitude), and the engine computing in bfloat16 (``bfloat16``). Printed per perturbation: the share
of tokens whose experts differ (sparse layers, positions both forwards computed) and the mean
``|Δ log-prob|`` over response tokens, each replay off / on, and their ratio.

    python3 bench/routing_replay.py [--rows 32] [--seeds 0-4]
"""

import argparse

import torch
from transformers import Qwen3MoeConfig

from purerl.batch import Sequences
from purerl.models.families import llama
from purerl.models.families.moe import Routing, routing_mismatch
from purerl.tiny import random_sequences, tiny_causal_lm

VOCAB, TOP, LAYERS = 128, 2, 3
SPARSE = [0, 2]


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
    logits = llama.response_logits(computed, model.buffers["model.rotary_emb.inv_freq"], llama.layout_of(model.config),
                                   seqs.input_ids, seqs.attention_mask, seqs.position_ids(), seqs.response_length,
                                   None, None, routing)
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


def _seeds(text: str) -> list[int]:
    lo, _, hi = text.partition("-")
    return list(range(int(lo), int(hi or lo) + 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--seeds", default="0-4")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("| engine perturbation | experts differ, replay off | on | mean abs Δ log-prob, replay off | on | off/on |")
    print("|---|---|---|---|---|---|")
    for perturbation in ("router+0.1", "router+0.5", "bfloat16"):
        runs = [measure(perturbation, seed, args.rows) for seed in _seeds(args.seeds)]
        mean = {k: sum(r[k] for r in runs) / len(runs) for k in runs[0]}
        print(f"| {perturbation} | {mean['mismatch_off']:.1%} | {mean['mismatch_on']:.1%} | {mean['gap_off']:.2e} "
              f"| {mean['gap_on']:.2e} | {mean['gap_off'] / mean['gap_on']:.1f}× |")


if __name__ == "__main__":
    main()
