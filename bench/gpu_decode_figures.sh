#!/usr/bin/env bash
# Issue 60's decoding figures on a lent GPU, one call: the sampler inside the CUDA graph, graphs per
# bucket of rows and the compiled decoding step (tests/test_gpu.py's decoding tests), then
# bench/bench_rollout.py at 64, 256 and 512 rows (SmolLM2-135M's shape, bfloat16, 128 new tokens):
# the graph (sampler inside) against eager and the compiled step, each step against the memory
# bound, with the profiler's kernel time per step at 256 rows.
#
# Runs from a checkout's root (the device tool's copy of the working tree: nothing to commit first).
# The tests need beartype (pytest's jaxtyping hook): carry the wheels of ../shared/tools/gpu_bundle.sh,
#   here:   bash ../shared/tools/gpu_bundle.sh            # builds .gpu/c1/whl (and more)
#   device: run(carry=[".gpu/c1"], timeout_s=580, command="bash bench/gpu_decode_figures.sh")
# Stages: `tests`, `rollout`, or both (the default). Logs land in $OUT (or /tmp/gpu_decode_figures).
# Without a CUDA device it prints one line and exits 0. Estimated on an H100/H200: tests ~2 min,
# rollout ~5 min (Triton compiles the step once per process; its cache in /tmp serves the later ones).
set -uo pipefail
cd "$(dirname "$0")/.."
stage=${1:-all}
out=${OUT:-/tmp/gpu_decode_figures}; mkdir -p "$out"
if [ -d .gpu/c1/whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/c1/whl/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
if ! python3 -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_decode_figures: no CUDA device, skipped"; exit 0
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
python3 -c "import triton; print('triton', triton.__version__)" || echo "no triton: the compiled step will fail"
git log -1 --format='commit %h' 2>/dev/null || true
git status --short 2>/dev/null | head -20

if [ "$stage" = all ] || [ "$stage" = tests ]; then
  timeout 200 python3 -m pytest tests/test_gpu.py -rs --durations=8 -p no:cacheprovider \
    -k "sampler or graph or decoding or behaviour or interrupted" 2>&1 | tee "$out/decode_tests.log" | tail -25
fi
if [ "$stage" = all ] || [ "$stage" = rollout ]; then
  for prompts in 16 64 128; do
    rows=$((prompts * 4))
    extra=()
    [ "$rows" = 256 ] && extra=(--profile --profile-variants "default,compiled step,no CUDA graph")
    timeout 150 python3 bench/bench_rollout.py --device cuda --smollm2-shape --prompts "$prompts" --n 4 --new 128 \
      --iters 3 --dtype bfloat16 --compile --no-hf --bound "${extra[@]}" > "$out/rollout_$rows.log" 2>&1
    echo "rc $? at $rows rows"; grep -E "^model|median|bound|step .* ms" "$out/rollout_$rows.log"
  done
fi
