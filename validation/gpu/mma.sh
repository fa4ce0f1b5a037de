#!/usr/bin/env bash
# Issue 25 on one H200: is Hopper's BF16 mma.sync the CPU model's integer function, and how fast
# is a tensor-core GEMM under the candidate contract v2? About 4 minutes; prints a short table.
#
#   validation/gpu/mma.sh BIN_DIR [OUT_DIR]
#
# BIN_DIR holds mma-check, built on a CPU machine (no Rust on the GPU machine):
#   CARGO_PROFILE_RELEASE_STRIP=true cargo build --release -p tarfa-mma
#   (then carry target/release/mma-check)
# Writes OUT_DIR/table.txt (the table below), OUT_DIR/*.txt (each step's full output) and
# OUT_DIR/*.json (the same as JSON). OUT_DIR: default $OUT, else ./mma-out.
# Steps:
#   1. verify: >= 10^8 random and adversarial cases (up to 10^9 in VERIFY_SECONDS), hardware vs
#      model bit for bit, model variants scored on the first 5*10^7 cases
#   2. gemm-bench: the prototype GEMM's bit check (every output of 4 small shapes; 4096 sampled
#      outputs of each bench shape) and TFLOP/s at M=2048, N=128/512/2048, K=2048/768
# VERIFY_ARGS=--dry-run tests this script without a GPU (the model stands in for the hardware).
#   3. cpu-bench: the CPU emulator's ns per element vs today's FMA dot on the GPU machine's CPU
#   4. compute-sanitizer (memcheck, racecheck, initcheck, synccheck) on a small verify and a small
#      gemm-bench (skipped if absent)
# SKIP_VERIFY=1 leaves step 1 out, SANITIZE=0 step 4.
# MODEL: the model variant verify compares with (default no-zeros-in-max); SKIP_GEMM=1, SKIP_CPU=1
# leave steps 2 and 3 out (a re-run of verify alone).
set -u
BIN=$(cd "${1:?usage: mma.sh BIN_DIR [OUT_DIR]}" && pwd)
OUTD=${2:-${OUT:-./mma-out}}
mkdir -p "$OUTD"
OUTD=$(cd "$OUTD" && pwd)
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
# shellcheck source=/dev/null
. "$ROOT/validation/gpu/cuda-env.sh"
MC=$BIN/mma-check
TABLE=$OUTD/table.txt
VERIFY_CASES=${VERIFY_CASES:-1000000000}
VERIFY_SECONDS=${VERIFY_SECONDS:-100}
# the model verify compares with (the first counterexample corrected it to no-zeros-in-max)
MODEL=${MODEL:-no-zeros-in-max}
: > "$TABLE"
row() { printf '%-22s %-10s %s\n' "$1" "$2" "$3" >> "$TABLE"; }
res() { case $1 in 0) echo OK ;; 1) echo MISMATCH ;; 124) echo TIMEOUT ;; *) echo "ERROR($1)" ;; esac; }
T0=$(date +%s)

command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader > "$OUTD/device.txt" 2>&1
row device "-" "$(head -1 "$OUTD/device.txt")"

# 1. verify (text, then the JSON of a short repeat is not needed: the text has everything)
if [ "${SKIP_VERIFY:-0}" != 1 ]; then
timeout $((VERIFY_SECONDS + 60)) "$MC" verify --cases "$VERIFY_CASES" --max-seconds "$VERIFY_SECONDS" \
    --variant-cases 50000000 --model "$MODEL" --dump "$OUTD/mismatches.txt" ${VERIFY_ARGS:-} > "$OUTD/verify.txt" 2>&1
rc=$?
row "verify model" "-" "$MODEL; every mismatch in mismatches.txt ($(grep -vc '^#' "$OUTD/mismatches.txt" 2>/dev/null) lines)"
row verify "$(res $rc)" "$(grep -E '^TOTAL' "$OUTD/verify.txt" | awk '{print $2" cases, "$3" mismatches"}'); $(grep -E '^RESULT|error:|SMOKE' "$OUTD/verify.txt" | head -1)"
row "verify time" "-" "$(grep '^verify:' "$OUTD/verify.txt" | sed 's/.*), //')"
row "hw NaN bits" "-" "$(grep 'hardware NaN' "$OUTD/verify.txt" | sed 's/.*patterns: //' | cut -c1-80)"
while read -r name n; do
  row "  $name" "$n" "mismatches of this model variant (first 5e7 cases)"
done < <(sed -n '/^variants scored/,/^RESULT/p' "$OUTD/verify.txt" | grep '^  ' | awk '{print $1, $2}')
if [ $rc -eq 1 ]; then
  grep -A14 '^RESULT' "$OUTD/verify.txt" | tail -n +2 | while IFS= read -r l; do row "  counterexample" "" "$l"; done
  grep -E '^[a-z-]+ +[0-9]+ +[0-9]+' "$OUTD/verify.txt" | awk '$3 > 0 {print $1, $2, $3, $4, $5, $6}' |
    while read -r m c b nb zs u; do row "  mode $m" "$b/$c" "nan-bits $nb, zero-sign $zs, 1-ulp $u"; done
fi
fi

# 2. gemm-bench
if [ "${SKIP_GEMM:-0}" != 1 ]; then
timeout 150 "$MC" gemm-bench > "$OUTD/gemm.txt" 2>&1
rc=$?
row gemm-check "$(res $rc)" "$(grep -E '^RESULT|error:' "$OUTD/gemm.txt" | head -1 | sed 's/RESULT: //')"
grep -E '^  [0-9]+x' "$OUTD/gemm.txt" | while read -r shape rest; do row "  check $shape" "" "$rest"; done
grep -E '^ +[0-9]+ +[0-9]+ +[0-9]+ ' "$OUTD/gemm.txt" | while read -r m n k ms tf mtf bad; do
  row "  gemm ${m}x${n}x${k}" "$tf" "TFLOP/s ($mtf MMA TFLOP/s, $ms ms, sampled mismatches $bad)"
done

fi

# 3. the CPU emulator vs the FMA dot on this machine's CPU (informational)
[ "${SKIP_CPU:-0}" != 1 ] && timeout 90 "$MC" cpu-bench --mem-bytes 536870912 > "$OUTD/cpu.txt" 2>&1
grep -E 'ns/elem' "$OUTD/cpu.txt" | while read -r l; do
  row "  cpu $(echo "$l" | awk '{print $1}')" "$(echo "$l" | sed 's/.* \([0-9.]*\) ns\/elem.*/\1/')" "ns/elem $(echo "$l" | sed 's/^[^(]*\(([^)]*)\).*/\1/')"
done

# 4. compute-sanitizer, the four tools, on a small verify and a small gemm-bench (bounded)
if [ "${SANITIZE:-1}" = 0 ]; then
  :
elif command -v compute-sanitizer > /dev/null; then
  for tool in memcheck racecheck initcheck synccheck; do
    timeout 45 compute-sanitizer --tool $tool --error-exitcode 9 "$MC" verify --cases 12800 \
        --variant-cases 0 --model "$MODEL" > "$OUTD/$tool-verify.txt" 2>&1
    rc=$?; row "$tool verify" "$( [ $rc -le 1 ] && echo OK || echo "rc=$rc")" "$(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUTD/$tool-verify.txt" | tail -1)"
    timeout 150 compute-sanitizer --tool $tool --error-exitcode 9 "$MC" gemm-bench --m 128 --n 64 --k 128 \
        --sample 64 > "$OUTD/$tool-gemm.txt" 2>&1
    rc=$?; row "$tool gemm" "$( [ $rc -eq 0 ] && echo OK || echo "rc=$rc")" "$(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUTD/$tool-gemm.txt" | tail -1)"
  done
else
  row sanitizers SKIP "compute-sanitizer not found"
fi
row "wall" "-" "$(( $(date +%s) - T0 )) s"
cat "$TABLE"
