#!/usr/bin/env bash
# One GPU-machine call for the copy-engine quantized projections (docs/perf.md v43): the lab against the current
# kernels and the read-only floor, the path's GPU tests, then (STEP=1) the 8-layer Llama-3-8B decode steps at batch 1
# with ATLAS_QUANT_BULK off and on, twice: with the default decode paths (int8: the bulk kernels serve QKV + rotary,
# o and down, gate/up and the LM head keep int8 x; int4: the table's "bulk rows 1" entry gives the 8B float x
# everywhere, so 0 is the fused default and 1 the bulk one) and with float x everywhere (ATLAS_INT4_PATH=w4a16 /
# ATLAS_INT8_PATH=w8a16: the bulk kernels serve the fused gate/up and LM head too). Run after the install line; logs
# under $OUT, a summary last.
#   bash examples/bulk_check.sh                # lab + GPU tests (the kernels', and the path end to end inside
#                                              # programmatic graphs: ~4-6 min with the nvcc pack)
#   STEP=1 QUANTS=int4 LAB=0 TESTS=0 bash examples/bulk_check.sh
# Settings: LAB=0 skips the labs; TESTS=0 the GPU tests; STEP=1 adds the step A/B for each of QUANTS (default int4),
# BULK_CONFIG=W-S-B sets ATLAS_QUANT_BULK_CONFIG for it (default: the compiler's), STEP_AB the switch it compares
# (default ATLAS_QUANT_BULK=0,1; another switch, e.g. STEP_AB=ATLAS_QUANT_BULK_EARLY=0,1, runs with the path on for
# both values). The compiler's mbarrier waits do
# not time out, so a hung kernel would hold the device call to its limit: the GPU tests and each step A/B run under
# `timeout` (TEST_TIMEOUT, default 360 s; STEP_TIMEOUT, default 420 s), and the log says when it fired (rc 124).
# Each step A/B compiles two 8-layer 8B artifacts: one quant per device call (QUANTS=int4, then QUANTS=int8), and
# XS=default or XS=float runs one of its two A/Bs (default: both, XS='default float').
set -uo pipefail
out="${OUT:-gpu-logs}"
mkdir -p "$out"
export ATLAS_CACHE_DIR="${ATLAS_CACHE_DIR:-/tmp/atlasc-cache}"
python3 examples/gpu_cache.py --unpack > "$out/gpu_cache.txt" 2>&1
status=0
if [ "${LAB:-1}" != 0 ]; then
    (cd examples &&
        python3 w4_bulk_lab.py --variant plain,copy --ofs 0,1 --ks 1,2,4,8 --shapes "8B qkv,8B o,8B down,8B lm_head" \
            --floor 2>&1 | tee "$out/bulk_int4.log"
        python3 w4_bulk_lab.py --variant plain,gated,copy --ofs 0,1 --ks 1,2 --shapes "8B gate_up" 2>&1 |
            tee "$out/bulk_int4_gate_up.log"
        python3 w4_bulk_lab.py --quant int8 --variant plain,copy --ks 1,2,4,8 \
            --shapes "8B qkv,8B o,8B down,8B gate_up,8B lm_head" 2>&1 | tee "$out/bulk_int8.log"
        python3 quant_lab.py --ms 1 --quant int4,int8 --variant table,gated \
            --shapes "8B qkv,8B o,8B gate_up,8B down,8B lm_head" --floor 2>&1 | tee "$out/quant_lab.log") || status=1
fi
if [ "${TESTS:-1}" != 0 ]; then
    timeout "${TEST_TIMEOUT:-360}" python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels_quant_bulk_gpu.py \
        tests/test_gpu_runtime.py::test_copy_engine_projections_keep_the_tokens > "$out/pytest-bulk.log" 2>&1 ||
        { echo "pytest rc $?" >> "$out/pytest-bulk.log"; status=1; }
fi
if [ "${STEP:-0}" != 0 ]; then
    quants="${QUANTS:-int4}"
    for q in ${quants//,/ }; do
        for x in ${XS:-default float}; do
            path=""  # float: every batch-1 kernel with float x (the fused ones then take the bulk path too)
            [ "$x" = float ] && path="w${q#int}a16"
            ab="${STEP_AB:-ATLAS_QUANT_BULK=0,1}"
            on=""  # another switch than the path's own: the path on for both of its values
            [ "${ab%%=*}" = ATLAS_QUANT_BULK ] || on=ATLAS_QUANT_BULK=1
            timeout "${STEP_TIMEOUT:-420}" env ${path:+ATLAS_${q^^}_PATH=$path} ${on:+$on} \
                ATLAS_QUANT_BULK_CONFIG="${BULK_CONFIG:-}" \
                QUANT="$q" CONFIG=llama-3-8b LAYERS=8 AB="$ab" BATCHES=1 CONTEXTS=256 \
                KERNELS='LinearQ|NormLinear|decode step' REPLAY_ROUNDS=5 WORKDIR="/tmp/bulk-step-$q-$x" \
                OUT="$out/step_${q}_$x" bash examples/step_ab.sh > "$out/step_${q}_$x.log" 2>&1 ||
                { echo "step_ab rc $?" >> "$out/step_${q}_$x.log"; status=1; }
        done
    done
fi
echo "== summary =="
for f in "$out"/bulk_*.log; do [ -f "$f" ] && echo "-- $f" && sed -n '/best per shape/,$p' "$f"; done
[ -f "$out/quant_lab.log" ] && tail -n 24 "$out/quant_lab.log"
[ -f "$out/pytest-bulk.log" ] && tail -n 3 "$out/pytest-bulk.log"
for f in "$out"/step_*.log; do [ -f "$f" ] && echo "-- $f" && tail -n 16 "$f"; done
exit $status
