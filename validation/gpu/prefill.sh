#!/usr/bin/env bash
# Issue 17 on the GPU machine (PHASE_LOG B5): the lane-sequential products and the prefill
# attention of kernels/prefill.cu, checked bit for bit and measured against the token-tiled
# kernels and transformers in one call. No Rust toolchain there: carry the release binaries.
#
#   [PHASE=all|check|bench|hf|san|check,bench,...] validation/gpu/prefill.sh BIN_DIR [OUT_DIR]
#
# BIN_DIR: tarfa-convert, examples/cuda_selftest, examples/cuda_bench, built with
#   CARGO_PROFILE_RELEASE_STRIP=true cargo build --release -p tarfa-run -p tarfa-convert \
#       --example cuda_selftest --example cuda_bench
# Phases (all: check, bench, hf; san only when asked, it needs the time of a call of its own):
#   check  1. the kernel checks (cuda_selftest kernels: every kernel against the CPU reference,
#             the lane-sequential products and the prefill attention included);
#          2. CPU vs CUDA selftests with every step of many tokens on kernels/prefill.cu
#             (--many-kernels lanes): the repository's fixtures (GQA head widths 16 to 32 and
#             24, MLA, F32 weights, dense layers, Llama 4's chunks) and the shared gpt-oss one
#             when present; every logit and router record byte for byte.
#   bench  3. the 16-layer synthetic Qwen3-30B-A3B bundle (written to BIG_DIR, default
#             /tmp/tarfa-q30-16, while step 1-2 run); cuda_bench --only-many on it: prefill of
#             128, 512, 2,048 and 8,192 tokens and batched decode at B = 1, 8, 32, 128, each in
#             the arms `tiled` (PHASE_LOG B3's kernels, the default) and `auto`, every arm's
#             logits equal to the first's, the prompt in chunks of 100 equal to it whole, every
#             sequence of a batch equal to it alone. SHAPE=qwen3-235b-a22b LAYERS=4 for the other
#             bundle (BIG_DIR then defaults to /tmp/tarfa-q235-4).
#   hf     4. transformers BF16 on the same shape (hf_many.py), then the ratios.
#   san    5. compute-sanitizer memcheck, racecheck, initcheck, synccheck on cuda_bench
#             --only-many --many-kernels lanes over the qwen3moe-a fixture (small sizes: every
#             kernel of prefill.cu, the multi-sequence step included).
# ARM=auto (default lanes): the selftests of step 2 and the sanitizers of step 5 on
# --many-kernels auto instead (tile.cu's few-pair experts kernels, which only auto takes).
# Prints a short table last; OUT_DIR gets table.txt, the JSON figures and logs.tar.gz.
set -u
BIN=$(cd "${1:?usage: prefill.sh BIN_DIR [OUT_DIR]}" && pwd)
OUTD=${2:-${OUT:-./gpu-out}}
mkdir -p "$OUTD"
OUTD=$(cd "$OUTD" && pwd)
LOG=$(mktemp -d /tmp/tarfa-prefill.XXXX)/logs
mkdir -p "$LOG"
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
. "$ROOT/validation/gpu/cuda-env.sh"
T0=$(date +%s)
say() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
TABLE=$OUTD/table.txt
touch "$TABLE"
row() { echo "$1|$2|$3" >> "$TABLE"; }
PHASE=${PHASE:-all}
# PHASE: all, or a comma-separated list of phases (check,bench)
has() { case ",$PHASE," in *",$1,"*) return 0 ;; esac; [ "$PHASE" = all ] && [ "$1" != san ]; }
ST=$BIN/examples/cuda_selftest
CB=$BIN/examples/cuda_bench
SHAPE=${SHAPE:-qwen3-30b-a3b}
LAYERS=${LAYERS:-16}
if [ "$SHAPE" = qwen3-30b-a3b ]; then BIG=${BIG_DIR:-/tmp/tarfa-q30-16}; else BIG=${BIG_DIR:-/tmp/tarfa-q235-4}; fi
FIX=$ROOT/fixtures/oracle
SHARED=$ROOT/../shared/oracle
finish() {
  (cd "$LOG/.." && tar czf "$OUTD/logs.tar.gz" logs) 2>/dev/null
  echo "===== table ($(( $(date +%s) - T0 )) s) ====="
  column -t -s '|' "$TABLE" 2>/dev/null || cat "$TABLE"
}
trap finish EXIT

SYNTH_PID=
if has bench && [ ! -f "$BIG/model.jnf" ]; then
  rm -rf "$BIG"
  ( timeout 400 "$BIN/tarfa-convert" synth --shape "$SHAPE" --layers "$LAYERS" --skew 1 \
      --format bundle "$BIG" > "$LOG/synth.log" 2>&1; echo "rc=$?" >> "$LOG/synth.log" ) &
  SYNTH_PID=$!
fi

if has check; then
  timeout 240 "$ST" kernels > "$LOG/kernels.log" 2>&1
  grep -h '^TABLE|' "$LOG/kernels.log" | sed 's/^TABLE|//' >> "$TABLE"
  grep -E 'many tokens|prefill attention' "$LOG/kernels.log"
  say "kernel checks"
  for f in qwen3moe-a qwen3moe-code olmoe-s mixtral-s deepseekv3-s qwen3moe-odd glm4moe-s \
           llama4-dense-s; do
    timeout 90 "$ST" fixture "$FIX/$f" --decode 4 --many-kernels "${ARM:-lanes}" > "$LOG/fixture-$f.log" 2>&1
    grep -h '^TABLE|' "$LOG/fixture-$f.log" | sed "s/^TABLE|selftest /selftest (${ARM:-lanes}) /" >> "$TABLE"
  done
  if [ -d "$SHARED/gptoss-a" ]; then
    timeout 120 "$ST" fixture "$SHARED/gptoss-a" --decode 4 --many-kernels "${ARM:-lanes}" > "$LOG/fixture-gptoss-a.log" 2>&1
    grep -h '^TABLE|' "$LOG/fixture-gptoss-a.log" | sed "s/^TABLE|selftest /selftest (${ARM:-lanes}) /" >> "$TABLE"
  fi
  say "selftests"
fi

if has bench; then
  if [ -n "$SYNTH_PID" ]; then wait "$SYNTH_PID"; fi
  say "bundle: $(tail -1 "$LOG/synth.log" 2>/dev/null) $(du -sh "$BIG" 2>/dev/null | cut -f1)"
  timeout "${BENCH_TIMEOUT:-330}" "$CB" "$BIG" --only-many --prefill "${PREFILL:-128,512,2048,8192}" \
    --batch "${BATCH:-1,8,32,128}" --batch-steps 16 --prompt 128 \
    --many-kernels "${ARMS:-tiled,auto}" --json "$OUTD/many.json" > "$LOG/many.log" 2>&1
  say "cuda_bench --only-many rc=$?"
  grep -h '^TABLE|' "$LOG/many.log" | sed 's/^TABLE|//' >> "$TABLE"
fi

# where a prefill's and a batch step's time goes: the kernels' GPU time by name (nsys)
if has bench && [ "${NSYS:-1}" = 1 ] && command -v nsys >/dev/null; then
  timeout 200 nsys profile -o "$LOG/prof" --force-overwrite true --trace cuda --sample none \
    --cpuctxsw none "$CB" "$BIG" --only-many --prefill "${NSYS_PREFILL:-2048}" --batch "" \
    --many-kernels auto > "$LOG/nsys-run.log" 2>&1
  nsys stats --report cuda_gpu_kern_sum --format csv --output "$LOG/kern" "$LOG/prof.nsys-rep" \
    > /dev/null 2>&1
  python3 - "$LOG"/kern*.csv >> "$TABLE" <<'PY'
import csv, sys
try:
    rows = list(csv.DictReader(open(sys.argv[1])))
except Exception as e:
    print(f"nsys kernels|ERROR|{e}"); sys.exit()
tot = sum(float(r["Total Time (ns)"]) for r in rows)
for r in sorted(rows, key=lambda r: -float(r["Total Time (ns)"]))[:12]:
    t = float(r["Total Time (ns)"])
    print(f"nsys {r['Name'][:40]}|{100 * t / tot:.1f}%|{t / 1e6:.1f} ms in {r['Instances']} launches")
PY
  cp "$LOG"/kern*.csv "$OUTD/" 2>/dev/null
  say "nsys"
fi

if has hf; then
  PYTHONUNBUFFERED=1 timeout "${HF_TIMEOUT:-240}" python3 "$ROOT/validation/gpu/hf_many.py" "$LAYERS" \
    "$OUTD/hf.json" "$SHAPE" > "$LOG/hf.log" 2>&1
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
        print(f"prefill {p['tokens']} [{p.get('kernels', '?')}] vs transformers|{p['tok_s'] / hf:.2f}x|tarfa {p['tok_s']:.0f} tok/s ({100 * p['fma_peak_share']:.1f}% of the FMA peak), transformers {hf:.0f} tok/s")
for d in t.get("batched_decode", []):
    hf = h["batched_decode"].get(str(d["batch"]))
    if hf:
        print(f"batched decode B={d['batch']} [{d.get('kernels', '?')}] vs transformers|{d['tok_s'] / hf:.2f}x|tarfa {d['tok_s']:.0f} tok/s ({100 * d['tok_s'] / d['roofline_tok_s']:.1f}% of its roofline), transformers {hf:.0f} tok/s")
PY
fi

if has san; then
  FQ=$FIX/qwen3moe-a
  pids=()
  for tool in memcheck racecheck initcheck synccheck; do
    ( timeout "${SAN_TIMEOUT:-400}" compute-sanitizer --tool $tool --error-exitcode 9 "$CB" "$FQ" \
        --only-many --prefill 40,130 --batch 1,3 --batch-steps 2 --prompt 20 \
        --many-kernels "${ARM:-lanes}" > "$LOG/san-$tool.log" 2>&1
      echo "rc=$?" >> "$LOG/san-$tool.log" ) &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p"; done
  for tool in memcheck racecheck initcheck synccheck; do
    rc=$(grep -o 'rc=[0-9]*' "$LOG/san-$tool.log" | tail -1)
    row "compute-sanitizer $tool, cuda_bench --only-many --many-kernels ${ARM:-lanes} (qwen3moe-a)" \
      "$([ "$rc" = rc=0 ] && echo CLEAN || echo "$rc")" \
      "$(grep -h 'ERROR SUMMARY' "$LOG/san-$tool.log" | tail -1)"
  done
  say "sanitizers"
fi
