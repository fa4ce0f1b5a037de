#!/usr/bin/env bash
# Captures on CUDA (issue 20) on the GPU machine: every kernel against its CPU reference, then
# `cuda_selftest captures` (CPU vs CUDA, every captured value bit for bit: residual, attn_out,
# mlp_out, router logits and probabilities, expert_out; one sequence, a single token, three
# sequences in a step; all layers and a selection) on each fixture, and compute-sanitizer
# (memcheck, racecheck, initcheck, synccheck) on the capture-only launches.
#
#   validation/gpu/captures.sh BIN_DIR [OUT_DIR]
#
# BIN_DIR: examples/cuda_selftest, release (CARGO_PROFILE_RELEASE_STRIP=true cargo build
#   --release -p tarfa-run --example cuda_selftest). EXTRA: a directory of shared oracle
#   fixtures carried with it (default BIN_DIR/oracle); FIXTURES and SAN_FIX name the fixtures.
# Prints a short table last (OUT_DIR/table.txt). Exit 0 when everything passed, 1 otherwise.
set -u
BIN=$(cd "${1:?usage: captures.sh BIN_DIR [OUT_DIR]}" && pwd) || exit 2
OUTD=${2:-${OUT:-./gpu-out}}
mkdir -p "$OUTD/logs" && OUTD=$(cd "$OUTD" && pwd) || exit 3
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
collect() { grep -h '^TABLE|' "$1" | sed "s/^TABLE|//" >> "$TABLE" || true; }
dir_of() { if [ -d "$FIX/$1" ]; then echo "$FIX/$1"; else echo "$EXTRA/$1"; fi; }
FIXTURES=${FIXTURES:-"qwen3moe-a qwen2moe-s olmoe-s deepseekv3-s mixtral-s llama4-llama3-s glm4moe-s gptoss-a deepseekv3-a qwen3next-a qwen35moe-a"}
SAN_FIX=${SAN_FIX:-"qwen2moe-s"}
status=0

timeout 120 "$ST" kernels > "$LOG/kernels.log" 2>&1
rc=$?; [ $rc -ne 0 ] && status=1
say "kernels rc=$rc"
collect "$LOG/kernels.log"

SAN=()
if command -v compute-sanitizer > /dev/null; then
  for f in $SAN_FIX; do
    for tool in memcheck racecheck initcheck synccheck; do
      ( timeout "${SAN_TIMEOUT:-400}" nice compute-sanitizer --tool $tool --error-exitcode 9 "$ST" captures "$(dir_of "$f")" \
          > "$LOG/san-$tool-$f.log" 2>&1
        echo "rc=$?" >> "$LOG/san-$tool-$f.log" ) &
      SAN+=($!)
    done
  done
else
  row "compute-sanitizer" MISSING "not on PATH"; status=1
fi

for f in $FIXTURES; do
  d=$(dir_of "$f")
  [ -d "$d" ] || { row "captures $f" ABSENT "-"; continue; }
  timeout 200 "$ST" captures "$d" > "$LOG/captures-$f.log" 2>&1
  rc=$?; [ $rc -ne 0 ] && status=1
  say "captures $f rc=$rc"
  collect "$LOG/captures-$f.log"
done

for p in "${SAN[@]}"; do wait "$p"; done
for f in $SAN_FIX; do
  [ ${#SAN[@]} -gt 0 ] || break
  for tool in memcheck racecheck initcheck synccheck; do
    l=$LOG/san-$tool-$f.log
    rc=$(grep -o 'rc=[0-9]*' "$l" | tail -1)
    summ=$(grep -h 'ERROR SUMMARY\|RACECHECK SUMMARY' "$l" | tail -1)
    pass=$(grep -c '|PASS|' "$l")
    if [ "$rc" = rc=0 ] && [ "$pass" -ge 1 ]; then v=CLEAN; else v="FAIL ($rc)"; status=1; fi
    row "compute-sanitizer $tool, captures $f" "$v" "${summ:-no summary}"
  done
done
tar czf "$OUTD/logs.tar.gz" -C "$OUTD" logs && rm -rf "$LOG"
say "done, status $status"
sed "s/|/  |  /g" "$TABLE"
exit $status
