#!/usr/bin/env bash
# One call on the GPU machine: environment, the GPU tests, a small timing table, a summary last.
# Usage (from the repo root, after the install line in ../shared/gpu/install-line.txt):
#   bash examples/gpu_check.sh [pytest -k expression]
# Logs go to $OUT (or ./gpu-logs when OUT is unset).
set -uo pipefail
out="${OUT:-gpu-logs}"
mkdir -p "$out"
export ATLAS_CACHE_DIR="${ATLAS_CACHE_DIR:-/tmp/atlasc-cache}"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv | tee "$out/gpu.txt"
nvcc --version | tail -2 | tee -a "$out/gpu.txt"

select="${1:-}"
args=(-m gpu -q -rfEs --durations=15 -p no:cacheprovider)
# compiles dominate: run test files in parallel when pytest-xdist is there (it travels in .whl/)
python3 -c "import xdist" 2>/dev/null && args+=(-n 8 --dist loadfile)
[ -n "$select" ] && args+=(-k "$select")
python3 -m pytest "${args[@]}" tests 2>&1 | tee "$out/pytest-gpu.log"
status=${PIPESTATUS[0]}

python3 examples/gpu_timing.py 2>&1 | tee "$out/timing.log"

echo
echo "== summary =="
grep -E "^[0-9]+ (passed|failed)|passed|failed" "$out/pytest-gpu.log" | tail -1
tail -n 20 "$out/timing.log"
exit "$status"
