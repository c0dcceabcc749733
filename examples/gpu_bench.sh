#!/usr/bin/env bash
# One call on the GPU machine for speed: the Linear kernel lab, then atlasc vs transformers on
# Llama-3.2-1B shapes (and more with arguments). Logs under $OUT; the tables are printed last.
#   bash examples/gpu_bench.sh [config] [batches]      e.g. bash examples/gpu_bench.sh llama-3.2-1b 1,8,32
set -uo pipefail
out="${OUT:-gpu-logs}"
mkdir -p "$out"
export ATLAS_CACHE_DIR="${ATLAS_CACHE_DIR:-/tmp/atlasc-cache}"
config="${1:-llama-3.2-1b}"
batches="${2:-1,8,32}"
python3 examples/kernel_lab.py 2>&1 | tee "$out/kernel_lab.log"
python3 examples/bench_vs_torch.py --config "$config" --batch "$batches" --prompt 128 --gen 128 \
    --json "$out/bench_$config.json" 2>&1 | tee "$out/bench_$config.log"
echo "== summary =="
tail -n 25 "$out/kernel_lab.log"
tail -n 12 "$out/bench_$config.log"
