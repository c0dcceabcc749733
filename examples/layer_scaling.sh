#!/usr/bin/env bash
# Does a kernel of a compiled decode step get slower as the model gets deeper? (docs/perf.md v13: the
# Llama-3-8B int4 gate/up + SwiGLU kernel took 33.4 us per step in a 2-layer build, 39-40 us in 12- and
# 32-layer builds, 29.2 us in quant_lab.) For each layer count: build the Llama-3-8B shapes with that many
# layers, compile (QUANT, default int4; --max-batch 8), bench batch 1 and profile every kernel at batch 1,
# 256 keys; then print the median profile time per kernel kind (layer kernels by op and weight shape) per
# layer count. Run on the GPU machine after the install line.
#   LAYERS="2 8 16" QUANT=int4 bash examples/layer_scaling.sh
set -uo pipefail
out="${OUT:-gpu-logs}"
mkdir -p "$out"
export ATLAS_CACHE_DIR="${ATLAS_CACHE_DIR:-/tmp/atlasc-cache}"
work="${WORKDIR:-/tmp/layer-scaling}"
quant="${QUANT:-int4}"
for n in ${LAYERS:-2 8 16}; do
    mkdir -p "$work/l$n"
    python3 examples/build_llama.py llama-3-8b "$work/l$n/m.onnx" --layers "$n" 2>&1 | tail -1
    atlasc compile "$work/l$n/m.onnx" --arch sm90 --quant "$quant" --max-batch 8 -o "$work/l$n/q.atlas" 2>&1 | tail -1
    atlasc bench "$work/l$n/q.atlas" --batch 1 --prompt 128 --gen 128 2>&1 | tail -2 | tee "$out/bench_l$n.txt"
    atlasc profile "$work/l$n/q.atlas" --batch 1 --context 256 --json > "$out/profile_l$n.json" 2> "$out/profile_l$n.err"
done
python3 - "$out" ${LAYERS:-2 8 16} <<'EOF'
import json, statistics, sys
from pathlib import Path
out, counts = Path(sys.argv[1]), sys.argv[2:]
kinds = {}
for n in counts:
    path = out / f"profile_l{n}.json"
    if not path.exists() or not path.read_text().strip():
        print(f"layers {n}: no profile ({(out / f'profile_l{n}.err').read_text()[-300:]})")
        continue
    for row in json.loads(path.read_text())["rows"]:
        key = f"{row['op']} {row['bytes'] / 1e6:.1f} MB"
        kinds.setdefault(key, {}).setdefault(n, []).append(row["us"])
print(f"{'kernel kind (median us per step kernel)':44s}" + "".join(f"{'L=' + n:>10s}" for n in counts))
for key, per in sorted(kinds.items(), key=lambda kv: -max(statistics.median(v) for v in kv[1].values())):
    print(f"{key:44s}" + "".join(f"{statistics.median(per[n]):10.2f}" if n in per else f"{'-':>10s}" for n in counts))
EOF
