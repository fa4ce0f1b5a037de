#!/usr/bin/env bash
# The many-token engine's and the server's figures on the GPU machine (issues 17 and 19), with the
# bitwise checks that make them count:
#
#   [PHASE=decode|sanitize|serve|all] validation/gpu/engine.sh BIN_DIR [OUT_DIR]
#
# BIN_DIR: release tarfa-run, tarfa-convert, tarfa-ab and examples/cuda_bench. BIG_DIR (default
# /tmp/tarfa-q30-16) is reused when it holds a bundle, else the 16-layer synthetic
# Qwen3-30B-A3B bundle is written there.
#   decode 1. `generate --backend cuda` (128-token prompt, 256 new tokens, --ignore-eos) with and
#             without --cuda-wait-each-token (run-ahead, PHASE_LOG B2), ROUNDS (default 4)
#             interleaved rounds: decode tok/s from --summary-json, the median paired ratio, and
#             the printed tokens compared with cmp; the peak RSS of one run (VmHWM);
#             (not tarfa-ab: it writes every run's logits, which takes the forward path, where
#             nothing runs ahead; the interleaved rounds are this change's paired A/B, with a
#             bootstrap interval of the median paired ratio);
#          3. cuda_bench's device loop (decode_greedy, one wait at the end) on the same bundle:
#             the engine's own decode figure the CLI is measured against;
#   sanitize 4. compute-sanitizer memcheck, racecheck, initcheck and synccheck on `generate` with
#             run-ahead (qwen3moe-a, 20 tokens).
#   serve  5. `tarfa-run serve BIG --backend cuda --max-batch 32`, validation/serve/load.py at
#             1, 8, 32 and 128 concurrent clients (every answer against the same request alone).
# Prints a short table last; OUT_DIR gets table.txt and the logs.
set -u
BIN=$(cd "${1:?usage: engine.sh BIN_DIR [OUT_DIR]}" && pwd)
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
BIG=${BIG_DIR:-/tmp/tarfa-q30-16}
W=$(mktemp -d /tmp/tarfa-engine.XXXX)
if [ ! -f "$BIG/model.jnf" ]; then
  rm -rf "$BIG"
  timeout 300 "$BIN/tarfa-convert" synth --shape qwen3-30b-a3b --layers 16 --skew 1 --format bundle "$BIG" \
    > "$LOG/synth.log" 2>&1
  say "bundle rc=$?"
fi
toks=$(seq -s, 11 138)

if [ "$PHASE" = all ] || [ "$PHASE" = decode ]; then
  gen() { # ARM ROUND [extra args]
    local arm=$1 r=$2; shift 2
    timeout 120 "$BIN/tarfa-run" generate "$BIG" --backend cuda --ignore-eos --quiet --tokens "$toks" \
      --max-new-tokens 257 --summary-json "$W/$arm.$r.json" "$@" > "$W/$arm.$r.out" 2> "$LOG/$arm.$r.err"
  }
  for r in $(seq 1 "${ROUNDS:-4}"); do
    gen each "$r" --cuda-wait-each-token
    gen ahead "$r"
    say "round $r"
  done
  same=yes
  for r in $(seq 1 "${ROUNDS:-4}"); do
    cmp -s "$W/each.$r.out" "$W/ahead.1.out" && cmp -s "$W/ahead.$r.out" "$W/ahead.1.out" || same=no
  done
  row "generated tokens, wait-each-token vs run-ahead (cmp, every round)" "$([ $same = yes ] && echo IDENTICAL || echo DIFFER)" "$(wc -w < "$W/ahead.1.out") tokens"
  python3 - "$W" "${ROUNDS:-4}" >> "$TABLE" <<'PY'
import json, statistics, sys
w, rounds = sys.argv[1], int(sys.argv[2])
def tps(arm, r):
    j = json.load(open(f"{w}/{arm}.{r}.json"))
    for k in ("decode_tok_s", "decode_tokens_per_s"):
        if k in j: return float(j[k])
    d = j.get("decode", {})
    return float(d.get("tok_s") or d.get("tokens_per_s"))
try:
    e = [tps("each", r) for r in range(1, rounds + 1)]
    a = [tps("ahead", r) for r in range(1, rounds + 1)]
    rs = [y / x for x, y in zip(e, a)]
    import random
    rnd = random.Random(1)
    boot = sorted(statistics.median(rnd.choice(rs) for _ in rs) for _ in range(2000))
    lo, hi = boot[50], boot[1949]
    print(f"decode tok/s, --cuda-wait-each-token (16 layers, 128+256)|{statistics.median(e):.1f}|rounds {', '.join(f'{x:.1f}' for x in e)}")
    print(f"decode tok/s, run-ahead 8 (default)|{statistics.median(a):.1f}|rounds {', '.join(f'{x:.1f}' for x in a)}; median paired ratio {statistics.median(rs):.3f} (95% bootstrap {lo:.3f}..{hi:.3f}; min {min(rs):.3f}, max {max(rs):.3f}; {len(rs)} pairs)")
except Exception as ex:
    print(f"decode tok/s|ERROR|{ex}")
PY
  # peak resident memory of one run (every weight on the GPU); SKIP_BENCH=1 skips it and step 3
  if [ -z "${SKIP_BENCH:-}" ]; then
    "$BIN/tarfa-run" generate "$BIG" --backend cuda --ignore-eos --quiet --tokens "$toks" --max-new-tokens 16 \
      > /dev/null 2> "$LOG/rss.err" &
    pid=$!; hwm=0
    while kill -0 $pid 2>/dev/null; do
      v=$(awk '/VmHWM/ {print $2}' /proc/$pid/status 2>/dev/null); [ -n "$v" ] && hwm=$v; sleep 0.5
    done
    wait $pid; rc=$?
    row "peak RSS of generate (16-layer bundle, all weights in VRAM)" "$(( hwm / 1024 )) MiB" "rc=$rc; model.jnf $(( $(stat -c %s "$BIG/model.jnf") / 1048576 )) MiB"
    say "rss ${hwm} kB"
  fi
  if [ -z "${SKIP_BENCH:-}" ] && [ -x "$BIN/cuda_bench" ]; then
    timeout 240 "$BIN/cuda_bench" "$BIG" --prompt 128 --decode 256 --prefill 512 --pairs 2 --selftest-prompts 1 \
      > "$LOG/bench.log" 2>&1
    say "bench rc=$?"
    grep '^TABLE|' "$LOG/bench.log" | grep -i 'loop\|roofline\|HBM\|api' | head -8 | sed 's/^TABLE|//' >> "$TABLE"
  fi
fi

if [ "$PHASE" = all ] || [ "$PHASE" = sanitize ]; then
  if command -v compute-sanitizer > /dev/null; then
    "$BIN/tarfa-convert" "$ROOT/fixtures/oracle/qwen3moe-a" "$W/qa" > /dev/null 2>&1
    for tool in memcheck racecheck initcheck synccheck; do
      timeout 300 compute-sanitizer --tool $tool --error-exitcode 9 "$BIN/tarfa-run" generate "$W/qa" \
        --backend cuda --tokens 1,2,3,4,5 --max-new-tokens 20 --ignore-eos --quiet > "$LOG/san-$tool.out" 2>&1
      rc=$?
      row "compute-sanitizer $tool, generate with run-ahead (qwen3moe-a, 20 tokens)" "$([ $rc = 0 ] && echo CLEAN || echo "rc=$rc")" "$(grep -c 'ERROR SUMMARY: 0' "$LOG/san-$tool.out") clean summaries"
    done
    say "sanitizers"
  fi
fi

if [ "$PHASE" = all ] || [ "$PHASE" = serve ]; then
  "$BIN/tarfa-run" serve "$BIG" --backend cuda --port 0 --max-batch 32 --max-queue 1024 > "$LOG/serve.out" 2> "$LOG/serve.err" &
  spid=$!
  url=""
  for _ in $(seq 1 120); do
    url=$(grep -o 'http://[0-9.:]*' "$LOG/serve.err" | head -1); [ -n "$url" ] && break; sleep 1
  done
  if [ -n "$url" ]; then
    say "serving at $url"
    timeout 400 python3 "$ROOT/validation/serve/load.py" "$url" --clients 1,8,32,128 --requests 2 \
      --prompt 64 --max-tokens 32 --vocab 151936 --distinct 8 --json "$OUTD/serve.json" > "$LOG/load.log" 2>&1
    row "serve load.py rc (0: every answer = the request alone)" "rc=$?" "see logs/load.log"
    grep '^TABLE|' "$LOG/load.log" | sed 's/^TABLE|//' >> "$TABLE"
  else
    row "serve" "did not start" "$(tail -2 "$LOG/serve.err" | tr '\n' ' ')"
  fi
  kill -TERM $spid 2>/dev/null; wait $spid
  row "serve after SIGTERM" "rc=$?" ""
fi
rm -rf "$W"
echo "=== ab ==="; tail -20 "$OUTD/ab.md" 2>/dev/null
echo "=== table ==="
column -t -s'|' "$TABLE" 2>/dev/null || cat "$TABLE"
