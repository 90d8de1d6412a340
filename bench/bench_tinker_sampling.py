"""A Tinker recipe's sampling pattern against purerl.tinker, with and without request batching.

tinker-cookbook's RL loop sends one ``asample`` per group (a prompt and its ``group_size``
samples) for every group of a step at once. The server runs the sampling requests of one sampler
and settings that wait together as one engine call (:class:`purerl.tinker.futures.Batched`). This
times, on the served model, through the unmodified SDK and the HTTP server, interleaved:

- **one at a time**: the step's requests sent one after the other, each awaited before the next
  (every engine call samples one group: the server's behaviour before batching);
- **at once**: the same requests sent together, as the cookbook sends them;
- **one request**: all the step's samples in one request of ``groups × group_size`` (the bound:
  one prefill per prompt, one engine call).

The prompts are the math_rl arithmetic recipe's, rendered in ChatML (its few-shot turn and a new
question), with its stop token and ``max_tokens``. It prints median seconds and sampled tokens/s,
and the ratios against "one at a time" from the same run.

    python3 bench/bench_tinker_sampling.py [--groups 8] [--group-size 4] [--max-tokens 10] [--iters 5] [--threads 1]
    python3 bench/bench_tinker_sampling.py --smoke    # a tiny random model (written to a temporary folder), 2 × 2
                                                      # samples: not a measurement
"""

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

SMOKE = ["--groups", "2", "--group-size", "2", "--max-tokens", "4", "--iters", "1"]
"""What ``--smoke`` stands for, on a tiny random model (:func:`purerl.tinker.launch.write_tiny_model`)."""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=10)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--model", default=None, help="a model folder or .gguf (default: SmolLM2-135M-Instruct's GGUF)")
    ap.add_argument("--smoke", action="store_true",
                    help=f"seconds, not a measurement: {' '.join(SMOKE)} (flags given win)")
    args = ap.parse_args()
    if args.smoke:
        args = ap.parse_args([*SMOKE, *sys.argv[1:]])
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    torch.set_num_threads(args.threads)
    import numpy as np
    import tinker
    from tinker import types

    from purerl.tinker.launch import model_folder, service_of, write_tiny_model
    from purerl.tinker.server import TinkerServer

    rng = np.random.RandomState(0)
    with tempfile.TemporaryDirectory() as root:
        folder = write_tiny_model(f"{root}/tiny") if args.smoke else model_folder(args.model)
        with TinkerServer(service_of(folder, store=f"{root}/store")) as server:
            service = tinker.ServiceClient(base_url=server.url, api_key=server.key)
            training = service.create_lora_training_client(base_model=str(folder), rank=32).result()
            tokenizer = training.get_tokenizer()
            sampling = training.save_weights_and_get_sampling_client().result()
            stop = tokenizer.encode("<|im_end|>")
            params = types.SamplingParams(max_tokens=args.max_tokens, stop=stop, temperature=1.0)

            def prompt() -> types.ModelInput:
                x, y = rng.randint(0, 101, size=2)
                text = ("<|im_start|>user\nWhat is 4 + 5?<|im_end|>\n<|im_start|>assistant\n9<|im_end|>\n"
                        f"<|im_start|>user\nWhat is {x} + {y}?<|im_end|>\n<|im_start|>assistant\n")
                return types.ModelInput.from_ints(tokenizer.encode(text))

            def one_at_a_time() -> list:
                return [sampling.sample(prompt(), args.group_size, params).result() for _ in range(args.groups)]

            def at_once() -> list:
                futures = [sampling.sample(prompt(), args.group_size, params) for _ in range(args.groups)]
                return [f.result() for f in futures]

            def one_request() -> list:
                return [sampling.sample(prompt(), args.groups * args.group_size, params).result()]

            ways = {"one at a time": one_at_a_time, "at once": at_once, "one request": one_request}
            seconds: dict[str, list[float]] = {name: [] for name in ways}
            tokens: dict[str, int] = dict.fromkeys(ways, 0)
            for name, way in ways.items():  # warm-up
                way()
            for _ in range(args.iters):
                for name, way in ways.items():
                    start = time.perf_counter()
                    results = way()
                    seconds[name].append(time.perf_counter() - start)
                    tokens[name] += sum(len(s.tokens) for r in results for s in r.sequences)
            service.close("success").result()
    base = statistics.median(seconds["one at a time"])
    print(f"{args.groups} groups x {args.group_size} samples, max_tokens {args.max_tokens}, "
          f"{args.threads} thread(s), {args.iters} iterations, {folder.name}")
    print("| way | median s per step | sampled tokens/s | speed-up over one at a time |")
    print("|---|---|---|---|")
    for name in ways:
        median = statistics.median(seconds[name])
        rate = tokens[name] / sum(seconds[name])
        print(f"| {name} | {median:.2f} | {rate:.1f} | {base / median:.2f}x |")


if __name__ == "__main__":
    main()
