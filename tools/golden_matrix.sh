#!/usr/bin/env bash
# The golden runs under every instruction set this CPU offers: tests/test_golden.py (which runs them
# under tests/golden/runs.py's PINS) once per host setting of ATen's dispatch and oneDNN's ISA cap,
# against the one recorded file. Each setting first runs one recipe *unpinned* (the host's numerics
# as they are) and says whether that reproduces the recorded numbers, so the matrix also shows which
# settings would move them without the pins.
#
#   tools/golden_matrix.sh            # ~2 min per setting on 2 cores
#
# Prints one line per setting and exits 1 when the golden tests fail under any of them.
set -uo pipefail
cd "$(dirname "$0")/.."
lscpu | sed -n 's/^Model name: *//p'
python3 -c "import torch; print('torch', torch.__version__, '- ATen dispatches to', torch.backends.cpu.get_cpu_capability())"
settings=("ATEN_CPU_CAPABILITY=default" "ATEN_CPU_CAPABILITY=avx2" "ATEN_CPU_CAPABILITY=avx512"
          "ONEDNN_MAX_CPU_ISA=AVX2" "ONEDNN_MAX_CPU_ISA=AVX512_CORE" "ONEDNN_MAX_CPU_ISA=AVX512_CORE_AMX")
recipe=${GOLDEN_MATRIX_RECIPE:-grpo.toml/sync/local}
status=0
for setting in "${settings[@]}"; do
    log=$(mktemp "${TMPDIR:-/tmp}/golden-matrix.XXXXXX")
    unpinned=$(env "$setting" python3 -m tests.golden.runs --unpinned "$recipe" 2>/dev/null | tail -n 1)
    if env "$setting" PURERL_GOLDEN_ALL_RAY=1 python3 -m pytest tests/test_golden.py > "$log" 2>&1; then
        echo "$setting: golden tests ok ($(tail -n 1 "$log" | tr -d '=')); unpinned, $unpinned"
        rm -f "$log"
    else
        echo "$setting: golden tests FAILED ($log); unpinned, $unpinned"; status=1
    fi
done
exit $status
