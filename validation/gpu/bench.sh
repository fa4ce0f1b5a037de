#!/usr/bin/env bash
# The CUDA decode benchmark and its checks, in one run on the GPU machine (no Rust toolchain
# there: binaries built on a CPU machine are carried). Prints a short table last.
#
#   validation/gpu/bench.sh NEW_BIN_DIR [OLD_BIN_DIR] [OUT_DIR]
#
# NEW_BIN_DIR: tarfa-run, tarfa-convert, cuda_selftest, cuda_bench of the build under test:
#   CARGO_PROFILE_RELEASE_STRIP=true cargo build --release -p tarfa-run -p tarfa-convert \
#       --example cuda_selftest --example cuda_bench
#   (copy target/release/{tarfa-run,tarfa-convert} and target/release/examples/{cuda_selftest,
#   cuda_bench} into one folder)
# OLD_BIN_DIR (optional): cuda_selftest of the build before, for its own decode figure.
# OUT_DIR (default $OUT, else ./gpu-out): table.txt, bench.json, hf.json, logs.tar.gz.
#
# Steps (every one bounded by a timeout; DEADLINE seconds in all, default 400):
#   1. in the background: the synthetic Qwen3-30B-A3B bundle, 16 layers (~20 GB), written by
#      tarfa-convert synth straight on this machine; compute-sanitizer memcheck, racecheck,
#      initcheck and synccheck on GPU greedy runs of the four oracle fixtures
#   2. kernel checks; CPU-vs-CUDA selftests of the fixtures, of random models of every family,
#      and through the CLI (`tarfa-run selftest --backend cuda` on a converted fixture)
#   3. transformers BF16 on the same 16-layer shape (hf_baseline.py), the GPU otherwise idle
#   4. cuda_bench on the bundle: copy rate, weight bytes per token, decode in every mode, paired
#      A/B legacy vs default, per-kernel profile, prefill 512 and 2048, CPU-vs-CUDA selftest
#   5. the old build's decode figure on the same bundle (when time is left)
# HF=0 skips step 3. (Kernel versions are compared across builds: OLD_BIN_DIR, or validation/ab.)
# SM clocks are sampled during step 4 (logs/clocks.csv); NCU=1 adds Nsight Compute on the decode
# kernels of two profiled steps (logs/ncu.log).
set -u
NEW=$(cd "${1:?usage: bench.sh NEW_BIN_DIR [OLD_BIN_DIR] [OUT_DIR]}" && pwd)
OLD=${2:-}
[ -n "$OLD" ] && OLD=$(cd "$OLD" && pwd)
OUTD=${3:-${OUT:-./gpu-out}}
mkdir -p "$OUTD"
OUTD=$(cd "$OUTD" && pwd)
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
FIX=$ROOT/fixtures/oracle
LOG=$(mktemp -d /tmp/tarfa-bench.XXXX)/logs
mkdir -p "$LOG"
TABLE=$OUTD/table.txt
: > "$TABLE"
T0=$(date +%s)
DEADLINE=${DEADLINE:-400}
RESERVE=10
elapsed() { echo $(( $(date +%s) - T0 )); }
budget() {  # budget WANTED -> min(WANTED, time left), at least 1
  local left=$(( DEADLINE - RESERVE - $(elapsed) ))
  [ "$left" -lt 1 ] && left=1
  [ "$1" -lt "$left" ] && echo "$1" || echo "$left"
}
row() { echo "$1|$2|$3" >> "$TABLE"; }
snapshot() {  # what is done so far, in OUT_DIR (a call cut short still returns it)
  (cd "$(dirname "$LOG")" && tar czf "$OUTD/logs.tar.gz" logs) 2>/dev/null
  cp "$LOG/bench.log" "$OUTD/bench.log" 2>/dev/null
  true
}
collect() { grep -h '^TABLE|' "$1" | sed 's/^TABLE|//' >> "$TABLE" || true; }
step() {  # step NAME TIMEOUT CMD...  (log: $LOG/NAME.log)
  local name=$1 t; t=$(budget "$2"); shift 2
  local s; s=$(date +%s)
  timeout "$t" "$@" > "$LOG/$name.log" 2>&1
  local rc=$?
  echo "[$(elapsed)s] $name: rc=$rc in $(( $(date +%s) - s ))s" | tee -a "$LOG/steps.txt"
  collect "$LOG/$name.log"
  return $rc
}

. "$ROOT/validation/gpu/cuda-env.sh"
{
  date -u; uname -a; nproc; free -g
  nvidia-smi || true
  command -v compute-sanitizer && compute-sanitizer --version | tail -1
  python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)' || true
} > "$LOG/env.txt" 2>&1
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader 2>/dev/null | head -1 | sed 's/^/gpu: /'

# --- 1. background: the bundle, the sanitizers ---------------------------------------------
BIG=${BIG_DIR:-/tmp/tarfa-q30-16}
rm -rf "$BIG"
( s=$(date +%s)
  timeout "$(budget 240)" "$NEW/tarfa-convert" synth --shape qwen3-30b-a3b --layers "${BIG_LAYERS:-16}" \
    --skew 1 --format bundle "$BIG"
  echo "rc=$? in $(( $(date +%s) - s ))s" ) > "$LOG/synth-bundle.log" 2>&1 &
SYNTH_PID=$!

SAN_PIDS=()
if command -v compute-sanitizer >/dev/null; then
  for f in qwen3moe-a qwen3moe-code qwen3moe-dense qwen3moe-odd; do
    [ -d "$FIX/$f" ] || continue
    for tool in memcheck racecheck initcheck synccheck; do
      extra=""
      [ "$tool" = memcheck ] && extra="--leak-check full"
      ( timeout "$(budget 160)" nice compute-sanitizer --tool "$tool" $extra --error-exitcode 9 \
          "$NEW/cuda_selftest" generate "$FIX/$f" > "$LOG/san-$tool-$f.log" 2>&1
        echo "rc=$?" >> "$LOG/san-$tool-$f.log" ) &
      SAN_PIDS+=($!)
    done
  done
else
  row "sanitizers" "MISSING" "compute-sanitizer not on PATH"
fi

# --- 2. correctness -------------------------------------------------------------------------
step info 60 "$NEW/cuda_selftest" info
cat "$LOG/info.log"
step kernels 120 "$NEW/cuda_selftest" kernels
for f in qwen3moe-a qwen3moe-code qwen3moe-dense qwen3moe-odd; do
  [ -d "$FIX/$f" ] && step "selftest-$f" 120 "$NEW/cuda_selftest" fixture "$FIX/$f" --decode 8
done
for fam in qwen3_moe qwen2_moe mixtral olmoe; do
  step "selftest-synth-$fam" 120 "$NEW/cuda_selftest" synth "$fam"
done
CB=/tmp/tarfa-bundle-code
rm -rf "$CB"
if step convert-code 60 "$NEW/tarfa-convert" "$FIX/qwen3moe-code" "$CB"; then
  if step cli-selftest 120 "$NEW/tarfa-run" selftest --backend cuda "$CB" --json "$LOG/cli-selftest.json"; then
    row "tarfa-run selftest --backend cuda" PASS "$(grep -h '^PASS' "$LOG/cli-selftest.log" | head -1 | cut -c1-160)"
  else
    row "tarfa-run selftest --backend cuda" FAIL "see logs/cli-selftest.log"
  fi
fi

# --- wait for the background work -------------------------------------------------------------
wait "$SYNTH_PID"
echo "[$(elapsed)s] synthetic bundle: $(tail -1 "$LOG/synth-bundle.log")" | tee -a "$LOG/steps.txt"
for p in "${SAN_PIDS[@]}"; do wait "$p"; done
echo "[$(elapsed)s] sanitizers done" | tee -a "$LOG/steps.txt"
snapshot
for tool in memcheck racecheck initcheck synccheck; do
  clean=0; total=0; bad=""; modes=""
  for l in "$LOG"/san-$tool-*.log; do
    [ -f "$l" ] || continue
    total=$((total + 1))
    f=${l##*san-$tool-}; f=${f%.log}
    if grep -q "^rc=0$" "$l" && grep -qE "ERROR SUMMARY: 0 errors|RACECHECK SUMMARY: 0 hazards" "$l"; then
      clean=$((clean + 1))
    else
      bad="$bad $f($(grep -E "SUMMARY|^rc=" "$l" | tr '\n' ' '))"
    fi
    modes="$modes $(grep -o 'decode steps: [^)]*' "$l" | sort -u | tr '\n' ' ')"
  done
  [ $total -gt 0 ] && row "sanitizer $tool" "$([ $clean = $total ] && echo CLEAN || echo DIRTY)" \
    "$clean/$total fixture greedy runs clean;$(echo "$modes" | tr -s ' ' | cut -c1-80)$bad"
done

# --- 3. transformers on the same shape (GPU otherwise idle) ---------------------------------
if [ "${HF:-1}" = 0 ]; then
  row "transformers BF16 (same shape)" SKIPPED "HF=0 (measured before: docs/PERFORMANCE.md)"
elif command -v python3 >/dev/null; then
  PYTHONUNBUFFERED=1 step hf-baseline 100 python3 "$ROOT/validation/gpu/hf_baseline.py" "${BIG_LAYERS:-16}" "$OUTD/hf.json"
  if [ -f "$OUTD/hf.json" ]; then
    row "transformers BF16 (same shape)" "-" "$(python3 -c "import json; d=json.load(open('$OUTD/hf.json')); print(f\"decode {d['decode_tok_s']:.1f} tok/s, prefill 512 {d['prefill_512_tok_s']:.0f} tok/s, 2048 {d['prefill_2048_tok_s']:.0f} tok/s ({d['engine']})\")")"
  else
    row "transformers BF16 (same shape)" FAIL "see logs/hf-baseline.log"
  fi
fi

snapshot
# --- 4. the benchmark -------------------------------------------------------------------------
if [ -f "$BIG/model.jnf" ]; then
  # SM and memory clocks, power and load every 100 ms while the benchmark runs
  nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,utilization.gpu \
    --format=csv -lms 100 > "$LOG/clocks.csv" 2>&1 &
  CLOCK_PID=$!
  step bench 160 "$NEW/cuda_bench" "$BIG" --prompt 128 --decode 128 --prefill 512,2048 --pairs 8 \
    --profile-steps 16 --selftest-prompts 3 --json "$OUTD/bench.json"
  kill "$CLOCK_PID" 2>/dev/null
  row "SM clock during the benchmark" "-" "$(awk -F', ' 'NR>1 && $2+0>0 {n++; s+=$2; if ($2+0<m || m==0) m=$2+0; if ($2+0>M) M=$2+0} END {if (n) printf "%d samples: mean %.0f MHz, min %d, max %d", n, s/n, m, M}' "$LOG/clocks.csv")"
  # optional: Nsight Compute on the decode kernels of a few steps (NCU=1)
  if [ "${NCU:-0}" = 1 ] && command -v ncu >/dev/null; then
    step ncu 150 ncu --clock-control none --kernel-name regex:"attn_decode|dmv_bf16|router_bf16|router2_bf16|gate_up_dec_bf16|moe_down_dec|lmhead_bf16" \
      --launch-skip 40 --launch-count 14 --section SpeedOfLight --section Occupancy \
      --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis \
      "$NEW/cuda_bench" "$BIG" --only-profile --profile-steps 2
  fi
  snapshot
  # --- 5. the build before, same bundle ---------------------------------------------------------
  if [ -n "$OLD" ] && [ -x "$OLD/cuda_selftest" ]; then
    if [ $(( DEADLINE - RESERVE - $(elapsed) )) -gt 70 ]; then
      step old-bench 70 "$OLD/cuda_selftest" bench "$BIG" --prefill 128 --decode 64 --selftest-prompts 0
      sed -i 's/^figures /old build: figures /' "$TABLE"
    else
      row "old build" SKIPPED "not enough time left"
    fi
  fi
else
  row "bench" FAIL "bundle not generated: $(tail -3 "$LOG/synth-bundle.log" | tr '\n' ' ')"
fi
rm -rf "$BIG" "$CB"

nvidia-smi --query-gpu=name,memory.used,temperature.gpu,clocks.sm --format=csv > "$LOG/nvidia-smi-end.txt" 2>&1
snapshot
echo
echo "=== first problems reported ==="
grep -hE "FAIL|ERROR|error:|panicked|DIFFER|DIFFERENT|Invalid|Race|hazard|failed" "$LOG"/*.log 2>/dev/null \
  | grep -vE "ERROR SUMMARY: 0 errors|0 hazards|0 errors, 0 warnings|0 logit, 0 router, 0 stats" | cut -c1-300 | head -30
echo
cat "$LOG/steps.txt"
echo
echo "=== Tarfa CUDA decode ($(elapsed)s) ==="
column -t -s '|' "$TABLE" 2>/dev/null || cat "$TABLE"
