"""purerl's sampler against HF ``generate`` as TRL's ``GRPOTrainer`` calls it, at one state.

Both draw 4 responses (≤ 48 new tokens, temperature 0.7, no top-k or top-p: the main job's
settings) for the same 64 training prompts of the main job, and one HF float32 forward scores every
response alike. Per draw it prints the mean length, the fraction cut at the limit, the token-mean
entropy and log-prob of the sampled tokens (both at the temperature) and the mean reward. If the
two samplers draw from one distribution, each figure differs between them by sampling noise only.

    python3 bench/sampler_twin.py --side purerl --draw 0                  # the main job's model
    python3 bench/sampler_twin.py --side hf --draw 0 --model runs/x/export # at a trained state
    python3 bench/sampler_twin.py --side hf --smoke    # the main job's --tiny model, 4 prompts: not a measurement

Draw ``d`` takes the training prompts ``200 + 64·d`` … ``263 + 64·d`` and seeds its sampler with
``1000 + d`` (purerl: the engine's counter-based streams; HF: torch's global generator).
"""

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from purerl.batch import left_pad  # noqa: E402
from purerl.config.command_line import parse_command_line  # noqa: E402
from purerl.models.hf import export_hf  # noqa: E402
from purerl.rewards import lenient_math_reward  # noqa: E402
from purerl.rollout.backends.torch import TorchEngine  # noqa: E402
from purerl.rollout.sampling import SamplingParams  # noqa: E402
from purerl.run import engine_options, load_policy, load_records_of, load_tasks, reward_of  # noqa: E402
from purerl.state import RngState  # noqa: E402

PROMPTS, N, MAX_NEW, TEMPERATURE, CHUNK = 64, 4, 48, 0.7, 16
SMOKE_PROMPTS = 4
"""``--smoke``: this many prompts a draw, on the main job's ``--tiny`` model."""


def purerl_responses(model, params, options, prompts: list[list[int]], draw: int) -> list[list[int]]:
    """``N`` responses per prompt from purerl's embedded engine, each up to and including its EOS."""
    engine = TorchEngine(model, **{k: options[k] for k in ("eos_token_ids", "pad_token_id", "decode")})
    engine.sync(params, 0)
    out = []
    for start in range(0, len(prompts), CHUNK):
        rollout = engine.generate(prompts[start:start + CHUNK], SamplingParams(max_new_tokens=MAX_NEW,
                                  temperature=TEMPERATURE, n=N), RngState(1000 + draw, start), version=0)
        mask, responses = rollout.sequences.response_mask, rollout.sequences.responses()
        out += [responses[i][mask[i]].tolist() for i in range(responses.shape[0])]
    engine.close()
    return out


def hf_responses(hf, tokenizer, options, prompts: list[list[int]], draw: int) -> list[list[int]]:
    """``N`` responses per prompt from HF ``generate`` with the generation config TRL 1.16's
    ``GRPOTrainer`` builds (each prompt repeated ``N`` times in a left-padded batch)."""
    from transformers import GenerationConfig

    eos, pad = list(options["eos_token_ids"]), options["pad_token_id"]
    config = GenerationConfig(max_new_tokens=MAX_NEW, do_sample=True, pad_token_id=pad,
                              bos_token_id=tokenizer.bos_token_id, eos_token_id=eos, temperature=TEMPERATURE,
                              top_p=1.0, top_k=0, min_p=None, repetition_penalty=1.0, disable_compile=True)
    torch.manual_seed(1000 + draw)
    out = []
    for start in range(0, len(prompts), CHUNK):
        batch = [p for p in prompts[start:start + CHUNK] for _ in range(N)]
        ids, attention = left_pad(batch, pad)
        with torch.no_grad():
            generated = hf.generate(input_ids=ids, attention_mask=attention.long(),
                                    generation_config=config)[:, ids.shape[1]:]
        for row in generated.tolist():
            ends = [j for j, t in enumerate(row) if t in eos]
            out.append(row[:ends[0] + 1] if ends else row)
    return out


def scored(hf, tokenizer, eos: list[int], prompts: list[list[int]], responses: list[list[int]],
           truths: list[str]) -> dict:
    """The figures of one draw, every response scored by ``hf`` (float32) at the temperature."""
    entropy, logprob, lengths, cut, reward = [], [], [], [], []
    with torch.no_grad():
        for i, response in enumerate(responses):
            prompt = prompts[i // N]
            logits = hf(torch.tensor([prompt + response])).logits[0, len(prompt) - 1:-1].float() / TEMPERATURE
            lp = torch.log_softmax(logits, -1)
            entropy += (-(lp.exp() * lp).sum(-1)).tolist()
            logprob += lp.gather(-1, torch.tensor(response)[:, None]).squeeze(-1).tolist()
            lengths.append(len(response))
            cut.append(response[-1] not in eos)
            reward.append(lenient_math_reward(tokenizer.decode(response, skip_special_tokens=True), truths[i // N]))
    return {"responses": len(responses), "length": statistics.fmean(lengths), "cut": statistics.fmean(cut),
            "entropy": statistics.fmean(entropy), "logprob": statistics.fmean(logprob),
            "reward": statistics.fmean(reward)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--side", choices=["purerl", "hf"], required=True)
    ap.add_argument("--draw", type=int, default=0)
    ap.add_argument("--model", help="HF directory or GGUF (default: the main job's model)")
    ap.add_argument("--out", default="runs/sampler_twin")
    ap.add_argument("--smoke", action="store_true",
                    help=f"seconds, not a measurement: the main job's --tiny model, {SMOKE_PROMPTS} prompts a draw")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    flags = ["--eval-size", "8", *(["--model", args.model] if args.model else []), *(["--tiny"] if args.smoke else [])]
    config = parse_command_line(flags, prog="sampler_twin", default_out_dir=str(out / "unused")).config
    train_records, eval_records, _ = load_records_of(config)
    model, params, tokenizer = load_policy(config)
    options = engine_options(config, model, tokenizer)
    task, _, _ = load_tasks(config, train_records, eval_records, tokenizer, reward_of(config))
    count = SMOKE_PROMPTS if args.smoke else PROMPTS
    chosen = range(200 + count * args.draw, 200 + count * (args.draw + 1))
    prompts = [list(task.prompt_ids[i]) for i in chosen]
    truths = [task.records[i].ground_truth for i in chosen]
    hf = AutoModelForCausalLM.from_pretrained(export_hf(model, params, out / "hf", tokenizer),
                                              dtype=torch.float32).eval()
    responses = (purerl_responses(model, params, options, prompts, args.draw) if args.side == "purerl"
                 else hf_responses(hf, tokenizer, options, prompts, args.draw))
    result = {"side": args.side, "draw": args.draw, **scored(hf, tokenizer, list(options["eos_token_ids"]), prompts,
                                                             responses, truths)}
    print(json.dumps(result), flush=True)
    (out / f"{args.side}_{args.draw}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
