#!/usr/bin/env bash
# Issue 17, PHASE_LOG B11: the paged KV cache (kernels/common.cuh `kv_row`), the batched step's
# logits read row by row (device.rs `read_rows`) and the few-pair experts kernels, on the GPU machine
# in one call of under 10 minutes, against the previous build in the same call:
#
#   validation/gpu/paged.sh NEW_BIN OLD_BIN [OUT_DIR]
#
# NEW_BIN, OLD_BIN: as prefill.sh's BIN_DIR (release tarfa-run, tarfa-convert,
# examples/cuda_selftest, examples/cuda_bench), NEW_BIN of this tree, OLD_BIN of the tree before
# the paged cache (its KV cache one [Hkv][cap][D] buffer per layer, copied when it grows).
# 1. NEW: the kernel checks (the attention kernels on paged caches whose blocks are allocated
#    last first), the fixtures' CPU-vs-CUDA selftests with --many-kernels $ARM, and
#    compute-sanitizer's four tools ($ARM; the decode graph at B = 1 included);
# 2. the CLI on the 16-layer Qwen3-30B-A3B bundle, OLD then NEW: a 128-token prompt and 400 new
#    tokens (the cache grows past 256 positions, 8 blocks), `--logits-out` files compared byte for
#    byte, decode tok/s from each summary;
# 3. the decode graph's time per token (cuda_bench --sweep graph-pdl, 3 rounds of 30 replays),
#    OLD then NEW (SWEEPS="1 2": twice);
# 4. batched decode at B = 8, 32, 128 (BATCH): NEW in the arms $ARMS, OLD in auto.
# B12 ran it with NEW = binaries of `97a979a`, where `few-experts` was an arm of its own
# (ARM=few-experts ARMS=auto,few-experts); it is Auto's choice since, so with later binaries the
# defaults are ARM=auto ARMS=tiled,auto.
# Decision rules (stated before the run):
# - the paged cache stays (it is the cache) if every check, selftest and sanitizer passes, the
#   CLI logits files are identical, and the decode graph is not slower than OLD by more than 2%;
# - few-experts becomes Auto's choice if batched decode at B = 8 and 32 is faster than NEW's
#   auto by more than 2% with no B slower by more than 2% (B9's bar for few, which few missed at
#   B = 32: +1.7%).
set -u
NEW=$(cd "${1:?usage: paged.sh NEW_BIN OLD_BIN [OUT_DIR]}" && pwd)
OLD=$(cd "${2:?usage: paged.sh NEW_BIN OLD_BIN [OUT_DIR]}" && pwd)
OUTD=${3:-${OUT:-./gpu-out}}
mkdir -p "$OUTD"
OUTD=$(cd "$OUTD" && pwd)
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
. "$HERE/cuda-env.sh"
T0=$(date +%s)
say() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
TABLE=$OUTD/table.txt
: > "$TABLE"
row() { echo "$1|$2|$3" >> "$TABLE"; }
BIG=/tmp/tarfa-q30-16
LOG=$OUTD/logs
mkdir -p "$LOG"
finish() {
  (cd "$OUTD" && tar czf logs.tar.gz logs && rm -rf logs) 2>/dev/null
  echo "===== table ($(( $(date +%s) - T0 )) s) ====="
  column -t -s '|' "$TABLE" 2>/dev/null || cat "$TABLE"
}
trap finish EXIT

# 1. exactness of the paged kernels (prefill.sh writes its rows into part1/table.txt)
ARM=${ARM:-auto}
ARMS=${ARMS:-tiled,auto}
PHASE=check ARM=$ARM "$HERE/prefill.sh" "$NEW" "$OUTD/check" > "$LOG/check.log" 2>&1 &
CHECK_PID=$!
if [ ! -f "$BIG/model.jnf" ]; then
  timeout 300 "$NEW/tarfa-convert" synth --shape qwen3-30b-a3b --layers 16 --skew 1 \
    --format bundle "$BIG" > "$LOG/synth.log" 2>&1
  say "bundle rc=$?"
fi
wait "$CHECK_PID"
cat "$OUTD/check/table.txt" >> "$TABLE" 2>/dev/null
say "checks"
PHASE=san ARM=$ARM SAN_TIMEOUT=200 "$HERE/prefill.sh" "$NEW" "$OUTD/san" > "$LOG/san.log" 2>&1
cat "$OUTD/san/table.txt" >> "$TABLE" 2>/dev/null
say "sanitizers"

# 2. the CLI, OLD then NEW: the same logits, byte for byte; decode tok/s
TOK=$(python3 -c "print(','.join(str(17 + (i * 7919) % 150000) for i in range(128)))")
for side in old new; do
  if [ $side = old ]; then B=$OLD; else B=$NEW; fi
  timeout 120 "$B/tarfa-run" generate $BIG --backend cuda --tokens "$TOK" --max-new-tokens 400 \
    --ignore-eos --quiet --preload --logits-out "$LOG/cli-$side.st" \
    --summary-json "$LOG/cli-$side.json" > "$LOG/cli-$side.log" 2>&1
  say "cli $side rc=$?"
done
if cmp -s "$LOG/cli-old.st" "$LOG/cli-new.st"; then
  row "CLI logits, 128 + 400 tokens, old vs new" "IDENTICAL" "$(stat -c %s "$LOG/cli-new.st") bytes"
else
  row "CLI logits, 128 + 400 tokens, old vs new" "DIFFER" "cmp: $(cmp "$LOG/cli-old.st" "$LOG/cli-new.st" 2>&1 | head -c 200)"
fi
for side in old new; do
  row "CLI decode [$side]" "$(python3 -c "import json;d=json.load(open('$LOG/cli-$side.json'));print(round(d.get('decode_tok_s', 0), 1))" 2>/dev/null)" \
    "tok/s ($(python3 -c "import json;d=json.load(open('$LOG/cli-$side.json'));print({k: v for k, v in d.items() if 'decode' in k})" 2>/dev/null | head -c 200))"
done
rm -f "$LOG"/cli-*.st

# 3. the decode graph, alternating builds
for i in ${SWEEPS:-1}; do
  for side in old new; do
    if [ $side = old ]; then B=$OLD; else B=$NEW; fi
    timeout 90 "$B/examples/cuda_bench" $BIG --prompt 128 --sweep graph-pdl --sweep-rounds 3 \
      > "$LOG/sweep-$side-$i.log" 2>&1
    g=$(grep -h '^TABLE|sweep' "$LOG/sweep-$side-$i.log" | sed 's/^TABLE|//' | cut -d'|' -f3 | head -c 160)
    row "decode graph [$side, run $i]" "$(grep -c '^TABLE|sweep' "$LOG/sweep-$side-$i.log")" "$g"
  done
done
say "sweeps"

# 4. batched decode
timeout 200 "$NEW/examples/cuda_bench" $BIG --only-many --prefill "" --batch ${BATCH:-8,32,128} \
  --batch-steps 16 --prompt 128 --many-kernels "$ARMS" \
  --json "$OUTD/batch-new.json" > "$LOG/batch-new.log" 2>&1
say "batch new rc=$?"
grep -h '^TABLE|' "$LOG/batch-new.log" | sed 's/^TABLE|/new /' >> "$TABLE"
timeout 120 "$OLD/examples/cuda_bench" $BIG --only-many --prefill "" --batch ${BATCH:-8,32,128} \
  --batch-steps 16 --prompt 128 --many-kernels auto \
  --json "$OUTD/batch-old.json" > "$LOG/batch-old.log" 2>&1
say "batch old rc=$?"
grep -h '^TABLE|' "$LOG/batch-old.log" | sed 's/^TABLE|/old /' >> "$TABLE"
