#!/usr/bin/env bash
# Run purerl's HF-touching tests against given transformers releases, each in a throwaway
# environment (a venv that sees the packages of the `python3` on PATH, a venv's included, with
# only transformers and what it needs installed on top), pytest's warnings-as-errors policy on.
#
#   tools/check_transformers.sh 4.56.2 5.17.0 newest
#
# `newest` is the newest release on the package index. Prints one line per version and exits 1
# when any version fails. Needs purerl's test install (the README's test command) first.
set -uo pipefail
cd "$(dirname "$0")/.."
[ $# -gt 0 ] || { echo "usage: $0 VERSION|newest ..." >&2; exit 2; }
TESTS=(tests/test_model.py tests/test_rollout.py tests/test_llama_decode.py tests/test_checkpoint.py
       tests/test_llama.py tests/test_gguf.py)
status=0
for version in "$@"; do
    env_dir=$(mktemp -d "${TMPDIR:-/tmp}/purerl-tf.XXXXXX")
    log="$env_dir/pytest.log"
    spec="transformers==$version"; [ "$version" = newest ] && spec="transformers"
    if ! { python3 -m venv "$env_dir/venv" &&
           # the venv's own packages come first, then those of the environment under test
           python3 -c "import sys; [print(f'import site; site.addsitedir({p!r})') for p in sys.path if p.endswith('-packages')]" \
               > "$("$env_dir/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/parent.pth" &&
           "$env_dir/venv/bin/python" -m pip install -q --upgrade "$spec" > "$env_dir/pip.log" 2>&1; }; then
        echo "transformers $version: could not be installed ($env_dir/pip.log)"; status=1; continue
    fi
    installed=$("$env_dir/venv/bin/python" -c "import transformers; print(transformers.__version__)")
    if "$env_dir/venv/bin/python" -m pytest "${TESTS[@]}" > "$log" 2>&1; then
        echo "transformers $installed: ok ($(tail -n 1 "$log" | tr -d '='))"
        rm -rf "$env_dir"
    else
        echo "transformers $installed: FAILED ($(tail -n 1 "$log" | tr -d '=')); log: $log"
        grep -E "^(FAILED|ERROR) " "$log" | sed 's/^/    /'
        status=1
    fi
done
exit $status
