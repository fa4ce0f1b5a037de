#!/usr/bin/env bash
# Issue 23's figures on the GPU machine: a synthetic Qwen3.5-35B-A3B-shaped bundle of LAYERS
# layers (three gated DeltaNet layers to one gated full-attention layer), resident on the GPU:
# decode tok/s after a 128-token prompt and prefill tok/s of 128- and 512-token prompts, the
# weight bytes a decode token reads against the HBM copy rate measured in the same call (the
# roofline), and transformers BF16 on the same shape in the same call (hf_qwen35.py).
#
#   validation/gpu/arch23-bench.sh BIN_DIR [OUT_DIR]
#
# BIN_DIR: release tarfa-run, tarfa-convert, examples/cuda_bench (as arch22.sh). LAYERS (4),
# DECODE (32). Prints a short table last.
set -u
BIN=$(cd "${1:?usage: arch23-bench.sh BIN_DIR [OUT_DIR]}" && pwd)
OUTD=${2:-${OUT:-./gpu-out}}
mkdir -p "$OUTD/logs"
OUTD=$(cd "$OUTD" && pwd)
LOG=$OUTD/logs
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
T0=$(date +%s)
LAYERS=${LAYERS:-4}
DECODE=${DECODE:-32}
say() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
TABLE=$OUTD/table.txt
: > "$TABLE"
row() { echo "$1|$2|$3" >> "$TABLE"; }
B=/tmp/b-qwen35
rm -rf "$B"
st=$(date +%s)
timeout 300 "$BIN/tarfa-convert" synth --shape qwen3.5-35b-a3b --layers "$LAYERS" --skew 1 \
  --format bundle "$B" > "$LOG/synth.log" 2>&1
rc=$?
row "synth qwen3.5-35b-a3b, $LAYERS layers" "rc=$rc" "$(du -sh "$B" 2>/dev/null | cut -f1) in $(( $(date +%s) - st ))s"
say "synth rc=$rc"
ids() { python3 -c "print(','.join(str((k * 7919 + 13) % 248320) for k in range($1)))"; }
for n in 128 512; do
  d=$DECODE; [ $n = 512 ] && d=1
  timeout 200 "$BIN/tarfa-run" generate "$B" --backend cuda --tokens "$(ids $n)" \
    --max-new-tokens $((d + 1)) --ignore-eos --quiet --stats --summary-json "$LOG/run-$n.json" \
    > "$LOG/run-$n.log" 2>&1
  say "generate prompt $n rc=$?"
done
# the same prompts on the CPU: the logits of the last step compared byte for byte
timeout 200 "$BIN/tarfa-run" generate "$B" --backend cpu --tokens "$(ids 16)" --max-new-tokens 4 \
  --ignore-eos --quiet --logits-out "$LOG/cpu.logits" > "$LOG/cpu.log" 2>&1
timeout 200 "$BIN/tarfa-run" generate "$B" --backend cuda --tokens "$(ids 16)" --max-new-tokens 4 \
  --ignore-eos --quiet --logits-out "$LOG/cuda.logits" > "$LOG/cuda.log" 2>&1
if cmp -s "$LOG/cpu.logits" "$LOG/cuda.logits" && [ -s "$LOG/cpu.logits" ]; then
  row "synth bundle: CPU vs CUDA logits file (16-token prompt, 4 steps)" IDENTICAL "$(stat -c %s "$LOG/cpu.logits") bytes, cmp"
else
  row "synth bundle: CPU vs CUDA logits file" DIFFER "$(cmp "$LOG/cpu.logits" "$LOG/cuda.logits" 2>&1 | head -1)"
fi
timeout 200 "$BIN/examples/cuda_bench" "$B" --prompt 128 --decode 8 --batch 1 > "$LOG/bench.log" 2>&1
say "cuda_bench rc=$?"
PYTHONUNBUFFERED=1 timeout 400 python3 "$ROOT/validation/gpu/hf_qwen35.py" "$LAYERS" "$LOG/hf.json" > "$LOG/hf.log" 2>&1
say "transformers rc=$?"
python3 - "$LOG" >> "$TABLE" <<'PY'
import json, os, re, sys
log = sys.argv[1]
def load(p):
    try:
        return json.load(open(os.path.join(log, p)))
    except Exception:
        return None
r128, r512, hf = load("run-128.json"), load("run-512.json"), load("hf.json")
copy = None
try:
    m = re.search(r"/ (\d+) GB/s copy rate", open(os.path.join(log, "bench.log")).read())
    copy = float(m.group(1)) if m else None
except Exception:
    pass
if r128:
    bpt = r128["decode_weight_bytes_per_token"]
    roof = "" if copy is None else "; roofline %.0f tok/s at the measured %.0f GB/s: %.0f%%" % (
        copy * 1e9 / bpt, copy, 100 * r128["decode_tok_s"] * bpt / (copy * 1e9))
    print("Tarfa CUDA decode (128-token prompt)|%.1f tok/s|%.3f GB of weights per token%s" % (
        r128["decode_tok_s"], bpt / 1e9, roof))
    print("Tarfa CUDA prefill 128|%.0f tok/s|" % r128["prefill_tok_s"])
if r512:
    print("Tarfa CUDA prefill 512|%.0f tok/s|" % r512["prefill_tok_s"])
if hf:
    print("transformers BF16 decode|%.1f tok/s|%s, %.2f B params" % (hf["decode_tok_s"], hf["engine"], hf["params_b"]))
    print("transformers BF16 prefill 128 / 512|%.0f / %.0f tok/s|" % (hf["prefill_128_tok_s"], hf["prefill_512_tok_s"]))
if r128 and hf:
    print("Tarfa / transformers|decode %.2fx, prefill-128 %.2fx|" % (
        r128["decode_tok_s"] / hf["decode_tok_s"], r128["prefill_tok_s"] / hf["prefill_128_tok_s"]))
if r512 and hf:
    print("Tarfa / transformers prefill 512|%.2fx|" % (r512["prefill_tok_s"] / hf["prefill_512_tok_s"]))
PY
rm -rf "$B"
say "done"
tar -czf "$OUTD/logs.tar.gz" -C "$OUTD" logs && rm -rf "$LOG"
column -t -s'|' "$TABLE" | cut -c1-220
