"""The agents' endpoint against direct engine calls: the same episodes, once played by ``--agents``
concurrent agent functions through the OpenAI client and the endpoint (HTTP, JSON, batching
window, stitching), once by purerl's own Env path calling the engine directly.

Both play identical episodes (an environment / an agent that answers every turn with "Go on.",
so all run ``--turns`` turns; the same draws: ``tests/test_agents.py`` pins the ids equal) from
the same RNG; runs are interleaved so machine noise hits both alike. The direct path re-prefills
each turn's whole context in one pair (``reuse_cache=False`` on both sides), and reuses each
episode's KV cache in the other (both defaults). Prints the median seconds per batch, tokens per
second, the ratios endpoint / direct and the engine calls the endpoint made.

    python bench/bench_agents.py                  # SmolLM2-135M-Instruct (the GGUF), CPU
    python bench/bench_agents.py --tiny           # a tiny random model: the endpoint's overhead bound
    python bench/bench_agents.py --smoke          # seconds: --tiny at the smallest sizes, one iteration
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_episodes import Echo  # noqa: E402  (the Env path's side: every turn answered)

from purerl.agents import AgentEnv, run_agents  # noqa: E402
from purerl.data.records import PromptRecord  # noqa: E402
from purerl.episodes import ChatCodec  # noqa: E402
from purerl.episodes.rollout import EpisodeLimits, run_episodes  # noqa: E402
from purerl.rewards import lenient_math_reward  # noqa: E402
from purerl.rollout.engine import make_engine  # noqa: E402
from purerl.rollout.sampling import SamplingParams  # noqa: E402
from purerl.state import RngState  # noqa: E402

SMOKE = ["--tiny", "--agents", "4", "--turns", "2", "--new", "4", "--iters", "1"]
"""What ``--smoke`` stands for."""


def make_echo_agent(turns: int):
    def echo(client, task):
        messages = list(task["prompt"])
        for _ in range(turns):
            reply = client.chat.completions.create(model="policy", messages=messages)
            messages += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Go on."}]
        return 0.0
    return echo


def main() -> None:
    import logging

    logging.getLogger("purerl").setLevel(logging.ERROR)  # Echo lives in __main__: it steps on threads, as meant
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--agents", type=int, default=32, help="concurrent agents (prompts × n, n = 4)")
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
    n = 4
    records = [PromptRecord(({"role": "user", "content": f"Tell me one fact about the number {i}."},), "")
               for i in range(args.agents // n)]
    codec, sampling = ChatCodec(tokenizer), SamplingParams(max_new_tokens=args.new, n=n, temperature=1.0)
    limits = EpisodeLimits(max_turns=args.turns, max_tokens=2048, step_timeout=600.0)
    agent = AgentEnv(make_echo_agent(args.turns), lenient_math_reward)
    ways = {
        "direct": lambda rng: run_episodes(engine, Echo(), codec, records, sampling, rng, 0, limits, decode=decode,
                                           reuse_cache=False),
        "direct_kv_reuse": lambda rng: run_episodes(engine, Echo(), codec, records, sampling, rng, 0, limits,
                                                    decode=decode),
        "endpoint": lambda rng: run_agents(engine, agent, codec, records, sampling, rng, 0, limits, decode=decode,
                                           reuse_cache=False),
        "endpoint_kv_reuse": lambda rng: run_agents(engine, agent, codec, records, sampling, rng, 0, limits,
                                                    decode=decode),
    }
    seconds: dict[str, list[float]] = {k: [] for k in ways}
    tokens: dict[str, int] = {}
    calls = []
    counting = engine._generate  # what every call reaches, sessions' included

    def counted(*a, **k):
        calls[-1] += 1
        return counting(*a, **k)

    engine._generate = counted
    for it in range(args.iters + 1):  # the first round warms up, untimed
        for name, play in ways.items():
            calls.append(0)
            start = time.perf_counter()
            played = play(RngState(it))
            elapsed = time.perf_counter() - start
            if it:
                seconds[name].append(elapsed)
                tokens[name] = sum(sum(e.sampled) for e in played)
            if name == "endpoint_kv_reuse":
                endpoint_calls = calls[-1]
    median = {name: statistics.median(times) for name, times in seconds.items()}
    for name in ways:
        print(f"{name:18s} {median[name]:7.2f} s per batch  {tokens[name] / median[name]:8.1f} sampled tok/s")
    print(f"throughput, endpoint / direct: {median['direct'] / median['endpoint']:.3f} (both re-prefilling); "
          f"{median['direct_kv_reuse'] / median['endpoint_kv_reuse']:.3f} (both reusing KV caches); "
          f"{args.agents} agents × {args.turns} turns in {endpoint_calls} engine calls; "
          f"torch threads {torch.get_num_threads()}")


if __name__ == "__main__":
    main()
