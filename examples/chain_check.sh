#!/usr/bin/env bash
# One device call for the chain lab's open questions (docs/perf.md v48 Next 2, v49 Next 2): the layer with the norms
# and the split attention phase (also with the producers held during it, --attn-hold, and its cached rows prefetched
# to L2, --attn-prefetch), the same chain without
# attention and the ring alone, and in the same call the baselines (the compiler's int4 projections one kernel each,
# its decode attention kernel, the read-only floor).
# Usage (repo root, after the install line of ../shared/gpu/install-line.txt; carry .whl):
#   bash examples/chain_check.sh            # ~60 s of GPU time; logs under $OUT (or ./gpu-logs), a summary last
# STEP_TIMEOUT (default 150 s) bounds each step, so one hang cannot eat the call.
set -uo pipefail
out="${OUT:-gpu-logs}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
cd "$(dirname "$0")" || exit 2
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader | tee "$out/gpu.txt"
status=0
step() {  # step NAME SCRIPT ARGS...: one lab, its log in $out/NAME.txt
    local name=$1
    shift
    timeout "${STEP_TIMEOUT:-150}" python3 "$@" > "$out/$name.txt" 2>&1
    local rc=$?
    echo "$name: rc $rc"
    [ "$rc" = 0 ] || status=1
}
step attn chain_lab.py --configs 16-11-io --modes lean,flags-lean,separate --inflight 2 --norm --attn 256 --trace
step attn_hold chain_lab.py --configs 16-11-io --modes flags-lean,lean --inflight 2 --norm --attn 256 --attn-hold \
    --trace
step attn_pf chain_lab.py --configs 16-11-io --modes flags-lean --inflight 2 --norm --attn 256 --attn-prefetch --trace
step attn_both chain_lab.py --configs 16-11-io --modes flags-lean --inflight 2 --norm --attn 256 --attn-hold \
    --attn-prefetch --trace
step norm chain_lab.py --configs 16-11-io --modes flags-lean,stream --inflight 2 --norm --floor
step quant quant_lab.py --ms 1 --quant int4 --variant table --shapes "8B qkv,8B o,8B gate_up,8B down"
step attention attention_lab.py --models 8B --contexts 256 --batches 1 --mask keys

echo "== summary (us a layer; attn: with the attention phase) =="
for name in attn attn_hold attn_pf attn_both norm; do
    grep -h -E "^\| 16-|floor|^ +[0-9]" "$out/$name.txt" | sed "s/^/$name /"
done
grep -h -A8 -E "^16-11-io (ah )?(ap )?d2 flags-lean" "$out"/attn*.txt
grep -E "^8B " "$out/quant.txt"
tail -6 "$out/attention.txt"
exit "$status"
