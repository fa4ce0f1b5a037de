#!/usr/bin/env bash
# Where the CUDA decode step's time goes, on the GPU machine (one call, ~300 s): a diagnostic
# for kernel work, not a benchmark of record (validation/gpu/bench.sh is that).
#
#   validation/gpu/diag.sh BIN_DIR [OUT_DIR]
#
# BIN_DIR: tarfa-convert and cuda_bench built here (see bench.sh). Steps:
#   1. the 16-layer synthetic Qwen3-30B-A3B bundle (tarfa-convert synth --format bundle)
#   2. cuda_bench --graph-diag: the decode graph's time per step with each kind of launch left
#      out and with each kind alone, for every kernel-version setting in $VARIANTS
#      (";"-separated environment assignments; "" is the default)
#   3. nsys, when installed: the graph's nodes (kernel durations and the gaps between them)
#   4. ncu, when installed: one layer's decode kernels and the lm_head (speed of light, warp
#      stalls, occupancy), launched one by one, caches not flushed, with $NCU_ENV set
set -u
BIN=$(cd "${1:?usage: diag.sh BIN_DIR [OUT_DIR]}" && pwd)
OUTD=${2:-${OUT:-./gpu-out}}
mkdir -p "$OUTD"
OUTD=$(cd "$OUTD" && pwd)
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
LOG=$OUTD/diag
mkdir -p "$LOG"
T0=$(date +%s)
. "$ROOT/validation/gpu/cuda-env.sh"
say() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
BIG=${BIG_DIR:-/tmp/tarfa-q30-16}
if [ ! -f "$BIG/model.jnf" ]; then
  rm -rf "$BIG"
  timeout 240 "$BIN/tarfa-convert" synth --shape qwen3-30b-a3b --layers 16 --skew 1 \
    --format bundle "$BIG" > "$LOG/synth.log" 2>&1
  say "synth rc=$?"
fi
REPS=${REPS:-50}
IFS=';' read -r -a VARS <<< "${VARIANTS:-}"
[ ${#VARS[@]} -eq 0 ] && VARS=("")
i=0
for v in "${VARS[@]}"; do
  i=$((i + 1))
  env $v timeout 120 "$BIN/cuda_bench" "$BIG" --prompt 128 --graph-diag "$REPS" --only-graph-diag \
    --json "$LOG/graph-$i.json" > "$LOG/graph-$i.log" 2>&1
  say "graph-diag [$v] rc=$?"
  grep -E "^graph-diag|roofline" "$LOG/graph-$i.log" | sed "s/^/[$i] /"
done
if command -v nsys >/dev/null; then
  timeout 120 nsys profile --cuda-graph-trace=node -t cuda -o "$LOG/nsys" --force-overwrite true \
    "$BIN/cuda_bench" "$BIG" --prompt 128 --graph-diag 3 --graph-diag-all --only-graph-diag \
    > "$LOG/nsys.log" 2>&1
  say "nsys rc=$?"
  timeout 120 nsys stats --report cuda_gpu_trace --format csv --output "$LOG/trace" "$LOG/nsys.nsys-rep" \
    > "$LOG/nsys-stats.log" 2>&1
  say "nsys stats rc=$?"
  f=$(ls "$LOG"/trace*.csv 2>/dev/null | head -1)
  [ -n "$f" ] && python3 "$ROOT/validation/gpu/tools/nsys_gaps.py" "$f" | tee "$LOG/gaps.txt"
  rm -f "$LOG"/*.sqlite
else
  say "nsys: not installed"
fi
if command -v ncu >/dev/null; then
  env ${NCU_ENV:-} timeout 150 ncu --cache-control none --clock-control none \
    --kernel-name regex:"attn_decode|dmv|router|gate_up_dec|moe_down_dec|lmhead" \
    --launch-skip 30 --launch-count 13 --section SpeedOfLight --section Occupancy \
    --section LaunchStats --section WarpStateStats --section SchedulerStats \
    --section MemoryWorkloadAnalysis --section SourceCounters \
    "$BIN/cuda_bench" "$BIG" --prompt 128 --only-profile --profile-steps 2 > "$LOG/ncu.log" 2>&1
  say "ncu rc=$?"
  grep -E "^  [a-z_0-9]+.*\(|Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Stall|Warp Cycles Per Issued" "$LOG/ncu.log" | head -150
else
  say "ncu: not installed"
fi
say "done"
