#!/usr/bin/env bash
# The same fused int4 kernel measured by Nsight Compute inside a compiled decode step and in quant_lab, so
# their metrics can be compared line by line (docs/perf.md v13: the step's gate/up + SwiGLU kernel ran
# ~10 us slower than the lab's at equal registers). Needs ncu; run on the GPU machine after the install
# line. LAYERS decoder layers of the Llama-3-8B shapes (default 2: a short compile, the real kernel shapes).
#   bash examples/ncu_step_vs_lab.sh
set -uo pipefail
out="${OUT:-gpu-logs}"
mkdir -p "$out"
export ATLAS_CACHE_DIR="${ATLAS_CACHE_DIR:-/tmp/atlasc-cache}"
work="${WORKDIR:-/tmp/ncu-step}"
layers="${LAYERS:-2}"
mkdir -p "$work"
python3 examples/build_llama.py llama-3-8b "$work/m.onnx" --layers "$layers" 2>&1 | tail -1
atlasc compile "$work/m.onnx" --arch sm90 --quant int4 --max-batch 8 -o "$work/q.atlas" 2>&1 | tail -1
atlasc profile "$work/q.atlas" --batch 1 --context 256 --top 12 2>&1 | tee "$out/profile_l$layers.log"
sections=(--section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats
          --section WarpStateStats --section SchedulerStats)
metrics=(--metrics dram__bytes_read.sum,lts__t_sector_hit_rate.pct,smsp__inst_executed.sum)
# decode NormLinearQ launches: layer 0 gate/up, layer 1 gate/up, ..., the LM head (one step, after warm-up)
ncu --clock-control none --cache-control none -k regex:'decode.*NormLinearQ' --launch-skip $((4 * (layers + 1))) \
    --launch-count 2 "${sections[@]}" "${metrics[@]}" \
    atlasc bench "$work/q.atlas" --batch 1 --prompt 16 --gen 8 --repeats 1 > "$out/ncu_step.txt" 2>&1
ncu --clock-control none --cache-control none -k regex:NormLinearQ --launch-skip 20 --launch-count 1 \
    "${sections[@]}" "${metrics[@]}" \
    python3 examples/quant_lab.py --ms 1 --quant int4 --variant gated --shapes "8B gate_up" \
    > "$out/ncu_lab.txt" 2>&1
keys='^  [a-z_0-9]+NormLinearQ|Duration|DRAM Throughput|Memory Throughput|L2 Hit Rate|Achieved Occupancy|Registers Per|Dynamic Shared|Grid Size|Executed Ipc A|Warp Cycles Per Issued|No Eligible|dram__bytes|sector_hit|inst_executed'
echo "== step (ncu) =="; grep -E "$keys" "$out/ncu_step.txt"
echo "== lab (ncu) =="; grep -E "$keys" "$out/ncu_lab.txt"
