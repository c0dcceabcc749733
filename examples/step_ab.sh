#!/usr/bin/env bash
# A/B of one codegen switch inside a real decode step: a LAYERS-layer decoder of CONFIG's shapes is compiled
# once per value of the switch (in parallel) and `atlasc profile`d (CUDA events, graphs off) at each batch and context, so a
# kernel's time in the step can be compared across values (the labs time it alone). Run on the GPU machine after
# the install line; logs under $OUT, the rows of the kernels matching KERNELS printed last.
#   AB=ATLAS_ATTENTION_PREFETCH=0,3 bash examples/step_ab.sh
# Settings: AB (required: ENV=v1,v2,...), CONFIG (llama-3-8b), LAYERS (2), BATCHES (1,32), CONTEXTS (256,4096),
# KERNELS (regex of the profile rows to summarize, default Attention), QUANT (int4 / int8 / fp8: compiled with
# --quant). BENCH_ROUNDS=n (default 0) then runs `atlasc bench` (CUDA graphs, --prompt 128 --gen 128) on the
# artifacts in turn, n rounds of every value, and prints each round's decode ms/step (one bench moves ~3% between
# runs, docs/perf.md v16: alternate).
# REPLAY_ROUNDS=n (default 5) times the decode step alone, every artifact in one process, n rounds in turn
# (examples/replay_ab.py: steps replayed back to back in one CUDA graph); 0 skips it.
# RUNTIME=1: the switch is read at run time (e.g. ATLAS_MAPPED_STAGING): one artifact, compiled without it, and each
# value set only around its profile / bench runs (the replay then times the same graph for every value).
# NCU=regex (needs ncu) then measures the decode kernels matching it with Nsight Compute in each artifact's
# `atlasc bench --batch <first batch>` (NCU_SKIP launches skipped first, default 64; NCU_COUNT measured,
# default 32) and prints the key metrics per kernel, to say why one value's kernel is slower than another's.
set -uo pipefail
out="${OUT:-gpu-logs}"
mkdir -p "$out"
export ATLAS_CACHE_DIR="${ATLAS_CACHE_DIR:-/tmp/atlasc-cache}"
: "${AB:?set AB=ENV=v1,v2,...}"
config="${CONFIG:-llama-3-8b}"
layers="${LAYERS:-2}"
batches="${BATCHES:-1,32}"
contexts="${CONTEXTS:-256,4096}"
kernels="${KERNELS:-Attention}"
work="${WORKDIR:-/tmp/step-ab}"
name="${AB%%=*}"
values="${AB#*=}"
max_batch=$(tr , '\n' <<<"$batches" | sort -n | tail -1)
max_ctx=$(tr , '\n' <<<"$contexts" | sort -n | tail -1)
mkdir -p "$work"
python3 examples/build_llama.py "$config" "$work/m.onnx" --layers "$layers" 2>&1 | tail -1
status=0
for v in ${values//,/ }; do  # the compiles in parallel (nvcc and the passes use few cores each)
    if [ "${RUNTIME:-0}" = 1 ]; then  # one artifact for every value
        [ "$v" = "${values%%,*}" ] || { ln -sf "$work/m-${values%%,*}.atlas" "$work/m-$v.atlas"; continue; }
        (env -u "$name" atlasc compile "$work/m.onnx" --arch sm90 --max-batch "$max_batch" --max-seq $((max_ctx + 64)) \
            ${QUANT:+--quant "$QUANT"} -o "$work/m-$v.atlas" > "$out/compile_$v.log" 2>&1; echo "compile (runtime switch): exit $?") &
        continue
    fi
    (env "$name=$v" atlasc compile "$work/m.onnx" --arch sm90 --max-batch "$max_batch" --max-seq $((max_ctx + 64)) \
        ${QUANT:+--quant "$QUANT"} -o "$work/m-$v.atlas" > "$out/compile_$v.log" 2>&1; echo "compile $name=$v: exit $?") &
done
wait
for v in ${values//,/ }; do
    [ -f "$work/m-$v.atlas" ] || status=1
    for b in ${batches//,/ }; do
        for c in ${contexts//,/ }; do
            env "$name=$v" atlasc profile "$work/m-$v.atlas" --batch "$b" --context "$c" --top 60 > "$out/profile_${v}_b${b}_c${c}.log" 2>&1 ||
                status=1
        done
    done
done
echo "== $name: rows matching '$kernels' (config $config, $layers layers) =="
for v in ${values//,/ }; do
    for b in ${batches//,/ }; do
        for c in ${contexts//,/ }; do
            echo "-- $name=$v batch $b context $c"
            grep -E "$kernels|decode step|total" "$out/profile_${v}_b${b}_c${c}.log" | head -8
        done
    done
done
if [ "${REPLAY_ROUNDS:-5}" -gt 0 ]; then
    echo "== $name: decode step replayed in one process (examples/replay_ab.py) =="
    arts=""
    for v in ${values//,/ }; do arts="$arts $work/m-$v.atlas"; done
    python3 examples/replay_ab.py $arts --batch "$batches" --context "$contexts" --rounds "${REPLAY_ROUNDS:-5}" \
        2>&1 | tee "$out/replay.log" || status=1
fi
rounds="${BENCH_ROUNDS:-0}"
if [ "$rounds" -gt 0 ]; then
    for r in $(seq "$rounds"); do
        for v in ${values//,/ }; do
            env "$name=$v" atlasc bench "$work/m-$v.atlas" --batch "$batches" --prompt 128 --gen 128 --json \
                > "$out/bench_${v}_r$r.json" 2> "$out/bench_${v}_r$r.err" || status=1
        done
    done
    echo "== $name: decode ms/step per round (atlasc bench, graphs on) =="
    python3 - "$out" "$name" "$values" "$rounds" <<'PY'
import json, statistics, sys
out, name, values, rounds = sys.argv[1], sys.argv[2], sys.argv[3].split(","), int(sys.argv[4])
for v in values:
    per_batch = {}
    for r in range(1, rounds + 1):
        try:
            rows = json.load(open(f"{out}/bench_{v}_r{r}.json"))["rows"]
        except (OSError, ValueError, KeyError):
            continue
        for row in rows:
            per_batch.setdefault(row["batch"], []).append(row["decode_ms_per_step"])
    for b, ms in sorted(per_batch.items()):
        print(f"{name}={v} batch {b}: " + " ".join(f"{x:.4f}" for x in ms) + f"  median {statistics.median(ms):.4f} ms")
PY
fi
if [ -n "${NCU:-}" ]; then
    keys='^  [a-z_0-9]+ \(|Duration|DRAM Throughput|Memory Throughput|L2 Hit Rate|Registers Per|Grid Size|Block Size|Executed Ipc A|Warp Cycles Per Issued|No Eligible|dram__bytes|inst_executed'
    for v in ${values//,/ }; do
        ncu --clock-control none --cache-control none -k "regex:$NCU" --launch-skip "${NCU_SKIP:-64}" \
            --launch-count "${NCU_COUNT:-32}" --section SpeedOfLight --section LaunchStats --section WarpStateStats \
            --section SchedulerStats --metrics dram__bytes_read.sum,smsp__inst_executed.sum \
            atlasc bench "$work/m-$v.atlas" --batch "${batches%%,*}" --prompt 16 --gen 8 --repeats 1 \
            > "$out/ncu_$v.txt" 2>&1 || status=1
        echo "== ncu, $name=$v (kernels matching '$NCU') =="
        grep -E "$keys" "$out/ncu_$v.txt" | head -n 400 > "$out/ncu_${v}_keys.txt"
        python3 - "$out/ncu_$v.txt" <<'PY'
import re, statistics, sys
text = open(sys.argv[1]).read()
rows = {}
for block in re.split(r"\n  (?=[A-Za-z_0-9]+ \()", text)[1:]:
    name = block.split(" (", 1)[0]
    def metric(label):
        m = re.search(rf"{label}\s+\S+\s+([\d.,]+)", block)
        return float(m.group(1).replace(",", "")) if m else float("nan")
    rows.setdefault(name, []).append((metric("Duration"), metric("DRAM Throughput"), metric("Registers Per Thread"),
                                      metric("Warp Cycles Per Issued Instruction")))
for name, r in rows.items():
    med = [statistics.median([x[i] for x in r if x[i] == x[i]] or [float("nan")]) for i in range(4)]
    print(f"{name}: {len(r)} launches, medians: duration {med[0]:.2f} us, DRAM {med[1]:.1f}%, "
          f"{med[2]:.0f} registers, {med[3]:.2f} warp cycles per issued instruction")
PY
    done
fi
exit "$status"
