#!/usr/bin/env bash
# Issue 21's GPU checks and figures: DeepSeek-V3/V2 (multi-head latent attention, both
# group-limited routers, ungated shared experts) and GLM-4.5 (partial rotary) on the CUDA backend.
#
#   validation/gpu/arch.sh BIN_DIR [OUT_DIR]
#
# BIN_DIR: release tarfa-convert, examples/cuda_selftest and examples/cuda_bench
#   (CARGO_PROFILE_RELEASE_STRIP=true cargo build --release -p tarfa-run -p tarfa-convert --bins \
#      --example cuda_bench --example cuda_selftest).
# 1. kernel checks (every kernel against its CPU reference, route_grouped included);
# 2. CPU vs CUDA selftests, every logit and router record bit for bit, on the DeepSeek and GLM
#    fixtures (and qwen3moe-a as the control of the kernels they share);
# 3. compute-sanitizer memcheck, racecheck, initcheck and synccheck on their generate runs;
# 4. figures: `cuda_bench` on a synthetic DeepSeek-V3-shaped bundle (SHAPE, default deepseek-v3,
#    LAYERS 4: 3 dense layers and 1 MoE layer of 256 experts, ~19 GB) and GLM-4.5-Air (LAYERS 4):
#    batch-1 decode tok/s against the HBM roofline measured in the same call, prefill tok/s, and
#    the CPU-vs-CUDA selftest on the big model. SKIP_BIG=1 skips it.
# Prints a short table last (OUT_DIR/table.txt, logs in OUT_DIR/logs).
set -u
BIN=$(cd "${1:?usage: arch.sh BIN_DIR [OUT_DIR]}" && pwd)
OUTD=${2:-${OUT:-./gpu-out}}
mkdir -p "$OUTD/logs"
OUTD=$(cd "$OUTD" && pwd)
LOG=$OUTD/logs
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
. "$ROOT/validation/gpu/cuda-env.sh"
FIX=$ROOT/fixtures/oracle
ST=$BIN/examples/cuda_selftest
CB=$BIN/examples/cuda_bench
T0=$(date +%s)
say() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
TABLE=$OUTD/table.txt
: > "$TABLE"
row() { echo "$1|$2|$3" >> "$TABLE"; }
collect() { grep -h '^TABLE|' "$1" | sed "s/^TABLE|/${2:-}/" >> "$TABLE" || true; }
FIXTURES="deepseekv3-s deepseekv3-plain-s deepseekv2-yarn-s glm4moe-s"

# the big bundles are written in the background (CPU and disk) while the checks run
BIGS=()
if [ "${SKIP_BIG:-0}" != 1 ]; then
  for shape in ${SHAPES:-deepseek-v3 glm-4.5-air}; do
    d=/tmp/tarfa-$shape-${LAYERS:-4}
    BIGS+=("$d")
    ( rm -rf "$d"; s=$(date +%s)
      timeout 300 nice "$BIN/tarfa-convert" synth --shape "$shape" --layers "${LAYERS:-4}" --skew 1 \
        --format bundle "$d"
      echo "rc=$? in $(( $(date +%s) - s ))s" ) > "$LOG/synth-$shape.log" 2>&1 &
  done
fi

timeout 120 "$ST" kernels > "$LOG/kernels.log" 2>&1
say "kernels rc=$?"
collect "$LOG/kernels.log"

SAN=()
if command -v compute-sanitizer > /dev/null; then
  for f in deepseekv3-s deepseekv2-yarn-s glm4moe-s; do
    for tool in memcheck racecheck initcheck synccheck; do
      ( timeout 400 nice compute-sanitizer --tool $tool --error-exitcode 9 "$ST" generate "$FIX/$f" \
          --decode 6 > "$LOG/san-$tool-$f.log" 2>&1
        echo "rc=$?" >> "$LOG/san-$tool-$f.log" ) &
      SAN+=($!)
    done
  done
else
  row "compute-sanitizer" MISSING "not on PATH"
fi

for f in $FIXTURES qwen3moe-a; do
  timeout 200 "$ST" fixture "$FIX/$f" --decode 8 > "$LOG/selftest-$f.log" 2>&1
  say "selftest $f rc=$?"
  collect "$LOG/selftest-$f.log" "$f: "
done

for p in "${SAN[@]}"; do wait "$p"; done
say "sanitizers"
for tool in memcheck racecheck initcheck synccheck; do
  for f in deepseekv3-s deepseekv2-yarn-s glm4moe-s; do
    l=$LOG/san-$tool-$f.log
    rc=$(grep -o '^rc=[0-9]*' "$l" | tail -1)
    row "compute-sanitizer $tool, generate $f" "$([ "$rc" = rc=0 ] && echo CLEAN || echo "$rc")" \
      "$(grep -hE 'ERROR SUMMARY|RACECHECK SUMMARY' "$l" | tail -1)"
  done
done

wait  # the bundles
for d in "${BIGS[@]}"; do
  shape=${d#/tmp/tarfa-}
  if [ ! -f "$d/model.jnf" ]; then
    row "synth $shape" FAIL "$(tail -3 "$LOG/synth-${shape%-*}.log" | tr '\n' ' ')"
    continue
  fi
  left=$(( ${DEADLINE:-560} - ($(date +%s) - T0) ))
  if [ "$left" -lt 60 ]; then row "bench $shape" SKIPPED "no time left in the call"; rm -rf "$d"; continue; fi
  say "bench $shape"
  timeout $(( left < 200 ? left - 10 : 200 )) "$CB" "$d" --prompt 128 --decode 64 --prefill 512 --profile-steps 4 \
    --selftest-prompts 1 --json "$OUTD/bench-$shape.json" > "$LOG/bench-$shape.log" 2>&1
  say "bench $shape rc=$?"
  collect "$LOG/bench-$shape.log" "$shape: "
  grep -h "^roofline\|resident on" "$LOG/bench-$shape.log" | sed "s/^/$shape: /" | while read -r l; do
    row "$l" - -
  done
  rm -rf "$d"
done
say "done"
tar -czf "$OUTD/logs.tar.gz" -C "$OUTD" logs
column -t -s'|' "$TABLE" | cut -c1-220
