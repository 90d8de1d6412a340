"""One full GRPO step, purerl vs TRL's GRPOTrainer, same tiny model, batch and lengths, on CPU.

A step is: sample ``--prompts`` × ``--n`` completions of at most ``--new`` tokens (both stop at the
tokenizer's EOS; the random model's lengths follow the same distribution on both sides, and the
mean lengths are printed), score them with the same reward function, compute group-normalised advantages, one
policy-gradient update with global-norm clipping at 1.0 and AdamW (no reference model, beta = 0),
the entropy computed for the logs on both sides. TRL is timed per step with a trainer callback (``on_step_begin`` →
``on_step_end``, generation included); purerl is timed around ``rollout_batch`` + ``grpo_step``.
purerl runs twice: with its defaults, which leave rows whose advantages are all zero out of the
update (the update is the same; the fraction of such rows is printed), and with every row
through forward and backward, as TRL does. The three alternate in blocks of ``--steps`` steps,
``--rounds`` times, so machine noise hits all; medians and ratios are printed, and the range of
the ratio over rounds (each round's medians) shows how much the machine moved it.

Needs ``pip install trl`` (not a purerl dependency).

    python bench/bench_grpo_step.py [--hidden 128 --layers 2 --prompts 4 --n 4 --new 32 --steps 5 --rounds 4]
    python bench/bench_grpo_step.py --smoke   # the smallest sizes, one step a round: not a measurement
"""

import argparse
import functools
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import torch  # noqa: E402

from purerl.algo.kl_control import make_kl_controller  # noqa: E402
from purerl.assembly.stages import batch_plan_of, stage_settings_of  # noqa: E402
from purerl.config.job import JobConfig  # noqa: E402
from purerl.config.loading import build  # noqa: E402
from purerl.data.cursor import DataCursor  # noqa: E402
from purerl.loop.sampling import rollout_batch  # noqa: E402
from purerl.loop.task import Task  # noqa: E402
from purerl.models import causal_lm_from_config  # noqa: E402
from purerl.optim import adamw, chain, clip_by_global_norm  # noqa: E402
from purerl.rollout.backends.torch import TorchEngine  # noqa: E402
from purerl.state import RngState, TrainState  # noqa: E402
from purerl.step import grpo_step  # noqa: E402
from purerl.tiny import char_tokenizer, tiny_llama_config  # noqa: E402

SMOKE = ["--hidden", "32", "--layers", "1", "--prompts", "2", "--n", "2", "--new", "4", "--steps", "1", "--rounds",
         "1"]
"""What ``--smoke`` stands for: the smallest sizes that run every step of the bench."""


def reward(response: str, truth: str) -> float:
    return float(response.count(truth[0])) / max(len(response), 1)


def make_prompts(count: int) -> list[tuple[str, str]]:
    return [(f"{a}+{b}=", str(a + b)) for a in range(10) for b in range(10)][:count]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--device", default="cpu", help="cpu, or cuda (TRL then trains on the GPU too)")
    ap.add_argument("--smoke", action="store_true",
                    help=f"seconds, not a measurement: {' '.join(SMOKE)} (flags given win)")
    args = ap.parse_args()
    if args.smoke:
        args = ap.parse_args([*SMOKE, *sys.argv[1:]])

    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    tokenizer = char_tokenizer()
    config = tiny_llama_config(vocab_size=len(tokenizer) + 8, hidden_size=args.hidden, layers=args.layers)
    pairs = make_prompts(100)
    lr = 1e-5

    # --- purerl ---
    model, params = causal_lm_from_config(config, seed=0, device=args.device)
    optimizer = chain(clip_by_global_norm(1.0), adamw(lr, weight_decay=0.0))  # TRL clips at max_grad_norm 1.0
    kl_controller = make_kl_controller("fixed", coef=0.0)
    state = TrainState(policy=params, policy_opt=optimizer.init(params), kl=kl_controller.init(),
                       rng=RngState(0), data=DataCursor(0))
    engine = TorchEngine(model, device=args.device, eos_token_ids=[tokenizer.eos_token_id],
                         pad_token_id=tokenizer.pad_token_id,
                         decode=tokenizer.decode)
    from purerl.data.records import PromptRecord

    task = Task([tokenizer.encode(p) for p, _ in pairs],
                [PromptRecord(({"role": "user", "content": p},), t) for p, t in pairs], reward, tokenizer.decode)

    def job(skip: bool) -> JobConfig:
        return build(JobConfig, {"trainer": {"steps": 10**9}, "data": {"prompts_per_step": args.prompts},
                                 "rollout": {"max_new_tokens": args.new, "n": args.n, "temperature": 1.0},
                                 "actor": {"clip_high": 0.2, "micro_batch_rows": args.prompts * args.n,
                                           "recompute_old_logprobs": False, "skip_zero_advantage_rows": skip}})

    step_fns = {skip: functools.partial(grpo_step, policy=model, optimizer=optimizer, kl_controller=kl_controller,
                                        **stage_settings_of(job(skip))) for skip in (True, False)}
    plans = {skip: batch_plan_of(job(skip)) for skip in (True, False)}
    purerl_times: dict[bool, list[float]] = {True: [], False: []}
    purerl_lengths: list[float] = []
    skipped: list[float] = []
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)

    def purerl_block(count: int, record: bool, skip: bool = True) -> None:
        nonlocal state
        for _ in range(count):
            start = time.perf_counter()
            engine.sync(state.policy, state.step)
            state, rollout, scores, _ = rollout_batch(state, engine, task, plans[skip])
            state, metrics = step_fns[skip](state, rollout, scores)
            sync()
            if record:
                purerl_times[skip].append(time.perf_counter() - start)
                purerl_lengths.append(metrics["response_length/mean"])
                if skip:
                    skipped.append(metrics["actor/skipped_rows_frac"])

    # --- TRL ---
    trl_times: list[float] = []
    trl_lengths: list[float] = []

    class StepTimer(TrainerCallback):
        record = False

        def on_step_begin(self, *a, **k):
            self._start = time.perf_counter()

        def on_step_end(self, *a, **k):
            sync()
            if self.record:
                trl_times.append(time.perf_counter() - self._start)

        def on_log(self, args, state, control, logs=None, **k):
            if self.record and logs and "completions/mean_length" in logs:
                trl_lengths.append(float(logs["completions/mean_length"]))

    timer = StepTimer()
    tmp = tempfile.mkdtemp(prefix="purerl_bench_trl_")
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM

    trl_model = AutoModelForCausalLM.from_config(config)
    trl_model.generation_config.pad_token_id = tokenizer.pad_token_id
    trl_model.generation_config.eos_token_id = tokenizer.eos_token_id
    dataset = Dataset.from_dict({"prompt": [p for p, _ in pairs], "truth": [t for _, t in pairs]})

    def trl_reward(completions, truth, **_):
        return [reward(c, t) for c, t in zip(completions, truth)]

    def trl_block(count: int, record: bool) -> None:
        timer.record = record
        trl_args = GRPOConfig(
            output_dir=tmp, use_cpu=args.device == "cpu", bf16=False, max_steps=count, logging_steps=1,
            per_device_train_batch_size=args.prompts * args.n, num_generations=args.n,
            max_completion_length=args.new, learning_rate=lr, report_to="none", save_strategy="no",
            seed=0, gradient_checkpointing=False, beta=0.0, disable_tqdm=True, temperature=1.0,
            top_p=1.0, top_k=0,
        )
        GRPOTrainer(model=trl_model, reward_funcs=trl_reward, args=trl_args, train_dataset=dataset,
                    processing_class=tokenizer, callbacks=[timer]).train()

    purerl_block(2, record=False)  # warm-up
    purerl_block(2, record=False, skip=False)
    trl_block(2, record=False)
    round_ratios: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(args.rounds):
        trl_block(args.steps, record=True)
        purerl_block(args.steps, record=True)
        purerl_block(args.steps, record=True, skip=False)
        trl_round = statistics.median(trl_times[-args.steps:])
        for skip in (True, False):
            round_ratios[skip].append(trl_round / statistics.median(purerl_times[skip][-args.steps:]))

    trl_med = statistics.median(trl_times)
    print(f"model {sum(p.numel() for p in params.values()) / 1e6:.2f} M params; {args.prompts} prompts x "
          f"{args.n} samples x {args.new} new tokens; torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"{len(trl_times)} TRL and {len(purerl_times[True])} + {len(purerl_times[False])} purerl steps")
    print(f"TRL GRPOTrainer                  median {trl_med * 1e3:8.1f} ms/step   mean completion length "
          f"{statistics.mean(trl_lengths):.1f}")
    for skip, label in ((True, "purerl grpo_step (defaults)"), (False, "purerl, every row updated")):
        med = statistics.median(purerl_times[skip])
        note = f"   rows skipped {statistics.mean(skipped):.2f}" if skip else ""
        spread = f"(rounds {min(round_ratios[skip]):.2f}-{max(round_ratios[skip]):.2f})"
        print(f"{label:32s} median {med * 1e3:8.1f} ms/step   speed-up vs TRL {trl_med / med:5.2f}x {spread}{note}")
    print(f"purerl mean completion length {statistics.mean(purerl_lengths):.1f}")


if __name__ == "__main__":
    main()
