#!/usr/bin/env bash
# One call on the GPU machine: environment, the GPU tests, a small timing table, a summary last.
# Usage (from the repo root, after the install line in ../shared/gpu/install-line.txt):
#   bash examples/gpu_check.sh [pytest -k expression]
# Logs go to $OUT (or ./gpu-logs when OUT is unset). XDIST_N: parallel pytest processes (default 8); SLOW=0
# skips the slow tier (ptxas register guards, no GPU needed). PART=i/n runs the i-th of n shares of the test files
# (files j with j % n == i - 1 in name order), so a suite longer than one device call can span n calls. The GPU
# passes log one line per test (pytest -v) into $OUT, so a run cut by a time limit still shows which tests passed.
set -uo pipefail
out="${OUT:-gpu-logs}"
mkdir -p "$out"
export ATLAS_CACHE_DIR="${ATLAS_CACHE_DIR:-/tmp/atlasc-cache}"
# cubins compiled on the CPU machine (examples/gpu_cache.py; carried as .gpu-cache.tar.xz): fewer compiles here
python3 examples/gpu_cache.py --unpack 2>&1 | tee "$out/gpu_cache.txt"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv | tee "$out/gpu.txt"
nvcc --version | tail -2 | tee -a "$out/gpu.txt"

select="${1:-}"
args=(-rfEs --durations=15 -p no:cacheprovider)
[ -n "$select" ] && args+=(-k "$select")
files=(tests)
if [ -n "${PART:-}" ]; then  # i/n: every n-th test file from the i-th
    part_i="${PART%/*}" part_n="${PART#*/}"
    if ! [[ "$part_i" =~ ^[0-9]+$ && "$part_n" =~ ^[0-9]+$ ]] || [ "$part_i" -lt 1 ] || [ "$part_i" -gt "$part_n" ]; then
        echo "gpu_check: PART must be i/n with 1 <= i <= n, not '$PART'" >&2
        exit 2
    fi
    files=()
    j=0
    for f in tests/test_*.py; do
        [ $((j % part_n)) = $((part_i - 1)) ] && files+=("$f")
        j=$((j + 1))
    done
    echo "PART $PART: ${#files[@]} test files" | tee "$out/part.txt"
fi
# compiles dominate: run test files in parallel when pytest-xdist is there (it travels in .whl/); the tests
# that read device-wide free memory (marker gpu_alone) run after, alone
parallel=()
python3 -c "import xdist" 2>/dev/null && parallel=(-n "${XDIST_N:-8}" --dist loadfile)  # XDIST_N: processes
# one line per test into the log, the failures and the summary on the console
python3 -m pytest -v -m "gpu and not gpu_alone" "${parallel[@]}" "${args[@]}" "${files[@]}" > "$out/pytest-gpu.log" 2>&1
status=$?
[ "$status" = 5 ] && status=0  # 5: no GPU test in this PART's files (or none selected by -k)
grep -E "^(FAILED|ERROR)|(passed|failed|error)s? in " "$out/pytest-gpu.log"
python3 -m pytest -v -m "gpu and gpu_alone" "${args[@]}" "${files[@]}" > "$out/pytest-gpu-alone.log" 2>&1
alone=$?
grep -E "^(FAILED|ERROR)|(passed|failed|error|deselected)s? in " "$out/pytest-gpu-alone.log"
[ "$alone" = 0 ] || [ "$alone" = 5 ] || status=1  # 5: none selected

# the register-spill guards (marker slow: ptxas on big modules) on this machine's cores; CI leaves them out.
# SLOW=0 skips them (they need no GPU: `python -m pytest -m "slow and not gpu" tests` runs them anywhere)
if [ "${SLOW:-1}" != 0 ]; then
    python3 -m pytest -q -m "slow and not gpu" "${parallel[@]}" "${args[@]}" "${files[@]}" 2>&1 | tee "$out/pytest-slow.log"
    slow=${PIPESTATUS[0]}
    [ "$slow" = 0 ] || [ "$slow" = 5 ] || status=1
else
    echo "slow tier skipped (SLOW=0)" > "$out/pytest-slow.log"
fi

python3 examples/gpu_timing.py 2>&1 | tee "$out/timing.log"

echo
echo "== summary =="
grep -E "passed|failed|skipped" "$out/pytest-gpu.log" | tail -1
grep -E "passed|failed|deselected" "$out/pytest-gpu-alone.log" | tail -1
grep -E "passed|failed|deselected|skipped" "$out/pytest-slow.log" | tail -1
tail -n 20 "$out/timing.log"
exit "$status"
