"""One main-job step with the LM head fused with its scores, against its logits held whole (issue 89).

Each run is ``experiments/grpo_math.py --steps 1 --eval-size 4 --threads 2`` in a fresh process, with
``actor.fused_head=true`` (the default: no ``[b, t, v]`` tensor in a step, :mod:`purerl.algo.fused_head`) or
``false`` (the logits, their saved copy and their gradient held whole, as before). The arms alternate for
``--rounds`` rounds (this box's speed drifts between runs). It prints each arm's peak resident memory (the
child's ``ru_maxrss``, what ``/usr/bin/time -v`` reports) and the seconds of its train phase (the job's
``train`` figure: experience, update and sync of its one step), medians over the rounds, and the ratios
fused / whole.

Models: ``smollm2`` (SmolLM2-135M-Instruct, 49,152 tokens), ``gemma3`` (Gemma 3 270M base, 262,144 tokens,
``--prompt-format plain``), ``vocab262k`` (a random 2-layer Gemma 3 of hidden size 64 with Gemma's own
262,144-token tokenizer: the head is most of the model), ``tiny`` (the main job's ``--tiny``).

    python3 bench/bench_fused_head.py --model smollm2 gemma3 vocab262k --rounds 3
    python3 bench/bench_fused_head.py --model gemma3 vocab262k --rounds 2 -- actor.micro_batch_rows=32 \\
        actor.skip_zero_advantage_rows=false          # the whole batch in one update forward
    python3 bench/bench_fused_head.py --smoke   # the tiny model, one round: not a measurement
"""

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
JOB = ["--steps", "1", "--eval-size", "4", "--threads", "2", "--no-progress", "--overwrite"]
SMOKE = ["--model", "tiny", "--rounds", "1"]
"""What ``--smoke`` stands for."""


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", nargs="+", choices=["tiny", "smollm2", "gemma3", "vocab262k"], default=["smollm2"])
    ap.add_argument("--rounds", type=int, default=3, help="runs per arm, the arms alternating")
    ap.add_argument("--smoke", action="store_true", help="the smallest sizes: " + " ".join(SMOKE))
    ap.add_argument("job", nargs="*", help="after --: more of the job's flags and key=value settings, for both arms")
    return ap


def vocab262k_folder(folder: Path) -> Path:
    """A random 2-layer Gemma 3 (hidden 64, tied head) with Gemma 3 270M's tokenizer, saved in ``folder``."""
    import torch
    import transformers

    from purerl.models.gguf_cache import gguf_as_folder
    from purerl.models.hf import gemma3_270m_gguf

    gemma = gguf_as_folder(gemma3_270m_gguf())
    if gemma is None:
        raise SystemExit("the purerl cache is off (PURERL_CACHE): the 262k model borrows Gemma's converted tokenizer")
    config = transformers.Gemma3TextConfig(
        vocab_size=262_144, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, max_position_embeddings=2048, sliding_window=128,
        tie_word_embeddings=True, bos_token_id=2, eos_token_id=1, pad_token_id=0)
    torch.manual_seed(0)
    transformers.Gemma3ForCausalLM(config).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(gemma / name, folder / name)
    return folder


def model_flags(name: str, scratch: Path) -> list[str]:
    from purerl.models.hf import gemma3_270m_gguf

    if name == "tiny":
        return ["--tiny"]
    if name == "smollm2":
        return []
    if name == "gemma3":
        return ["--model", str(gemma3_270m_gguf()), "--prompt-format", "plain"]
    return ["--model", str(vocab262k_folder(scratch / "vocab262k")), "--prompt-format", "plain"]


def one_run(flags: list[str], fused: bool, out_dir: Path) -> tuple[float, float]:
    """(peak resident GiB, train seconds) of one main-job step in a fresh process."""
    command = [sys.executable, str(ROOT / "experiments" / "grpo_math.py"), *JOB, *flags, "--out-dir", str(out_dir),
               f"actor.fused_head={'true' if fused else 'false'}"]
    with tempfile.TemporaryFile("w+") as log:
        child = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, text=True)
        _, status, usage = os.wait4(child.pid, 0)
        child.returncode = os.waitstatus_to_exitcode(status)
        log.seek(0)
        text = log.read()
    shutil.rmtree(out_dir, ignore_errors=True)  # a run's export is the model's size
    if child.returncode != 0:
        raise SystemExit(f"{' '.join(command)} exited {child.returncode}:\n{text[-3000:]}")
    train = re.search(r"train (\d+\.\d+) s", text)
    if train is None:
        raise SystemExit(f"no 'train N s' in the job's output:\n{text[-2000:]}")
    return usage.ru_maxrss / 2**20, float(train.group(1))


def main(args: argparse.Namespace) -> None:
    if args.smoke:
        args = parser().parse_args(SMOKE)
    print(f"CPU: {cpu_name()}, {os.cpu_count()} cores", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        for name in args.model:
            flags = [*model_flags(name, scratch), *args.job]
            runs: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
            for r in range(args.rounds):
                for fused in (False, True):
                    runs[fused].append(one_run(flags, fused, scratch / f"run-{name}-{fused}-{r}"))
            peak = {f: statistics.median(p for p, _ in runs[f]) for f in runs}
            train = {f: statistics.median(t for _, t in runs[f]) for f in runs}
            print(f"{name}: peak resident whole {peak[False]:.2f} GiB, fused {peak[True]:.2f} GiB "
                  f"({peak[True] / peak[False]:.2f}x); train seconds of the step whole {train[False]:.1f}, "
                  f"fused {train[True]:.1f} ({train[True] / train[False]:.2f}x); medians of {args.rounds}")


def cpu_name() -> str:
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    return next((line.split(":", 1)[1].strip() for line in lscpu.splitlines() if line.startswith("Model name")),
                "unknown")


if __name__ == "__main__":
    main(parser().parse_args())
