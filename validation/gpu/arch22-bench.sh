#!/usr/bin/env bash
# Issue 22's figures on the GPU machine: synthetic gpt-oss-20b, gpt-oss-120b (the released MXFP4
# form) and Llama-4-Scout (BF16) bundles of a few layers, decode tok/s resident and streamed
# (25% of the experts in the GPU hot tier, LRU, direct I/O), with the bytes each token reads;
# and the Llama 4 fixtures and gptoss-mxfp4-a converted, CPU vs CUDA resident and streamed through
# every budget and policy, byte for byte (SWEEP names them).
#
#   validation/gpu/arch22-bench.sh BIN_DIR [OUT_DIR]
#
# BIN_DIR: release tarfa-run and tarfa-convert (as arch22.sh). SHAPES: "name:shape:layers:extra"
# entries (default below). DECODE decode steps (default 32) after a 128-token prompt.
# Prints a short table last.
set -u
BIN=$(cd "${1:?usage: arch22-bench.sh BIN_DIR [OUT_DIR]}" && pwd)
OUTD=${2:-${OUT:-./gpu-out}}
mkdir -p "$OUTD/logs"
OUTD=$(cd "$OUTD" && pwd)
LOG=$OUTD/logs
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
FIX=$ROOT/fixtures/oracle
EXTRA=${EXTRA:-$BIN/oracle}
T0=$(date +%s)
DEADLINE=${DEADLINE:-540}
DECODE=${DECODE:-32}
say() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
TABLE=$OUTD/table.txt
: > "$TABLE"
row() { echo "$1|$2|$3" >> "$TABLE"; }
left() { echo $(( DEADLINE - ($(date +%s) - T0) )); }
SHAPES=${SHAPES:-"gptoss20-mx:gpt-oss-20b:4:--mxfp4 gptoss120-mx:gpt-oss-120b:4:--mxfp4 scout:llama4-scout:2:"}

# the big bundles are written in the background while the fixtures are checked
for s in $SHAPES; do
  IFS=: read -r name shape layers extra <<< "$s"
  ( rm -rf "/tmp/b-$name"; st=$(date +%s)
    # shellcheck disable=SC2086
    timeout 400 nice "$BIN/tarfa-convert" synth --shape "$shape" --layers "$layers" --skew 1 \
      --format bundle $extra "/tmp/b-$name"
    echo "rc=$? in $(( $(date +%s) - st ))s" ) > "$LOG/synth-$name.log" 2>&1 &
done

for f in ${SWEEP:-llama4-a llama4-dense-s llama4-llama3-s gptoss-mxfp4-a}; do
  d=$FIX/$f; [ -d "$d" ] || d=$EXTRA/$f
  b=/tmp/l4-$f; rm -rf "$b"
  if ! timeout 60 "$BIN/tarfa-convert" "$d" "$b" > "$LOG/convert-$f.log" 2>&1; then
    row "convert $f" FAIL "$(grep -m1 error "$LOG/convert-$f.log" | cut -c1-160)"; continue
  fi
  timeout 150 "$BIN/tarfa-run" selftest "$b" --backend cuda --stream-sweep > "$LOG/sweep-$f.log" 2>&1
  rc=$?
  row "bundle $f: CPU vs CUDA resident + streamed sweep" "$([ $rc = 0 ] && echo PASS || echo "FAIL rc=$rc")" \
    "$(grep -c '^PASS' "$LOG/sweep-$f.log") cases PASS, $(grep -c '^FAIL' "$LOG/sweep-$f.log") FAIL"
  say "sweep $f rc=$rc"
done

wait
for s in $SHAPES; do
  IFS=: read -r name shape layers extra <<< "$s"
  b=/tmp/b-$name
  if [ ! -f "$b/model.jnf" ]; then row "synth $name" FAIL "$(tail -2 "$LOG/synth-$name.log" | tr '\n' ' ')"; continue; fi
  row "synth $name ($shape, $layers layers $extra)" OK "$(du -sh "$b" | cut -f1), $(tail -1 "$LOG/synth-$name.log")"
  read -r vram ram prompt < <(python3 - "$b" <<'PY'
import json, sys
c = json.load(open(sys.argv[1] + "/config.json"))
h, i = c["hidden_size"], c["intermediate_size"]
e = c.get("num_local_experts") or c.get("num_experts")
layers = c["num_hidden_layers"]
slot = 3 * h * i * 2
n = layers * e
print((n // 4) * slot, 32 * slot * 2, ",".join(str((k * 7919 + 13) % c["vocab_size"]) for k in range(128)))
PY
)
  for mode in resident streamed; do
    [ "$(left)" -lt 40 ] && { row "$name $mode" SKIPPED "no time left"; continue; }
    flags=()
    [ $mode = streamed ] && flags=(--vram-budget "$vram" --ram-budget "$ram" --io direct --cache-policy lru)
    timeout $(( $(left) - 10 )) "$BIN/tarfa-run" generate "$b" --backend cuda --tokens "$prompt" \
      --max-new-tokens $((DECODE + 1)) --ignore-eos --quiet --stats --summary-json "$LOG/run-$name-$mode.json" \
      "${flags[@]}" > "$LOG/run-$name-$mode.log" 2>&1
    rc=$?
    if [ -f "$LOG/run-$name-$mode.json" ]; then
      row "$name $mode decode" "$(python3 -c "import json; d=json.load(open('$LOG/run-$name-$mode.json')); print('%.1f tok/s' % d['decode_tok_s'])")" \
        "$(python3 "$ROOT/validation/gpu/tools/run_summary.py" "$LOG/run-$name-$mode.json")"
    else
      row "$name $mode" "FAIL rc=$rc" "$(grep -m1 -iE 'error' "$LOG/run-$name-$mode.log" | cut -c1-160)"
    fi
    say "$name $mode rc=$rc"
  done
  rm -rf "$b"
done
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader >> "$LOG/smi.txt" 2>&1
say "done"
tar -czf "$OUTD/logs.tar.gz" -C "$OUTD" logs && rm -rf "$LOG"
cat "$TABLE"
