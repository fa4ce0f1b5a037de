#!/usr/bin/env bash
# Expert streaming on the GPU machine, in one run: correctness first, then speed against the
# I/O roofline, with every cache policy. No Rust toolchain there: the binaries are carried.
# Prints a short table last.
#
#   validation/gpu/bench-stream.sh BIN_DIR [OUT_DIR]
#
# BIN_DIR: tarfa-run and tarfa-convert of the build under test:
#   CARGO_PROFILE_RELEASE_STRIP=true cargo build --release -p tarfa-run -p tarfa-convert
# OUT_DIR (default $OUT, else ./gpu-out): table.txt, stream.json, logs.tar.gz.
#
# Steps (each bounded by a timeout; DEADLINE seconds in all, default 560):
#   1. the oracle fixtures converted to bundles; `tarfa-run selftest --backend cuda --stream-sweep`
#      on each: CPU reference vs CUDA with experts streamed through GPU and RAM tiers of every
#      budget (all, a quarter, one expert), both I/O modes and every policy, byte for byte;
#      compute-sanitizer (memcheck, racecheck, initcheck, synccheck) on a streamed sweep
#   2. a synthetic Qwen3-30B-A3B bundle of 16 layers (2,048 experts of 9.44 MB, 19.3 GB of
#      experts) with skewed routing, written straight from the generator; the disk's read
#      bandwidth for whole extents at queue depths 1, 4 and 16 (io-bench, O_DIRECT)
#   3. decode after a 128-token prompt with budgets that hold 25% of the experts in all:
#      the hot tier (GPU) with the RAM tier as staging, under lru, ledger (learned from the lru
#      run) and static; the RAM tier as the cache; and `--io cached --cache-policy none` (no cache
#      of Tarfa's own) with the page cache held to the same 25% by a memory hog
#      (tools/pagecache.py: MemAvailable is pinned so the kernel cannot cache more). Every run
#      starts with the bundle evicted from the page cache (fadvise DONTNEED, no root needed).
#      A smaller hot tier (12.5%) checks whether less cache is better
#   4. the same for 4 layers of Qwen3-235B-A22B (512 experts of 37.7 MB)
# STREAM_DECODE (default 16) decode steps per run; RUNS_30 / RUNS_235 (space-separated labels,
# default all / "hot-lru hot-ledger warm-lru pagecache"; "none" skips the model) choose the runs
# of each model; SELFTESTS=0 skips step 1. A dry run of the script on a CPU machine:
#   BACKEND=cpu SYNTH_EXTRA="--experts 32 --vocab 4096" LAYERS_30=2 LAYERS_235=1 bench-stream.sh ...
# (no selftests then: they compare a GPU with the CPU)
set -u
BIN=$(cd "${1:?usage: bench-stream.sh BIN_DIR [OUT_DIR]}" && pwd)
OUTD=${2:-${OUT:-./gpu-out}}
mkdir -p "$OUTD"
OUTD=$(cd "$OUTD" && pwd)
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
FIX=$ROOT/fixtures/oracle
PC=$ROOT/validation/gpu/tools/pagecache.py
WORK=${WORK_DIR:-/tmp/tarfa-stream}
LOG=$WORK/logs
rm -rf "$WORK"
mkdir -p "$LOG"
TABLE=$OUTD/table.txt
: > "$TABLE"
T0=$(date +%s)
DEADLINE=${DEADLINE:-560}
RESERVE=15
DECODE=${STREAM_DECODE:-16}
BACKEND=${BACKEND:-cuda}
elapsed() { echo $(( $(date +%s) - T0 )); }
budget() {
  local left=$(( DEADLINE - RESERVE - $(elapsed) ))
  [ "$left" -lt 1 ] && left=1
  [ "$1" -lt "$left" ] && echo "$1" || echo "$left"
}
row() { echo "$1|$2|$3" >> "$TABLE"; }
snapshot() {
  (cd "$WORK" && tar czf "$OUTD/logs.tar.gz" logs) 2>/dev/null
  true
}
step() {  # step NAME TIMEOUT CMD...  (log: $LOG/NAME.log)
  local name=$1 t; t=$(budget "$2"); shift 2
  local s; s=$(date +%s)
  timeout "$t" "$@" > "$LOG/$name.log" 2>&1
  local rc=$?
  echo "[$(elapsed)s] $name: rc=$rc in $(( $(date +%s) - s ))s" | tee -a "$LOG/steps.txt"
  return $rc
}
. "$ROOT/validation/gpu/cuda-env.sh"
export TARFA_CACHE_DIR=$WORK/cache
{ date -u; nproc; free -g; df -h /tmp; cat /proc/swaps; nvidia-smi 2>&1 | head -15; } > "$LOG/env.txt" 2>&1

# --- 1. correctness: streamed selftests on the fixtures, sanitizers -------------------------
for f in qwen3moe-a qwen3moe-code qwen3moe-dense qwen3moe-odd; do
  [ -d "$FIX/$f" ] && [ "$BACKEND" = cuda ] && [ "${SELFTESTS:-1}" = 1 ] || continue
  step "convert-$f" 60 "$BIN/tarfa-convert" "$FIX/$f" "$WORK/$f" || continue
  if step "sweep-$f" 120 "$BIN/tarfa-run" selftest --backend "$BACKEND" --stream-sweep "$WORK/$f" \
      --prompt-lengths 1,9,40 --decode-steps 6 --json "$LOG/sweep-$f.json"; then
    row "streamed selftest $f" PASS "$(grep -c '^PASS' "$LOG/sweep-$f.log") configurations bit-identical to the CPU (resident + 6 streamed)"
  else
    row "streamed selftest $f" FAIL "$(grep -m1 -E '^FAIL|error' "$LOG/sweep-$f.log" | cut -c1-200)"
  fi
done
if [ "$BACKEND" != cuda ] || [ "${SELFTESTS:-1}" != 1 ]; then
  row "selftests" SKIPPED "BACKEND=$BACKEND SELFTESTS=${SELFTESTS:-1}"
elif command -v compute-sanitizer >/dev/null && [ -d "$WORK/qwen3moe-a" ]; then
  for tool in memcheck racecheck initcheck synccheck; do
    extra=""; [ "$tool" = memcheck ] && extra="--leak-check full"
    step "san-$tool" 150 compute-sanitizer --tool "$tool" $extra --error-exitcode 9 \
      "$BIN/tarfa-run" selftest --backend "$BACKEND" --stream-sweep --no-resident "$WORK/qwen3moe-a" \
      --prompt-lengths 5 --decode-steps 2
    rc=$?
    l=$LOG/san-$tool.log
    if [ $rc = 0 ] && grep -qE "ERROR SUMMARY: 0 errors|RACECHECK SUMMARY: 0 hazards" "$l"; then
      row "sanitizer $tool (streamed)" CLEAN "$(grep -c '^PASS' "$l") streamed configurations of qwen3moe-a"
    else
      row "sanitizer $tool (streamed)" DIRTY "rc=$rc $(grep -E 'SUMMARY' "$l" | head -1)"
    fi
  done
else
  row "sanitizers (streamed)" MISSING "compute-sanitizer not on PATH"
fi
snapshot

# --- 2..4. speed ------------------------------------------------------------------------------
RUNS=()
IOS=()
run_model() {  # run_model NAME SHAPE LAYERS RUNS
  local name=$1 shape=$2 layers=$3 runs=" $4 " b=$WORK/$1
  [ "$4" = none ] && return
  # shellcheck disable=SC2086
  if ! step "synth-$name" 300 "$BIN/tarfa-convert" synth --shape "$shape" --layers "$layers" \
      --skew 1 --format bundle ${SYNTH_EXTRA:-} "$b"; then
    row "$name bundle" FAIL "$(tail -2 "$LOG/synth-$name.log" | tr '\n' ' ')"
    return
  fi
  tail -1 "$LOG/synth-$name.log"
  step "io-$name" 40 "$BIN/tarfa-run" io-bench "$b" --queue-depths 1,4,16 --seconds 4 --json "$LOG/io-$name.raw.json"
  python3 -c "import json,sys; d=json.load(open('$LOG/io-$name.raw.json')); d['model']='$name'; json.dump(d, open('$LOG/io-$name.json','w'))" \
    && IOS+=("$LOG/io-$name.json")
  local n_exp ext
  n_exp=$(python3 -c "import json; c=json.load(open('$b/config.json')); print(c['num_hidden_layers']*c['num_experts'])")
  ext=$(python3 -c "import json; c=json.load(open('$b/config.json')); print(3*c['moe_intermediate_size']*c['hidden_size']*2)")
  # 25% of the experts in all: the hot tier, and RAM staging of up to 32 experts (reads in
  # flight); the smaller hot tier holds 12.5% with the same staging
  local q=$(( n_exp / 4 ))
  local stage=$(( q / 2 < 32 ? q / 2 : 32 ))
  local hot=$(( (q - stage) * ext )) ram=$(( stage * ext ))
  local small=$(( (n_exp / 8 > stage ? n_exp / 8 - stage : 1) * ext ))
  local prompt
  prompt=$(python3 -c "import json; v=json.load(open('$b/config.json'))['vocab_size']; print(','.join(str((i*7919+13)%v) for i in range(128)))")
  local common=(generate "$b" --backend "$BACKEND" --tokens "$prompt" --max-new-tokens $((DECODE + 1))
                --ignore-eos --quiet --stats)
  one() {  # one LABEL FLAGS...
    local label=$1; shift
    case "$runs" in *" $label "*) ;; *) return ;; esac
    [ $(( DEADLINE - RESERVE - $(elapsed) )) -lt 45 ] && { row "$name $label" SKIPPED "no time left"; return; }
    python3 "$PC" evict "$b/model.jnf"
    step "run-$name-$label" 150 "$BIN/tarfa-run" "${common[@]}" "$@" --summary-json "$LOG/run-$name-$label.raw.json"
    local rc=$?
    local cached; cached=$(python3 "$PC" resident "$b/model.jnf")
    if [ -f "$LOG/run-$name-$label.raw.json" ]; then
      python3 -c "import json; d=json.load(open('$LOG/run-$name-$label.raw.json')); d.update(model='$name', label='$label', flags='$*', page_cache_bytes_after=$cached); json.dump(d, open('$LOG/run-$name-$label.json','w'))"
      RUNS+=("$LOG/run-$name-$label.json")
    else
      row "$name $label" FAIL "rc=$rc $(grep -m1 -E 'error' "$LOG/run-$name-$label.log" | cut -c1-160)"
    fi
  }
  one "hot-lru" --vram-budget "$hot" --ram-budget "$ram" --io direct --cache-policy lru
  one "hot-lru-pageable" --vram-budget "$hot" --ram-budget "$ram" --io direct --cache-policy lru --pageable-warm-tier
  one "hot-ledger" --vram-budget "$hot" --ram-budget "$ram" --io direct --cache-policy ledger
  one "hot-static" --vram-budget "$hot" --ram-budget "$ram" --io direct --cache-policy static
  one "warm-lru" --vram-budget $(( 16 * ext )) --ram-budget "$hot" --io direct --cache-policy lru
  # no cache of Tarfa's own: the page cache, held to the same 25% (the hog leaves that much
  # plus what the process itself needs: the hot-lru run's peak RSS, plus 512 MiB)
  case "$runs" in *" pagecache "*) ;; *) one "hot-lru-12.5%" --vram-budget "$small" --ram-budget "$ram" --io direct --cache-policy lru; rm -rf "$b"; snapshot; return ;; esac
  local rss
  rss=$(python3 -c "import json; print(json.load(open('$LOG/run-$name-hot-lru.json'))['peak_rss_bytes'])" 2>/dev/null || echo $((4 << 30)))
  local leave=$(( hot + rss + (512 << 20) ))
  # HOG_MAX_GIB caps the hog (a dry run on a shared machine)
  if [ -n "${HOG_MAX_GIB:-}" ]; then
    local avail
    avail=$(awk '/MemAvailable/ {printf "%d", $2 * 1024}' /proc/meminfo)
    [ $(( avail - leave )) -gt $(( HOG_MAX_GIB << 30 )) ] && leave=$(( avail - (HOG_MAX_GIB << 30) ))
  fi
  python3 "$PC" hog "$leave" > "$LOG/hog-$name.log" 2>&1 &
  local hog_pid=$! waited=0
  while ! grep -q holding "$LOG/hog-$name.log" && [ $waited -lt 150 ] && kill -0 "$hog_pid" 2>/dev/null; do
    sleep 1; waited=$((waited + 1))
  done
  echo "[$(elapsed)s] $(cat "$LOG/hog-$name.log") (after ${waited}s)" | tee -a "$LOG/steps.txt"
  one "pagecache" --vram-budget $(( 16 * ext )) --ram-budget "$ram" --io cached --cache-policy none
  kill "$hog_pid" 2>/dev/null; wait "$hog_pid" 2>/dev/null
  one "hot-lru-12.5%" --vram-budget "$small" --ram-budget "$ram" --io direct --cache-policy lru
  rm -rf "$b"
  snapshot
}
run_model q30-16 qwen3-30b-a3b "${LAYERS_30:-16}" \
  "${RUNS_30:-hot-lru hot-lru-pageable hot-ledger hot-static warm-lru pagecache hot-lru-12.5%}"
run_model q235-4 qwen3-235b-a22b "${LAYERS_235:-4}" "${RUNS_235:-hot-lru hot-ledger warm-lru pagecache}"

if [ ${#RUNS[@]} -gt 0 ] && [ ${#IOS[@]} -gt 0 ]; then
  python3 "$ROOT/validation/gpu/tools/stream_table.py" "$OUTD/stream.json" "$(IFS=,; echo "${IOS[*]}")" "${RUNS[@]}" \
    > "$LOG/table.log" 2>&1
  grep '^TABLE|' "$LOG/table.log" | sed 's/^TABLE|//' >> "$TABLE"
  grep -v '^TABLE|' "$LOG/table.log" | head -5
fi
snapshot
echo
echo "=== first problems reported ==="
grep -hE "FAIL|ERROR|error:|panicked|DIFFER|hazard|Killed|killed" "$LOG"/*.log 2>/dev/null \
  | grep -vE "ERROR SUMMARY: 0 errors|0 hazards|0 logit, 0 router, 0 stats" | cut -c1-240 | head -20
echo
cat "$LOG/steps.txt"
echo
echo "=== Tarfa expert streaming ($(elapsed)s) ==="
column -t -s '|' "$TABLE" 2>/dev/null || cat "$TABLE"
