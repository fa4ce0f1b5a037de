#!/usr/bin/env bash
# Streamed MXFP4 decode, two builds on one synthetic gpt-oss-20b bundle (4 layers, the released
# MXFP4 form, 25% of the experts in the GPU hot tier, LRU, direct I/O, page cache evicted before
# each run), OLD and NEW alternating (ROUNDS pairs); each run's logits file compared byte for
# byte with the first; then cuda_bench on the bundle resident: the HBM roofline measured in the
# same call, decode in every mode, prefill, the CPU-vs-CUDA selftest.
#
#   validation/gpu/arch22-ab.sh BIN_DIR OLD_TARFA_RUN [OUT_DIR]
set -u
BIN=$(cd "${1:?usage: arch22-ab.sh BIN_DIR OLD_TARFA_RUN [OUT_DIR]}" && pwd)
OLD=${2:?old tarfa-run}
OUTD=${3:-${OUT:-./gpu-out}}
mkdir -p "$OUTD/logs"; OUTD=$(cd "$OUTD" && pwd); LOG=$OUTD/logs
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
PC=$ROOT/validation/gpu/tools/pagecache.py
b=/tmp/ab-gptoss20
rm -rf "$b"
"$BIN/tarfa-convert" synth --shape gpt-oss-20b --layers 4 --skew 1 --format bundle --mxfp4 "$b" > "$LOG/synth.log" 2>&1 || { tail -3 "$LOG/synth.log"; exit 3; }
read -r vram ram prompt < <(python3 - "$b" <<'PY'
import json, sys
c = json.load(open(sys.argv[1] + "/config.json"))
slot = 3 * c["hidden_size"] * c["intermediate_size"] * 2
n = c["num_hidden_layers"] * c["num_local_experts"]
print((n // 4) * slot, 64 * slot, ",".join(str((k * 7919 + 13) % c["vocab_size"]) for k in range(128)))
PY
)
first=""
for r in $(seq 1 "${ROUNDS:-2}"); do
  for arm in old new; do
    exe=$BIN/tarfa-run; [ $arm = old ] && exe=$OLD
    python3 "$PC" evict "$b/model.jnf"
    timeout 120 "$exe" generate "$b" --backend cuda --tokens "$prompt" --max-new-tokens 33 --ignore-eos \
      --quiet --stats --vram-budget "$vram" --ram-budget "$ram" --io direct --cache-policy lru \
      --summary-json "$LOG/$arm-$r.json" --logits-out "$LOG/$arm-$r.logits" > "$LOG/$arm-$r.log" 2>&1
    rc=$?
    [ -z "$first" ] && first=$LOG/$arm-$r.logits
    same=$(cmp -s "$first" "$LOG/$arm-$r.logits" && echo same || echo DIFFER)
    echo "$arm round $r rc=$rc logits $same: $(python3 -c "import json; d=json.load(open('$LOG/$arm-$r.json')); print('%.2f tok/s' % d['decode_tok_s'])") $(python3 "$ROOT/validation/gpu/tools/run_summary.py" "$LOG/$arm-$r.json")"
  done
done
timeout 240 "$BIN/examples/cuda_bench" "$b" --prompt 128 --decode 32 --prefill 512 --profile-steps 2 \
  --selftest-prompts 1 --json "$OUTD/bench.json" > "$LOG/bench.log" 2>&1
echo "cuda_bench rc=$?"
grep -hE "^roofline|TABLE\||tok/s" "$LOG/bench.log" | head -30
rm -f "$LOG"/*.logits
tar -czf "$OUTD/logs.tar.gz" -C "$OUTD" logs && rm -rf "$LOG"
