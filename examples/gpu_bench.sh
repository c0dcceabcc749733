#!/usr/bin/env bash
# One call on the GPU machine for speed: the kernel labs (Linear fp16, int4/int8, decode attention),
# then atlasc vs transformers on Llama-3.2-1B shapes (and more with arguments). Logs under $OUT; the
# tables are printed last. LABS=0 skips the labs (e.g. for an 8B run); QUANT=int4|int8|fp8 compiles atlasc's
# artifact quantized (QUANT=int8,fp8: one artifact each, benched in turn; PROFILE then takes the last);
# SKIP_TORCH=1 skips the transformers peers; PDL_AB=1 benches atlasc with plain CUDA graphs and with
# ATLAS_PDL=1; PROFILE=1 then runs `atlasc profile` on the benched artifact (batch 1 and the largest batch,
# 256 keys; PROFILE_TOP rows, default 30). ROTARY_AB=1 then compiles and benches twice more
# at batch 1, with ATLAS_ROTARY_EPILOGUE=0 and =1, each profiled in full (where the fused float16 QKV kernel
# loses its time, docs/perf.md v8). AB=ATLAS_SWITCH compiles atlasc's artifact twice, with that 0/1 switch 0
# and 1 (e.g. AB=ATLAS_PREFETCH), AB=ATLAS_SWITCH=a,b once per value (e.g. AB=ATLAS_LINEAR_FT=1,auto), and
# benches each (with PDL_AB=1: each with plain and programmatic graphs). JOBS=N compiles those artifacts up to N at
# once before benching any (bench_vs_torch.py --compile-jobs; all on disk together: fine for int4 / int8 8B). It saves
# little on the GPU machine: of two Llama-3-8B int4 compiles at once the first had not finished after ~380 s, where
# one alone took 261 s (docs/perf.md v50, v51).
#   bash examples/gpu_bench.sh [config] [batches]      e.g. bash examples/gpu_bench.sh llama-3.2-1b 1,8,32
set -uo pipefail
out="${OUT:-gpu-logs}"
mkdir -p "$out"
export ATLAS_CACHE_DIR="${ATLAS_CACHE_DIR:-/tmp/atlasc-cache}"
python3 examples/gpu_cache.py --unpack  # the CPU machine's cubins, when carried (examples/gpu_cache.py)
config="${1:-llama-3.2-1b}"
batches="${2:-1,8,32}"
if [ "${LABS:-1}" != 0 ]; then
    python3 examples/kernel_lab.py --ms 1,8,32,128 2>&1 | tee "$out/kernel_lab.log"
    # the fused decode projections (NormLinear, + SwiGLU epilogue) against the plain Linear
    python3 examples/kernel_lab.py --ms 1,8 --variant table,norm,gated \
        --shapes "1B qkv,1B gate_up,1B lm_head,8B qkv,8B gate_up" 2>&1 | tee "$out/kernel_lab_fused.log"
    # the narrow projections (one block per 16 outputs): MMA decode steps in flight per warp
    python3 examples/kernel_lab.py --ms 1,8 --variant mma --u 2,4,8 \
        --shapes "1B down,1B o,1B qkv,8B o" 2>&1 | tee "$out/kernel_lab_u.log"
    # batch 16 / 32 decode: x fragments shared by FT feature tiles per warp (ATLAS_LINEAR_FT, opt-in)
    python3 examples/kernel_lab.py --ms 16,32 --variant mma --ft 1,2,4 \
        --shapes "8B qkv,8B gate_up,8B down,8B lm_head,1B gate_up" 2>&1 | tee "$out/kernel_lab_ft.log"
    # the peer's GEMMs (torch / cuBLAS) on the same shapes, and the copy-engine + wgmma kernel's lab at 32 rows
    python3 examples/peer_gemm_lab.py --ms 1,32 2>&1 | tee "$out/peer_gemm_lab.log"
    python3 examples/wgmma_lab.py --ms 32 --configs 1-1-8,2-2-3,1-2-10 --ks 1,4 2>&1 | tee "$out/wgmma_lab.log"
    python3 examples/quant_lab.py --ms 1,8 --quant int4,int8,fp8 --floor 2>&1 | tee "$out/quant_lab.log"
    # the fused int4 projections (NormLinearQ: + RMSNorm prologue, + SwiGLU epilogue) against the plain one,
    # each with float and int8 activations (W4A8 on tensor cores)
    python3 examples/quant_lab.py --ms 1,8 --quant int4 --variant table,a8,norm,norm-a8,gated,gated-a8 \
        --shapes "8B qkv,8B gate_up" 2>&1 | tee "$out/quant_lab_fused.log"
    python3 examples/attention_lab.py --contexts 256,4096 --batches 1,32 2>&1 | tee "$out/attention_lab.log"
    # prefill attention in the form compiled decoders take (mask-as-lengths' KEYS) and with the mask tensor
    python3 examples/attention_lab.py --prefill --seqs 512,4096 --path fa2 --mask keys 2>&1 | \
        tee "$out/attention_prefill_keys.log"
    python3 examples/attention_lab.py --prefill --seqs 512,4096 --path fa2 2>&1 | tee "$out/attention_prefill.log"
fi
quant="${QUANT:-none}"  # QUANT=int4 / int8 / fp8: atlasc compiles with --quant (transformers stays fp16)
work="${WORKDIR:-/tmp/atlasc-work}"  # the ONNX file and the artifact stay here (not under $OUT: gigabytes)
python3 examples/bench_vs_torch.py --config "$config" --batch "$batches" --prompt 128 --gen 128 --quant "$quant" \
    ${SKIP_TORCH:+--skip-torch} ${PDL_AB:+--pdl-ab} ${AB:+--compile-ab "$AB"} ${JOBS:+--compile-jobs "$JOBS"} \
    --workdir "$work" --json "$out/bench_$config.json" 2>&1 | \
    tee "$out/bench_$config.log"
bench_status=${PIPESTATUS[0]}
if [ "${PROFILE:-0}" != 0 ]; then  # where a decode step's time goes, batch 1 and the largest batch, 256 keys
    qpart=""; case "$quant" in *,*) qpart="-${quant##*,}" ;; esac  # a QUANT list: its last artifact
    art="$work/$config$qpart.atlas"
    if [ -n "${AB:-}" ]; then  # with AB: the artifact compiled with the last value (the switch on)
        ab_name="${AB%%=*}"; ab_values="${AB#*=}"; [ "$ab_values" = "$AB" ] && ab_values="0,1"
        art="$work/$config$qpart-${ab_name}${ab_values##*,}.atlas"
    fi
    for b in 1 "${batches##*,}"; do
        atlasc profile "$art" --batch "$b" --context 256 --top "${PROFILE_TOP:-30}" 2>&1 | \
            tee "$out/profile_${config}_b$b.log"
    done
fi
if [ "${ROTARY_AB:-0}" != 0 ]; then
    for v in 0 1; do
        ATLAS_ROTARY_EPILOGUE=$v python3 examples/bench_vs_torch.py --config "$config" --batch 1 --prompt 128 \
            --gen 128 --quant "$quant" --skip-torch --workdir "$work/rot$v" --json "$out/bench_rot$v.json" 2>&1 | \
            tee "$out/bench_rot$v.log"
        atlasc profile "$work/rot$v/$config.atlas" --batch 1 --context 256 --top 200 2>&1 | tee "$out/profile_rot$v.log"
    done
fi
echo "== summary =="
[ "${LABS:-1}" != 0 ] && tail -n 25 "$out/kernel_lab.log" && tail -n 12 "$out/kernel_lab_fused.log" && \
    tail -n 10 "$out/kernel_lab_u.log" && tail -n 32 "$out/kernel_lab_ft.log" && \
    tail -n 22 "$out/quant_lab.log" && tail -n 13 "$out/quant_lab_fused.log" && \
    tail -n 20 "$out/attention_lab.log" && tail -n 6 "$out"/attention_prefill*.log
tail -n 12 "$out/bench_$config.log"
if [ "${PROFILE:-0}" != 0 ]; then head -n 16 "$out"/profile_"${config}"_b*.log; fi
if [ "${ROTARY_AB:-0}" != 0 ]; then
    tail -n 3 "$out"/bench_rot*.log && grep -h -m 3 -E "NormLinearRotary|QKVRotary|decode step" "$out"/profile_rot*.log
fi
exit "$bench_status"  # the bench's own status (the tables above are only printed)
