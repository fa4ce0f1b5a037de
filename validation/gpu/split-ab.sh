#!/usr/bin/env bash
# A before/after of the same tarfa-run calls with two or three builds, on the GPU machine (issue
# 16: the crate split and the kernel clean-up must change no bit and cost no speed).
#
#   [MID=DIR] [PHASE=prep|speed|all] validation/gpu/split-ab.sh OLD_BIN NEW_BIN [OUT_DIR]
#
# OLD_BIN, NEW_BIN (and MID): directories with tarfa-run and tarfa-convert (NEW_BIN also
# tarfa-ab). A build reads the bundles its own tarfa-convert writes (the manifest format changed
# between builds); the weights are the same, which step 1 checks by comparing model.jnf.
#   prep  1. the 16-layer synthetic Qwen3-30B-A3B bundle, written by OLD's and NEW's converters
#            (BIG_DIR, default /tmp/tarfa-q30-16, and .old; MID reads NEW's), and the four
#            qwen3 fixtures by every build's;
#         2. `generate --backend cuda --logits-out --router-trace` with every build on each:
#            logits, router traces and printed tokens compared with cmp against NEW's;
#   speed 3. ROUNDS (default 5) interleaved rounds of the same call on the big bundle, every
#            build once per round (128-token prompt, 128 new tokens): decode tok/s from
#            --summary-json, medians and the median paired ratio to NEW;
#         4. with MID: tarfa-ab MID (A) against NEW (B) on the same bundle, PAIRS pairs (default
#            6), decode, the bar no regression beyond 2% (--min-improvement-pct=-2).
# Prints a short table last; OUT_DIR gets table.txt, ab.md and the logs.
set -u
OLD=$(cd "${1:?usage: split-ab.sh OLD_BIN NEW_BIN [OUT_DIR]}" && pwd)
NEW=$(cd "${2:?usage: split-ab.sh OLD_BIN NEW_BIN [OUT_DIR]}" && pwd)
MIDB=${MID:+$(cd "$MID" && pwd)}
OUTD=${3:-${OUT:-./gpu-out}}
mkdir -p "$OUTD/logs"
OUTD=$(cd "$OUTD" && pwd)
LOG=$OUTD/logs
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
FIX=$ROOT/fixtures/oracle
TABLE=$OUTD/table.txt
touch "$TABLE"
T0=$(date +%s)
. "$ROOT/validation/gpu/cuda-env.sh"
say() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
row() { echo "$1|$2|$3" >> "$TABLE"; }
PHASE=${PHASE:-all}
BIG=${BIG_DIR:-/tmp/tarfa-q30-16}
W=/tmp/tarfa-split
mkdir -p "$W"
builds="OLD NEW${MIDB:+ MID}"
bin_of() { case $1 in OLD) echo "$OLD";; NEW) echo "$NEW";; MID) echo "$MIDB";; esac; }
# MID reads NEW's bundle format (the machine's 64 GB disk holds two 20 GB bundles, not three)
big_of() { case $1 in NEW|MID) echo "$BIG";; OLD) echo "$BIG.old";; esac; }

if [ "$PHASE" != speed ]; then
  for b in $builds; do
    d=$(big_of $b)
    if [ "$b" != MID ] && [ ! -f "$d/model.jnf" ]; then
      rm -rf "$d"
      timeout 300 "$(bin_of $b)/tarfa-convert" synth --shape qwen3-30b-a3b --layers 16 --skew 1 \
        --format bundle "$d" > "$LOG/synth-$b.log" 2>&1
      say "bundle $b rc=$?"
    fi
    for f in qwen3moe-a qwen3moe-code qwen3moe-dense qwen3moe-odd; do
      [ -d "$W/$b-$f" ] || timeout 120 "$(bin_of $b)/tarfa-convert" "$FIX/$f" "$W/$b-$f" > "$LOG/convert-$b-$f.log" 2>&1
    done
  done
  for b in OLD; do
    cmp -s "$BIG/model.jnf" "$(big_of $b)/model.jnf" && r=SAME || r=DIFFER
    row "model.jnf of $b's and NEW's converter (16 layers)" "$r" "$(stat -c %s "$BIG/model.jnf") bytes"
  done
  same=0; total=0; bad=""
  for name in qwen3moe-a qwen3moe-code qwen3moe-dense qwen3moe-odd q30-16; do
    for b in $builds; do
      if [ $name = q30-16 ]; then bundle=$(big_of $b); args=(--tokens "$(seq -s, 11 138)" --max-new-tokens 32)
      else bundle=$W/$b-$name; args=(--tokens 1,2,3,4,5,6,7,8 --max-new-tokens 16 --prefill-logits); fi
      timeout 180 "$(bin_of $b)/tarfa-run" generate "$bundle" --backend cuda --ignore-eos --quiet \
        --logits-out "$W/$name.$b.safetensors" --router-trace "$W/$name.$b.jsonl" "${args[@]}" \
        > "$W/$name.$b.out" 2> "$LOG/gen-$name.$b.err" || echo "$name $b: rc=$?" >> "$LOG/failed.txt"
    done
    for b in $builds; do
      [ "$b" = NEW ] && continue
      total=$((total + 1))
      if [ -s "$W/$name.NEW.safetensors" ] && cmp -s "$W/$name.$b.safetensors" "$W/$name.NEW.safetensors" \
         && cmp -s "$W/$name.$b.jsonl" "$W/$name.NEW.jsonl" && cmp -s "$W/$name.$b.out" "$W/$name.NEW.out"; then
        same=$((same + 1))
        echo "$name $b vs NEW: $(stat -c %s "$W/$name.NEW.safetensors") bytes of logits, $(wc -l < "$W/$name.NEW.jsonl") router records: identical"
      else
        bad="$bad $name/$b"; echo "$name $b vs NEW: DIFFER or failed"
      fi
    done
  done
  row "logits, router traces, tokens vs NEW (cmp)" "$([ "$same" = "$total" ] && echo IDENTICAL || echo DIFFER)" "$same/$total byte-identical$bad"
  say "compare $same/$total"
fi

if [ "$PHASE" != prep ]; then
  toks=$(seq -s, 11 138)
  for r in $(seq 1 "${ROUNDS:-5}"); do
    for b in $builds; do
      timeout 120 "$(bin_of $b)/tarfa-run" generate "$(big_of $b)" --backend cuda --ignore-eos --quiet \
        --tokens "$toks" --max-new-tokens 129 --summary-json "$W/speed.$b.$r.json" > /dev/null 2> "$LOG/speed.$b.$r.err"
    done
    say "round $r"
  done
  python3 - "$W" "${ROUNDS:-5}" $builds >> "$TABLE" <<'PY'
import json, statistics, sys
w, rounds, builds = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
def tps(b, r):
    j = json.load(open(f"{w}/speed.{b}.{r}.json"))
    for k in ("decode_tok_s", "decode_tokens_per_s"):
        if k in j: return float(j[k])
    d = j.get("decode", {})
    return float(d.get("tok_s") or d.get("tokens_per_s"))
vals = {}
for b in builds:
    try: vals[b] = [tps(b, r) for r in range(1, rounds + 1)]
    except Exception as e: print(f"decode tok/s {b}|ERROR|{e}"); vals[b] = None
for b in builds:
    v = vals[b]
    if not v: continue
    ratio = ""
    if b != "NEW" and vals.get("NEW"):
        rs = [n / o for n, o in zip(vals["NEW"], v)]
        ratio = f"; NEW/{b} median paired ratio {statistics.median(rs):.3f} (min {min(rs):.3f}, max {max(rs):.3f})"
    print(f"decode tok/s {b} (16 layers, 128+128)|{statistics.median(v):.1f}|rounds {', '.join(f'{x:.1f}' for x in v)}{ratio}")
PY
  if [ -n "$MIDB" ]; then
    timeout 400 "$NEW/tarfa-ab" "$BIG" --a-bin "$MIDB/tarfa-run" --b-bin "$NEW/tarfa-run" \
      --a-args "--backend cuda" --b-args "--backend cuda" --workload 128:128 \
      --pairs "${PAIRS:-6}" --metric decode --min-improvement-pct=-2 --out "$OUTD/ab.md" \
      > "$LOG/ab.log" 2>&1
    row "tarfa-ab MID vs NEW (MID's bundle), decode" "rc=$?" "see ab.md"
  fi
  say "speed done"
fi
echo "=== ab ==="; tail -25 "$OUTD/ab.md" 2>/dev/null
echo "=== table ==="
column -t -s'|' "$TABLE" 2>/dev/null || cat "$TABLE"
