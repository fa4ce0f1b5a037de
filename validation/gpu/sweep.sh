#!/usr/bin/env bash
# Decode modes compared in one process, on the GPU machine (one call, ~4 min): a screening run
# before the benchmark of record (validation/gpu/bench.sh). Kernel versions are compared across
# builds (validation/ab takes two binaries; validation/kernels/README.md).
#
#   validation/gpu/sweep.sh BIN_DIR [OUT_DIR]
#
# BIN_DIR: tarfa-convert, cuda_bench and cuda_selftest built here (see bench.sh). Environment:
#   SETTINGS  ";"-separated decode modes (graph-pdl, graph, direct, legacy); the first is the
#             reference
#   CHECKS=1  the CPU-vs-CUDA selftests (fixtures and random families) while the bundle is
#             written, and compute-sanitizer memcheck on one fixture
#   DIAG=1    cuda_bench --graph-diag: per-kind costs of the default graph
#   ROUNDS, REPS  the sweep's interleaved rounds and graph replays per round (5, 30)
# Steps: 1. the 16-layer synthetic Qwen3-30B-A3B bundle (background) and the selftests;
# 2. cuda_bench --sweep (graph time per mode, tokens and last logits compared with the first
# mode's); 3. --graph-diag. Prints a short table last. OUT_DIR gets
# three files (table.txt, sweep.json, logs.tgz with every log), which the GPU tool can return.
set -u
BIN=$(cd "${1:?usage: sweep.sh BIN_DIR [OUT_DIR]}" && pwd)
OUTD=${2:-${OUT:-./gpu-out}}
mkdir -p "$OUTD"
OUTD=$(cd "$OUTD" && pwd)
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
FIX=$ROOT/fixtures/oracle
LOG=$(mktemp -d /tmp/tarfa-sweep.XXXX)/logs
mkdir -p "$LOG"
TABLE=$OUTD/table.txt
: > "$TABLE"
T0=$(date +%s)
. "$ROOT/validation/gpu/cuda-env.sh"
say() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
row() { echo "$1|$2|$3" >> "$TABLE"; }

BIG=${BIG_DIR:-/tmp/tarfa-q30-16}
SYNTH_PID=""
if [ ! -f "$BIG/model.jnf" ]; then
  rm -rf "$BIG"
  ( timeout 240 "$BIN/tarfa-convert" synth --shape qwen3-30b-a3b --layers 16 --skew 1 \
      --format bundle "$BIG" > "$LOG/synth.log" 2>&1; echo "rc=$?" >> "$LOG/synth.log" ) &
  SYNTH_PID=$!
fi

# 1. exactness under the settings to check (while the bundle is written)
i=0
for set in $([ "${CHECKS:-0}" = 1 ] && echo default); do
  i=$((i + 1))
  pass=0; total=0; bad=""
  for f in qwen3moe-a qwen3moe-code qwen3moe-dense qwen3moe-odd; do
    [ -d "$FIX/$f" ] || continue
    total=$((total + 1))
    if timeout 120 "$BIN/cuda_selftest" fixture "$FIX/$f" --decode 8 > "$LOG/check$i-$f.log" 2>&1; then
      pass=$((pass + 1)); else bad="$bad $f"; fi
  done
  for fam in qwen3_moe qwen2_moe mixtral olmoe; do
    total=$((total + 1))
    if timeout 120 "$BIN/cuda_selftest" synth "$fam" > "$LOG/check$i-$fam.log" 2>&1; then
      pass=$((pass + 1)); else bad="$bad $fam"; fi
  done
  row "selftests [$set]" "$([ $pass = $total ] && echo PASS || echo FAIL)" "$pass/$total CPU-vs-CUDA selftests (4 fixtures, 4 random families)$bad"
  if command -v compute-sanitizer >/dev/null; then
    timeout 200 compute-sanitizer --tool memcheck --error-exitcode 9 \
      "$BIN/cuda_selftest" generate "$FIX/qwen3moe-code" > "$LOG/memcheck$i.log" 2>&1
    rc=$?
    row "memcheck [$set]" "$([ $rc = 0 ] && grep -q 'ERROR SUMMARY: 0 errors' "$LOG/memcheck$i.log" && echo CLEAN || echo DIRTY)" \
      "qwen3moe-code greedy, rc=$rc, $(grep -o 'ERROR SUMMARY: [0-9]* errors' "$LOG/memcheck$i.log" | tail -1)"
  fi
  say "checks [$set] $pass/$total"
done
[ -n "$SYNTH_PID" ] && wait "$SYNTH_PID"
say "bundle: $(tail -1 "$LOG/synth.log" 2>/dev/null)"

# 2. the sweep
if [ -n "${SETTINGS:-}" ]; then
  timeout 300 "$BIN/cuda_bench" "$BIG" --prompt 128 --sweep "$SETTINGS" --sweep-rounds "${ROUNDS:-5}" \
    --graph-diag "${REPS:-30}" --json "$LOG/sweep.json" > "$LOG/sweep.log" 2>&1
  say "sweep rc=$?"
  grep -E "^roofline" "$LOG/sweep.log"
  grep -h '^TABLE|' "$LOG/sweep.log" | sed 's/^TABLE|//' >> "$TABLE"
fi

# 3. per-kind costs
i=0
for set in $([ "${DIAG:-0}" = 1 ] && echo default); do
  i=$((i + 1))
  timeout 120 "$BIN/cuda_bench" "$BIG" --prompt 128 --graph-diag "${REPS:-30}" --only-graph-diag \
    --json "$LOG/diag$i.json" > "$LOG/diag$i.log" 2>&1
  say "graph-diag [$set] rc=$?"
  grep -E "^graph-diag" "$LOG/diag$i.log" | sed "s/^/[$i] /"
done
cp "$LOG/sweep.json" "$OUTD/" 2>/dev/null
(cd "$(dirname "$LOG")" && tar czf "$OUTD/logs.tgz" logs)
say "done"
echo "=== table ==="
column -t -s'|' "$TABLE" 2>/dev/null || cat "$TABLE"
