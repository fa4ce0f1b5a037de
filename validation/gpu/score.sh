#!/usr/bin/env bash
# `tarfa-run score` on the GPU machine (issue 18's figures): requests/s and tokens/s on the
# 16-layer synthetic Qwen3-30B-A3B bundle at --max-batch 1 and 32 on CUDA, the output bytes
# compared across batch sizes and with the CPU's on the first 16 requests.
#
#   validation/gpu/score.sh BIN_DIR [OUT_DIR]
#
# BIN_DIR: tarfa-run and tarfa-convert (release). BIG_DIR (default /tmp/tarfa-q30-16) is reused
# when it holds a bundle. N (default 256) requests of 96 context and 8 continuation token ids (a
# synthetic bundle has no tokenizer), seed 1. Prints a short table last.
set -u
BIN=$(cd "${1:?usage: score.sh BIN_DIR [OUT_DIR]}" && pwd)
OUTD=${2:-${OUT:-./gpu-out}}
mkdir -p "$OUTD"
OUTD=$(cd "$OUTD" && pwd)
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
. "$ROOT/validation/gpu/cuda-env.sh"
T0=$(date +%s)
say() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
TABLE=$OUTD/table.txt
: > "$TABLE"
BIG=${BIG_DIR:-/tmp/tarfa-q30-16}
if [ ! -f "$BIG/model.jnf" ]; then
  rm -rf "$BIG"
  timeout 300 "$BIN/tarfa-convert" synth --shape qwen3-30b-a3b --layers 16 --skew 1 --format bundle "$BIG" \
    > "$OUTD/synth.log" 2>&1
  say "bundle rc=$?"
fi
W=$(mktemp -d /tmp/tarfa-score.XXXX)
python3 -c "
import json, random
random.seed(1)
for _ in range(${N:-256}):
    print(json.dumps({'context': [random.randrange(151936) for _ in range(96)],
                      'continuation': [random.randrange(151936) for _ in range(8)]}))" > "$W/req.jsonl"
head -16 "$W/req.jsonl" > "$W/req16.jsonl"
for n in 1 32; do
  timeout 240 "$BIN/tarfa-run" score "$BIG" --requests "$W/req.jsonl" --out "$W/cuda$n.jsonl" \
    --backend cuda --max-batch "$n" --json --quiet > "$W/sum$n.json" 2> "$OUTD/cuda$n.err"
  say "cuda --max-batch $n rc=$? $(cat "$W/sum$n.json")"
  echo "score, CUDA, --max-batch $n|$(python3 -c "import json;d=json.load(open('$W/sum$n.json'));print(f\"{d.get('requests_per_s', 0):.1f} req/s, {d.get('tokens_per_s', 0):.0f} tok/s\")" 2>/dev/null)|$(cat "$W/sum$n.json")" >> "$TABLE"
done
cmp -s "$W/cuda1.jsonl" "$W/cuda32.jsonl" && r=SAME || r=DIFFER
echo "output bytes, --max-batch 1 vs 32 (CUDA)|$r|$(wc -l < "$W/cuda1.jsonl") lines" >> "$TABLE"
timeout 240 "$BIN/tarfa-run" score "$BIG" --requests "$W/req16.jsonl" --out "$W/cpu16.jsonl" \
  --backend cpu --max-batch 8 --json --quiet > "$W/sumcpu.json" 2> "$OUTD/cpu.err"
say "cpu rc=$? $(cat "$W/sumcpu.json")"
head -16 "$W/cuda32.jsonl" > "$W/cuda16.jsonl"
cmp -s "$W/cpu16.jsonl" "$W/cuda16.jsonl" && r=SAME || r=DIFFER
echo "output bytes, CPU (--max-batch 8) vs CUDA, first 16 requests|$r|$(cat "$W/sumcpu.json")" >> "$TABLE"
rm -rf "$W"
echo "=== table ==="
column -t -s'|' "$TABLE" 2>/dev/null || cat "$TABLE"
