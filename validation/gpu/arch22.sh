#!/usr/bin/env bash
# Issue 22's GPU checks: gpt-oss (sinks, windows, the biased router, expert biases, the clamped
# SwiGLU, MXFP4 experts), Llama 4 (input-scaling router, chunked and NoPE layers, L2 q/k norm),
# Mixtral's sliding_window and OLMoE's clip_qkv on the CUDA backend.
#
#   validation/gpu/arch22.sh BIN_DIR [OUT_DIR]
#
# BIN_DIR: release tarfa-run, tarfa-convert, examples/cuda_selftest
#   (CARGO_PROFILE_RELEASE_STRIP=true cargo build --release -p tarfa-run -p tarfa-convert --bins \
#      --example cuda_bench --example cuda_selftest).
# EXTRA: a directory holding the shared oracle's gptoss-a, gptoss-mxfp4-a and llama4-a (carried
#   with the binaries; default BIN_DIR/oracle).
# 1. kernel checks (every kernel against its CPU reference);
# 2. CPU vs CUDA selftests, every logit and router record bit for bit, on each fixture
#    (checkpoint directories; qwen3moe-a as the control);
# 3. the fixtures as bundles: `tarfa-run selftest --backend cuda --stream-sweep`, CPU vs CUDA
#    resident and streamed through every budget, I/O mode and policy, byte for byte;
# 4. compute-sanitizer memcheck, racecheck, initcheck and synccheck on generate runs.
# Prints a short table last (OUT_DIR/table.txt, logs in OUT_DIR/logs.tar.gz).
set -u
BIN=$(cd "${1:?usage: arch22.sh BIN_DIR [OUT_DIR]}" && pwd)
OUTD=${2:-${OUT:-./gpu-out}}
mkdir -p "$OUTD/logs"
OUTD=$(cd "$OUTD" && pwd)
LOG=$OUTD/logs
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
. "$ROOT/validation/gpu/cuda-env.sh"
FIX=$ROOT/fixtures/oracle
EXTRA=${EXTRA:-$BIN/oracle}
ST=$BIN/examples/cuda_selftest
T0=$(date +%s)
say() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
TABLE=$OUTD/table.txt
: > "$TABLE"
row() { echo "$1|$2|$3" >> "$TABLE"; }
collect() { grep -h '^TABLE|' "$1" | sed "s/^TABLE|/${2:-}/" >> "$TABLE" || true; }
dir_of() { if [ -d "$FIX/$1" ]; then echo "$FIX/$1"; else echo "$EXTRA/$1"; fi; }
FIXTURES=${FIXTURES:-"gptoss-a gptoss-mxfp4-a llama4-a llama4-dense-s llama4-llama3-s mixtral-window-s olmoe-clip-s"}
SAN_FIX=${SAN_FIX:-"gptoss-mxfp4-a llama4-dense-s olmoe-clip-s"}

timeout 120 "$ST" kernels > "$LOG/kernels.log" 2>&1
say "kernels rc=$?"
collect "$LOG/kernels.log"

SAN=()
if command -v compute-sanitizer > /dev/null; then
  for f in $SAN_FIX; do
    for tool in memcheck racecheck initcheck synccheck; do
      ( timeout ${SAN_TIMEOUT:-400} nice compute-sanitizer --tool $tool --error-exitcode 9 "$ST" generate "$(dir_of $f)" \
          --decode 6 > "$LOG/san-$tool-$f.log" 2>&1
        echo "rc=$?" >> "$LOG/san-$tool-$f.log" ) &
      SAN+=($!)
    done
  done
else
  row "compute-sanitizer" MISSING "not on PATH"
fi

for f in $FIXTURES qwen3moe-a; do
  timeout 200 "$ST" fixture "$(dir_of $f)" --decode 8 > "$LOG/selftest-$f.log" 2>&1
  say "selftest $f rc=$?"
  collect "$LOG/selftest-$f.log" "$f: "
done

# bundles: resident and streamed through every budget and policy, CPU vs CUDA byte for byte
for f in $FIXTURES; do
  b=/tmp/tarfa22-$f
  rm -rf "$b"
  if ! timeout 60 "$BIN/tarfa-convert" "$(dir_of $f)" "$b" > "$LOG/convert-$f.log" 2>&1; then
    row "convert $f" FAIL "$(grep -m1 error "$LOG/convert-$f.log" | cut -c1-160)"
    continue
  fi
  timeout 150 "$BIN/tarfa-run" selftest "$b" --backend cuda --stream-sweep > "$LOG/sweep-$f.log" 2>&1
  rc=$?
  row "stream sweep $f (CPU vs CUDA, every budget/policy)" "$([ $rc = 0 ] && echo PASS || echo "FAIL rc=$rc")" \
    "$(grep -cE 'PASS|ok' "$LOG/sweep-$f.log") lines ok; $(grep -m1 -iE 'mismatch|differ|error' "$LOG/sweep-$f.log" | cut -c1-120)"
  say "sweep $f rc=$rc"
done

for p in "${SAN[@]}"; do wait "$p"; done
say "sanitizers"
for tool in memcheck racecheck initcheck synccheck; do
  for f in $SAN_FIX; do
    l=$LOG/san-$tool-$f.log
    rc=$(grep -o '^rc=[0-9]*' "$l" | tail -1)
    row "compute-sanitizer $tool, generate $f" "$([ "$rc" = rc=0 ] && echo CLEAN || echo "$rc")" \
      "$(grep -hE 'ERROR SUMMARY|RACECHECK SUMMARY' "$l" | tail -1)"
  done
done
say "done"
tar -czf "$OUTD/logs.tar.gz" -C "$OUTD" logs && rm -rf "$LOG"
column -t -s'|' "$TABLE" | cut -c1-220
