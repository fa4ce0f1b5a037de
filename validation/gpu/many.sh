#!/usr/bin/env bash
# Issue 17's figures on the GPU machine: the token-tiled many-token step (prefill, batched decode)
# against transformers BF16 in the same call, with the bitwise checks that make them count.
#
#   [PHASE=bench|sanitize|all] validation/gpu/many.sh BIN_DIR [OUT_DIR]
#
# BIN_DIR: release tarfa-convert and examples/cuda_bench. BIG_DIR (default /tmp/tarfa-q30-16) is
# reused when it holds a bundle, else the 16-layer synthetic Qwen3-30B-A3B bundle is written there.
#   bench    1. cuda_bench --only-many on it: prefill of 128, 512, 2,048 and 8,192 tokens (tok/s,
#               TFLOP/s, share of the FP32 FMA peak; the last logits equal to the prompt run in
#               chunks), batched greedy decode at B = 1, 8, 32, 128 (tok/s, the step's HBM
#               roofline; every sequence's tokens and logits equal to it decoded alone);
#            2. transformers on the same shape (hf_many.py), the GPU otherwise idle; the ratios.
#   sanitize 3. compute-sanitizer memcheck, racecheck, initcheck and synccheck on cuda_bench
#               --only-many on the qwen3moe-a fixture (small sizes: every new kernel, the
#               multi-sequence step included).
# Prints a short table last; OUT_DIR gets table.txt and the logs.
set -u
BIN=$(cd "${1:?usage: many.sh BIN_DIR [OUT_DIR]}" && pwd)
OUTD=${2:-${OUT:-./gpu-out}}
mkdir -p "$OUTD/logs"
OUTD=$(cd "$OUTD" && pwd)
LOG=$OUTD/logs
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
. "$ROOT/validation/gpu/cuda-env.sh"
T0=$(date +%s)
say() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
TABLE=$OUTD/table.txt
touch "$TABLE"
row() { echo "$1|$2|$3" >> "$TABLE"; }
PHASE=${PHASE:-all}
CB=$BIN/examples/cuda_bench
[ -x "$CB" ] || CB=$BIN/cuda_bench
BIG=${BIG_DIR:-/tmp/tarfa-q30-16}

if [ "$PHASE" = all ] || [ "$PHASE" = sanitize ]; then
  FIX=$ROOT/fixtures/oracle/qwen3moe-a
  pids=()
  for tool in memcheck racecheck initcheck synccheck; do
    ( timeout 400 compute-sanitizer --tool $tool --error-exitcode 9 "$CB" "$FIX" --only-many \
        --prefill 40,130 --batch 1,3 --batch-steps 2 --prompt 5 > "$LOG/san-$tool.log" 2>&1
      echo "rc=$?" >> "$LOG/san-$tool.log" ) &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p"; done
  for tool in memcheck racecheck initcheck synccheck; do
    rc=$(grep -o 'rc=[0-9]*' "$LOG/san-$tool.log" | tail -1)
    row "compute-sanitizer $tool, cuda_bench --only-many (qwen3moe-a)" \
      "$([ "$rc" = rc=0 ] && echo CLEAN || echo "$rc")" \
      "$(grep -h 'ERROR SUMMARY' "$LOG/san-$tool.log" | tail -1)"
  done
  say "sanitizers"
fi

if [ "$PHASE" = all ] || [ "$PHASE" = bench ]; then
  if [ ! -f "$BIG/model.jnf" ]; then
    rm -rf "$BIG"
    timeout 300 "$BIN/tarfa-convert" synth --shape qwen3-30b-a3b --layers 16 --skew 1 --format bundle "$BIG" \
      > "$LOG/synth.log" 2>&1
    say "bundle rc=$?"
  fi
  timeout 330 "$CB" "$BIG" --only-many --prefill 128,512,2048,8192 --batch 1,8,32,128 \
    --batch-steps 32 --prompt 128 --json "$OUTD/many.json" > "$LOG/many.log" 2>&1
  say "cuda_bench --only-many rc=$?"
  grep -h '^TABLE|' "$LOG/many.log" | sed 's/^TABLE|//' >> "$TABLE"
  PYTHONUNBUFFERED=1 timeout 240 python3 "$ROOT/validation/gpu/hf_many.py" 16 "$OUTD/hf.json" > "$LOG/hf.log" 2>&1
  say "transformers rc=$?"
  python3 - "$OUTD/many.json" "$OUTD/hf.json" >> "$TABLE" <<'PY'
import json, sys
try:
    t = json.load(open(sys.argv[1])); h = json.load(open(sys.argv[2]))
except Exception as e:
    print(f"ratios|ERROR|{e}"); sys.exit()
for p in t.get("prefill", []):
    hf = h["prefill"].get(str(p["tokens"]))
    if hf:
        print(f"prefill {p['tokens']} vs transformers|{p['tok_s'] / hf:.2f}x|tarfa {p['tok_s']:.0f} tok/s, transformers {hf:.0f} tok/s")
for d in t.get("batched_decode", []):
    hf = h["batched_decode"].get(str(d["batch"]))
    if hf:
        print(f"batched decode B={d['batch']} vs transformers|{d['tok_s'] / hf:.2f}x|tarfa {d['tok_s']:.0f} tok/s, transformers {hf:.0f} tok/s")
PY
fi
say "done"
echo "== table =="
column -t -s '|' "$TABLE" 2>/dev/null || cat "$TABLE"
