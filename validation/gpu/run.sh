#!/usr/bin/env bash
# Every GPU check of the CUDA backend in one run on the GPU machine (no Rust toolchain there:
# the binaries are built on a CPU machine and carried). Prints a short table last.
#
#   validation/gpu/run.sh BIN_DIR [OUT_DIR]
#
# BIN_DIR holds tarfa-convert, examples/cuda_selftest and, optionally, tarfa-run and a test
# binary named cuda_backend (cargo test --release --no-run -p tarfa-run --test cuda_backend).
# Build them with:
#   CARGO_PROFILE_RELEASE_STRIP=true cargo build --release -p tarfa-run -p tarfa-convert \
#       --example cuda_selftest
# Logs end up in OUT_DIR/logs.tar.gz (OUT_DIR: default $OUT, else ./gpu-out), with table.txt.
# Steps, all bounded by timeouts:
#   1. device info, kernel checks (each kernel vs the CPU reference functions)
#   2. CPU vs CUDA selftests, byte for byte: every oracle fixture, random models of each family
#   3. compute-sanitizer memcheck, racecheck, initcheck, synccheck on the fixtures' generate runs
#   4. (optional, SKIP_ORACLE=1 to skip) make_oracle.py for qwen3moe-dense/-odd, compared with
#      the committed fixtures
#   5. figures: decode and prefill tok/s for qwen3moe-code and a 16-layer synthetic
#      Qwen3-30B-A3B bundle (generated here, ~20 GB; SKIP_BIG=1 to skip; BIG_FORMAT=hub writes
#      the same weights as safetensors shards instead), plus a CPU vs CUDA selftest on it
# SKIP_CHECKS=1 runs only step 5.
set -u
BIN=$(cd "${1:?usage: run.sh BIN_DIR [OUT_DIR]}" && pwd)
OUTD=${2:-${OUT:-./gpu-out}}
mkdir -p "$OUTD"
OUTD=$(cd "$OUTD" && pwd)
LOG=$(mktemp -d /tmp/tarfa-gpu-logs.XXXX)/logs
mkdir -p "$LOG"
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
FIX=$ROOT/fixtures/oracle
ST=$BIN/examples/cuda_selftest
[ -x "$ST" ] || ST=$BIN/cuda_selftest
TABLE=$OUTD/table.txt
: > "$TABLE"
T0=$(date +%s)
SAN_PIDS=()
row() { echo "$1|$2|$3" >> "$TABLE"; }
elapsed() { echo $(( $(date +%s) - T0 )); }
# Every step's timeout is cut to what is left before DEADLINE seconds (the device call's limit
# is 600 s), keeping RESERVE seconds for the summary.
DEADLINE=${DEADLINE:-570}
RESERVE=15
budget() {  # budget WANTED -> min(WANTED, time left), at least 1
  local left=$(( DEADLINE - RESERVE - $(elapsed) ))
  [ "$left" -lt 1 ] && left=1
  [ "$1" -lt "$left" ] && echo "$1" || echo "$left"
}

# CUDA libraries and tools where the image keeps them
for d in /usr/local/cuda/lib64 /usr/local/cuda-13.0/lib64 /usr/local/cuda/targets/x86_64-linux/lib \
         /opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib; do
  [ -d "$d" ] && export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$d"
done
for d in /usr/local/cuda/bin /usr/local/cuda-13.0/bin; do [ -d "$d" ] && export PATH="$PATH:$d"; done
export RAYON_NUM_THREADS=${RAYON_NUM_THREADS:-16}

{
  date -u; uname -a; nproc; free -g
  nvidia-smi || true
  ldconfig -p | grep -E "libcuda\.so|libnvrtc" || true
  command -v compute-sanitizer && compute-sanitizer --version | tail -1
} > "$LOG/env.txt" 2>&1

collect() {  # TABLE| lines of a log into the table
  grep -h '^TABLE|' "$1" | sed 's/^TABLE|//' >> "$TABLE" || true
}

step() {  # step NAME TIMEOUT CMD...  (log: $LOG/NAME.log)
  local name=$1 t; t=$(budget "$2"); shift 2
  local s; s=$(date +%s)
  timeout "$t" "$@" > "$LOG/$name.log" 2>&1
  local rc=$?
  echo "[$(elapsed)s] $name: rc=$rc in $(( $(date +%s) - s ))s" | tee -a "$LOG/steps.txt"
  collect "$LOG/$name.log"
  return $rc
}

# --- background work: the synthetic bundle (CPU and disk), the oracle ---------------------
BIG=${BIG_DIR:-/tmp/tarfa-q30-16}
if [ "${SKIP_BIG:-0}" != 1 ]; then
  rm -rf "$BIG"
  ( s=$(date +%s)
    timeout "$(budget 330)" "$BIN/tarfa-convert" synth --shape qwen3-30b-a3b --layers "${BIG_LAYERS:-16}" --skew 1 \
      --format "${BIG_FORMAT:-bundle}" "$BIG"
    echo "rc=$? in $(( $(date +%s) - s ))s" ) > "$LOG/synth-bundle.log" 2>&1 &
  SYNTH_PID=$!
fi
if [ "${SKIP_ORACLE:-0}" != 1 ] && [ "${SKIP_CHECKS:-0}" != 1 ] && command -v python3 >/dev/null; then
  ( cd "$ROOT" && PYTHONUNBUFFERED=1 timeout "$(budget 240)" nice python3 validation/oracle/make_oracle.py \
      "$OUTD/oracle" qwen3moe-dense qwen3moe-odd ) > "$LOG/make-oracle.log" 2>&1 &
  ORACLE_PID=$!
fi

# --- 1. device and kernels ------------------------------------------------------------------
step info 60 "$ST" info
cat "$LOG/info.log"
if [ "${SKIP_CHECKS:-0}" != 1 ]; then
step kernels 180 "$ST" kernels

# --- 3. sanitizers, in the background (one process per tool and fixture) --------------------
SAN_PIDS=()
if command -v compute-sanitizer >/dev/null; then
  for f in qwen3moe-a qwen3moe-code qwen3moe-dense qwen3moe-odd; do
    [ -d "$FIX/$f" ] || continue
    tools="memcheck racecheck initcheck synccheck"
    for tool in $tools; do
      extra=""
      [ "$tool" = memcheck ] && extra="--leak-check full"
      ( timeout "$(budget 300)" nice compute-sanitizer --tool "$tool" $extra --error-exitcode 9 \
          "$ST" generate "$FIX/$f" > "$LOG/san-$tool-$f.log" 2>&1
        echo "rc=$?" >> "$LOG/san-$tool-$f.log" ) &
      SAN_PIDS+=($!)
    done
  done
else
  row "sanitizers" "MISSING" "compute-sanitizer not on PATH"
fi

# --- 2. selftests -----------------------------------------------------------------------------
for f in qwen3moe-a qwen3moe-code qwen3moe-dense qwen3moe-odd; do
  [ -d "$FIX/$f" ] && step "selftest-$f" 240 "$ST" fixture "$FIX/$f" --decode 8
done
for fam in qwen3_moe qwen2_moe mixtral olmoe; do
  step "selftest-synth-$fam" 240 "$ST" synth "$fam"
done
if [ -x "$BIN/cuda_backend" ]; then
  TARFA_FIXTURES=$FIX step cargo-tests-ignored 300 "$BIN/cuda_backend" --ignored --test-threads 1
  if grep -q "test result: ok" "$LOG/cargo-tests-ignored.log"; then
    row "cargo tests (GPU, --ignored)" PASS "$(grep -h 'test result' "$LOG/cargo-tests-ignored.log" | head -1)"
  else
    row "cargo tests (GPU, --ignored)" FAIL "see logs/cargo-tests-ignored.log"
  fi
fi

# --- wait for the sanitizers, summarise -------------------------------------------------------
for p in "${SAN_PIDS[@]}"; do wait "$p"; done
echo "[$(elapsed)s] sanitizers done" | tee -a "$LOG/steps.txt"
fi  # SKIP_CHECKS
for tool in memcheck racecheck initcheck synccheck; do
  clean=0; total=0; bad=""
  for l in "$LOG"/san-$tool-*.log; do
    [ -f "$l" ] || continue
    total=$((total + 1))
    f=${l##*san-$tool-}; f=${f%.log}
    if grep -q "^rc=0$" "$l" && grep -qE "ERROR SUMMARY: 0 errors|RACECHECK SUMMARY: 0 hazards" "$l"; then
      clean=$((clean + 1))
    else
      bad="$bad $f($(grep -E "SUMMARY|^rc=" "$l" | tr '\n' ' '))"
    fi
  done
  [ $total -gt 0 ] && row "sanitizer $tool" "$([ $clean = $total ] && echo CLEAN || echo DIRTY)" \
    "$clean/$total fixture generate runs clean$bad"
done

# --- 4. the oracle ------------------------------------------------------------------------------
if [ -n "${ORACLE_PID:-}" ]; then
  wait "$ORACLE_PID"
  if [ -d "$OUTD/oracle/qwen3moe-dense" ] && [ -d "$OUTD/oracle/qwen3moe-odd" ]; then
    (cd "$OUTD/oracle" && tar czf "$OUTD/oracle-dense-odd.tar.gz" qwen3moe-dense qwen3moe-odd)
    same=""
    for f in qwen3moe-dense qwen3moe-odd; do
      for file in model.safetensors reference.safetensors; do
        a=$(sha256sum "$OUTD/oracle/$f/$file" 2>/dev/null | cut -c1-16)
        b=$(sha256sum "$FIX/$f/$file" 2>/dev/null | cut -c1-16)
        same="$same $f/$file:$([ "$a" = "$b" ] && echo same || echo "new=$a committed=$b")"
      done
    done
    row "make_oracle dense+odd" DONE "tarred;$same"
  else
    row "make_oracle dense+odd" FAIL "see logs/make-oracle.log"
  fi
  rm -rf "$OUTD/oracle"
fi
echo "[$(elapsed)s] oracle done" >> "$LOG/steps.txt"

# --- 5. figures (nothing else on the GPU now) ------------------------------------------------
[ -n "${SYNTH_PID:-}" ] && wait "$SYNTH_PID"  # the generator's CPU load would skew the figures
step figures-qwen3moe-code 180 "$ST" bench "$FIX/qwen3moe-code" --prefill 128 --decode 128 --selftest-prompts 0
if [ -n "${SYNTH_PID:-}" ]; then
  echo "[$(elapsed)s] synthetic bundle: $(tail -1 "$LOG/synth-bundle.log")" | tee -a "$LOG/steps.txt"
  if [ -f "$BIG/model.jnf" ] || [ -f "$BIG/model.safetensors.index.json" ]; then
    step figures-q30-16 420 "$ST" bench "$BIG" --prefill 128 --decode 64 --selftest-prompts 3 --selftest-decode 6
  else
    row "figures q30-16" FAIL "bundle not generated: $(tail -3 "$LOG/synth-bundle.log" | tr '\n' ' ')"
  fi
  rm -rf "$BIG"
fi

nvidia-smi --query-gpu=name,memory.used,temperature.gpu --format=csv > "$LOG/nvidia-smi-end.txt" 2>&1
(cd "$(dirname "$LOG")" && tar czf "$OUTD/logs.tar.gz" logs) 2>/dev/null
echo
echo "=== first problems reported ==="
grep -hE "FAIL|ERROR|error:|panicked|differ after|DIFFER|DIFFERENT|Invalid|Race|hazard" "$LOG"/*.log 2>/dev/null \
  | grep -vE "ERROR SUMMARY: 0 errors|0 hazards|0 errors, 0 warnings" | cut -c1-300 | head -40
echo
echo "=== CUDA backend checks ($(elapsed)s) ==="
column -t -s '|' "$TABLE" 2>/dev/null || cat "$TABLE"
