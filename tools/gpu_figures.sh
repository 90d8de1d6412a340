#!/usr/bin/env bash
# Issue 37's GPU figures in three calls of a lent GPU machine, back to back (it is given back ~30 s
# after a call ends). First, here: `bash ../shared/tools/gpu_bundle.sh` (it builds .gpu/c1-c3 from
# HEAD: commit first), then `cp tools/gpu_figures.sh .gpu/c1/ && cp tools/gpu_figures.sh .gpu/c2/ &&
# cp tools/gpu_figures.sh .gpu/c3/`. The calls (device tool `run`, with `carry`):
#
#   carry [".gpu/c1"]:  bash .gpu/c1/gpu_figures.sh tests     # test_gpu.py without Ray, the 0.5 B update, rollouts
#   carry [".gpu/c2"]:  bash .gpu/c2/gpu_figures.sh main      # the main job (float32 twice, bfloat16), the update on CUDA graphs
#   carry [".gpu/c3"]:  bash .gpu/c3/gpu_figures.sh ray       # test_gpu.py's Ray tests
#
# Each stays under 10 minutes (2026-11-27 on an H100: ~390 s, ~170 s, ~140 s). ROLLOUTS=1 adds the
# rollout figures to the first call (issue 37's rollout figures are in; the update bench compiles now). Logs, metrics and
# summaries land in $OUT. The main job runs twice per dtype: the first converts the GGUF into the
# cache (purerl/models/gguf_cache.py), the second is what a user sees from then on.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
stage=${1:?tests, main or ray}
case "$stage" in
  tests)
    bash "$here/setup.sh" || exit 1
    export PYTHONPATH=/tmp/site:/tmp/w PYTHONUNBUFFERED=1
    cd /tmp/w && lscpu | grep -m1 "Model name"
    python3 -c "import triton; print('triton', triton.__version__)" || echo "no triton: the compiled variants will be left out"
    timeout 300 python3 bench/bench_update.py --device cuda --dtype bfloat16 --qwen05b-shape --iters 10 \
      --no-default-adamw --compile --profile > "$OUT/update.log" 2>&1
    grep -E "first call|compiled vs|^model|median" "$OUT/update.log"
    timeout 250 python3 -m pytest tests/test_gpu.py -k "not ray and not own_pool" -rs --durations=12 \
      -p no:cacheprovider 2>&1 | tee "$OUT/tests.log" | tail -32
    [ -n "${ROLLOUTS:-}" ] && for p in 16 64 128; do
      timeout 60 python3 bench/bench_rollout.py --device cuda --smollm2-shape --prompts $p --n 4 --new 128 \
        --iters 3 --dtype bfloat16 > "$OUT/rollout_$p.log" 2>&1; tail -5 "$OUT/rollout_$p.log"
    done ;;
  main)
    bash "$here/join.sh" || exit 1
    export PYTHONPATH=/tmp/site:/tmp/w PYTHONUNBUFFERED=1 PURERL_CACHE=/tmp/purerl-cache
    cd /tmp/w
    for run in float32_first float32 bfloat16; do
      dtype=${run%_first}; start=$(date +%s.%N)
      timeout 150 python3 experiments/grpo_math.py --model /tmp/smol.gguf --device cuda --dtype "$dtype" \
        --no-progress --out-dir "/tmp/mj_$run" > "$OUT/main_$run.log" 2>&1; rc=$?
      echo "main job $run: rc $rc, command wall $(python3 -c "import time; print(round(time.time() - $start, 1))") s"
      tail -3 "$OUT/main_$run.log"
      cp "/tmp/mj_$run/summary.json" "$OUT/summary_$run.json" 2>/dev/null
    done
    # the compiled update replayed as CUDA graphs (bd4a5a8: 51.6 ms of kernels in a 64.5 ms step, the rest host time)
    timeout 240 python3 bench/bench_update.py --device cuda --dtype bfloat16 --qwen05b-shape --iters 10 \
      --no-default-adamw --compile --cudagraphs > "$OUT/update_cudagraphs.log" 2>&1
    grep -E "first call|compiled vs|^model|median" "$OUT/update_cudagraphs.log" ;;
  ray)
    bash "$here/ray.sh" || exit 1
    export PYTHONPATH=/tmp/site:/tmp/w PYTHONUNBUFFERED=1 PATH=/tmp/site/bin:$PATH RAY_AUTH_MODE=disabled
    cd /tmp/w && timeout 200 python3 -m pytest tests/test_gpu.py -k "ray or own_pool" -rs -p no:cacheprovider 2>&1 | tail -15 ;;
  *) echo "unknown stage $stage (tests, main or ray)"; exit 2 ;;
esac
