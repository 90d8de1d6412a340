"""Multi-turn episodes on the embedded engine: each episode's KV cache kept across its turns
(only the new ids prefilled) against a full re-prefill of the whole context every turn.

Both play the same episodes (an environment that answers every turn, so all run ``--turns``
turns) from the same RNG; runs are interleaved so machine noise hits both alike. Prints the
median seconds per batch of episodes, and the ratio.

    python bench/bench_episodes.py                       # SmolLM2-135M-Instruct (the GGUF), CPU
    python bench/bench_episodes.py --tiny --iters 5      # a tiny random model, seconds
    python bench/bench_episodes.py --smoke               # --tiny at the smallest sizes, one iteration
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from purerl.data.records import PromptRecord  # noqa: E402
from purerl.episodes import ChatCodec, StepResult  # noqa: E402
from purerl.episodes.rollout import EpisodeLimits, run_episodes  # noqa: E402
from purerl.rollout.engine import make_engine  # noqa: E402
from purerl.rollout.sampling import SamplingParams  # noqa: E402
from purerl.state import RngState  # noqa: E402

SMOKE = ["--tiny", "--prompts", "2", "--n", "2", "--turns", "2", "--new", "4", "--iters", "1"]
"""What ``--smoke`` stands for."""


class Echo:
    """Every turn is answered ("go on"): episodes last ``max_turns`` turns."""

    stop = ()

    def reset(self, task, seed):
        return None, list(task.messages)

    def step(self, state, action):
        return StepResult(state, [{"role": "user", "content": "Go on."}], 0.0, False)


def main() -> None:
    import logging

    logging.getLogger("purerl").setLevel(logging.ERROR)  # Echo lives in __main__: it steps on threads, as meant
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--new", type=int, default=24, help="new tokens per turn")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--smoke", action="store_true",
                    help=f"seconds, not a measurement: {' '.join(SMOKE)} (flags given win)")
    args = ap.parse_args()
    if args.smoke:
        args = ap.parse_args([*SMOKE, *sys.argv[1:]])
    if args.tiny:
        from purerl.models import causal_lm_from_config
        from purerl.tiny import char_tokenizer, tiny_llama_config

        tokenizer = char_tokenizer(chatml=True)
        model, params = causal_lm_from_config(tiny_llama_config(vocab_size=len(tokenizer), hidden_size=64,
                                                                max_position_embeddings=2048))
    else:
        from transformers import AutoTokenizer

        from purerl.models import load_causal_lm, smollm2_gguf

        path = smollm2_gguf()
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        model, params = load_causal_lm(path, dtype=torch.float32)
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    engine = make_engine("torch", model, eos_token_ids=[tokenizer.eos_token_id], pad_token_id=0, decode=decode)
    engine.sync(params, 0)
    system = "You are a careful assistant. Answer in one short sentence, then stop. " * 3
    records = [PromptRecord(({"role": "system", "content": system},
                             {"role": "user", "content": f"Tell me one fact about the number {i}."}), "")
               for i in range(args.prompts)]
    codec, sampling = ChatCodec(tokenizer), SamplingParams(max_new_tokens=args.new, n=args.n, temperature=1.0)
    limits = EpisodeLimits(max_turns=args.turns, max_tokens=2048)
    seconds: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(args.iters):
        for reuse in (False, True):
            start = time.perf_counter()
            episodes = run_episodes(engine, Echo(), codec, records, sampling, RngState(0), 0, limits, decode=decode,
                                    reuse_cache=reuse)
            seconds[reuse].append(time.perf_counter() - start)
    full, kept = statistics.median(seconds[False]), statistics.median(seconds[True])
    turns = sum(len(e.turn_ends) for e in episodes) / len(episodes)
    print(f"{len(episodes)} episodes, {turns:.1f} turns each, {args.new} new tokens per turn, "
          f"prompt {episodes[0].prompt_length} tokens, final length {statistics.median(len(e.ids) for e in episodes)}")
    print(f"full re-prefill each turn: {full:.2f} s   KV cache kept across turns: {kept:.2f} s   "
          f"speed-up {full / kept:.2f}x (median of {args.iters})")


if __name__ == "__main__":
    main()
