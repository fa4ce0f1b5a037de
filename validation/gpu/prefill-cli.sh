#!/usr/bin/env bash
# Issue 17 on the GPU machine, the follow-up of prefill.sh (PHASE_LOG B8): where Auto's
# thresholds should sit (tiled, lanes and auto at 64 to 512 tokens), the CLI's prefill with
# --cuda-many tiled and auto (what a user of `tarfa-run generate` gets, logits compared byte for
# byte), and the other expert shape (Qwen3-235B-A22B, 4 layers) against transformers.
#
#   [STEPS=thresholds,cli,q235,decode,nsys,ncu] validation/gpu/prefill-cli.sh BIN_DIR [OUT_DIR]
#   (BIN_DIR as for prefill.sh; STEPS defaults to thresholds,cli,q235)
# cli: without --preload a prefill's time includes reading and verifying the experts it first
# uses (20 GB here); with --preload (PRELOAD=1) it is the step's compute alone.
# decode: the CLI's greedy decode of 512 tokens after 128 (--preload) beside cuda_bench's
# decode figures on the same bundle (issue 17: "the CLI reaches the engine's speed").
set -u
BIN=$(cd "${1:?usage: prefill-cli.sh BIN_DIR [OUT_DIR]}" && pwd)
OUTD=${2:-${OUT:-./gpu-out}}
mkdir -p "$OUTD"; OUTD=$(cd "$OUTD" && pwd)
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
. "$ROOT/validation/gpu/cuda-env.sh"
T0=$(date +%s)
STEPS=${STEPS:-thresholds,cli,q235}
step() { case ",$STEPS," in *",$1,"*) return 0 ;; esac; return 1; }
PL=; [ "${PRELOAD:-0}" = 1 ] && PL=--preload
say() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
Q30=/tmp/tarfa-q30-16; Q235=/tmp/tarfa-q235-4
[ -f $Q30/model.jnf ] || timeout 200 "$BIN/tarfa-convert" synth --shape qwen3-30b-a3b --layers 16 --skew 1 --format bundle $Q30 > "$OUTD/synth30.log" 2>&1
say "q30 bundle"
step q235 && ( [ -f $Q235/model.jnf ] || timeout 300 "$BIN/tarfa-convert" synth --shape qwen3-235b-a22b --layers 4 --skew 1 --format bundle $Q235 > "$OUTD/synth235.log" 2>&1 ) &
SYN=$!
# 1. the thresholds: every arm at the sizes around Auto's switch
if step thresholds; then
timeout 150 "$BIN/examples/cuda_bench" $Q30 --only-many --prefill 64,128,256,512 --batch "" \
  --many-kernels tiled,lanes,auto --json "$OUTD/thresholds.json" > "$OUTD/thresholds.log" 2>&1
say "thresholds rc=$?"; grep '^TABLE|' "$OUTD/thresholds.log" | sed 's/^TABLE|/  /'
fi
# 2. the CLI: a 2,048-token prompt, tiled then auto: once timed (the summary's prefill), once with
#    every prompt position's logits written (--prefill-logits: 2,048 x vocab rows through the
#    lm_head and to the host, so not timed), those files compared byte for byte
TOK=$(python3 -c "print(','.join(str(17 + (i * 7919) % 150000) for i in range(2048)))")
if step cli; then
  for m in tiled auto; do
    timeout 120 "$BIN/tarfa-run" generate $Q30 --backend cuda --cuda-many $m --tokens "$TOK" \
      --max-new-tokens 4 --ignore-eos --quiet $PL --summary-json "$OUTD/cli-$m.json" > "$OUTD/cli-$m.log" 2>&1
    say "cli $m rc=$? $(python3 -c "import json;d=json.load(open('$OUTD/cli-$m.json'));print({k:v for k,v in d.items() if k.startswith('prefill')})" 2>&1 | head -c 300)"
    timeout 120 "$BIN/tarfa-run" generate $Q30 --backend cuda --cuda-many $m --tokens "$TOK" \
      --max-new-tokens 4 --ignore-eos --quiet $PL --prefill-logits --logits-out "$OUTD/cli-$m.st" > "$OUTD/cli-logits-$m.log" 2>&1
    say "cli $m logits rc=$?"
  done
  cmp "$OUTD/cli-tiled.st" "$OUTD/cli-auto.st" && say "cli logits (2048 prefill rows + 4): tiled = auto byte for byte"
fi
rm -f "$OUTD"/cli-*.st
if step decode; then
  TOK=$(python3 -c "print(','.join(str(17 + (i * 7919) % 150000) for i in range(128)))")
  timeout 120 "$BIN/tarfa-run" generate $Q30 --backend cuda --tokens "$TOK" --max-new-tokens 512 \
    --ignore-eos --quiet --preload --summary-json "$OUTD/cli-decode.json" > "$OUTD/cli-decode.log" 2>&1
  say "cli decode rc=$? $(python3 -c "import json;d=json.load(open('$OUTD/cli-decode.json'));print({k:v for k,v in d.items() if 'decode' in k})" 2>&1 | head -c 300)"
  timeout 200 "$BIN/examples/cuda_bench" $Q30 --prompt 128 --decode 512 --prefill "" --selftest-prompts 0 \
    --json "$OUTD/bench-decode.json" > "$OUTD/bench-decode.log" 2>&1
  say "cuda_bench decode rc=$?"; grep '^TABLE|' "$OUTD/bench-decode.log" | grep -i decode | sed 's/^TABLE|/  /' | head -20
fi
# 4. where a batched decode step's time goes (B = 8 and 32, auto): the kernels' GPU time by name
if step nsys && command -v nsys >/dev/null; then
  timeout 150 nsys profile -o "$OUTD/bd" --force-overwrite true --trace cuda --sample none \
    --cpuctxsw none "$BIN/examples/cuda_bench" $Q30 --only-many --prefill "" --batch 8,32 \
    --batch-steps 8 --prompt 128 --many-kernels auto > "$OUTD/nsys-run.log" 2>&1
  nsys stats --report cuda_gpu_kern_sum,cuda_api_sum --format csv --output "$OUTD/bd" "$OUTD/bd.nsys-rep" > /dev/null 2>&1
  rm -f "$OUTD/bd.nsys-rep" "$OUTD/bd.sqlite"
  python3 - "$OUTD"/bd_cuda_gpu_kern_sum.csv "$OUTD"/bd_cuda_api_sum.csv <<'PY'
import csv, sys
for f in sys.argv[1:]:
    try:
        rows = list(csv.DictReader(open(f)))
    except Exception as e:
        print(f"  {f}: {e}"); continue
    tot = sum(float(r["Total Time (ns)"]) for r in rows)
    print(f"  {f.split('/')[-1]}: {tot / 1e6:.1f} ms in all")
    for r in sorted(rows, key=lambda r: -float(r["Total Time (ns)"]))[:12]:
        t = float(r["Total Time (ns)"])
        print(f"    {r['Name'][:44]:44s} {100 * t / tot:5.1f}%  {t / 1e6:8.1f} ms  {r['Instances'] if 'Instances' in r else r.get('Num Calls', '')} calls")
PY
  say "nsys"
fi
# 5. the same with ncu (no nsys on the GPU machine): every kernel's GPU time, in launch order, of
#    a batched decode at B = 1, 8, 32 (and 128 with auto), 2 steps each after a 16-token prompt, nothing compared,
#    and of an 8-token step of one sequence (a draft's verification), each with auto and few;
#    analysed off the machine (validation/gpu/tools/ncu_steps.py)
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
if step ncu && [ -n "$NCU" ]; then
  for what in "bd-auto|auto --prefill '' --batch 1,8,32,128 --batch-steps 2 --prompt 16 --no-reference" \
              "bd-few|few --prefill '' --batch 1,8,32 --batch-steps 2 --prompt 16 --no-reference" \
              "p8-auto|auto --prefill 8 --batch ''" "p8-few|few --prefill 8 --batch ''"; do
    name=${what%%|*}; a=${what#*|}
    eval timeout "${NCU_TIMEOUT:-150}" "$NCU" --metrics gpu__time_duration.sum --csv --cache-control none \
      --clock-control none --print-units base --log-file "$OUTD/ncu-$name.csv" \
      "$BIN/examples/cuda_bench" $Q30 --only-many --many-kernels $a > "$OUTD/ncu-$name.log" 2>&1
    say "ncu $name rc=$? $(grep -c gpu__time "$OUTD/ncu-$name.csv" 2>/dev/null) kernels"
    grep '^TABLE|' "$OUTD/ncu-$name.log" | sed 's/^TABLE|/  /'
  done
fi
step q235 || exit 0
wait $SYN; say "q235 bundle $(tail -1 "$OUTD/synth235.log" 2>/dev/null)"
rm -rf $Q30
# 3. Qwen3-235B-A22B's expert shape, and transformers on it
timeout 200 "$BIN/examples/cuda_bench" $Q235 --only-many --prefill 128,512,2048,8192 --batch 1,32 \
  --batch-steps 8 --prompt 128 --many-kernels tiled,auto --json "$OUTD/q235.json" > "$OUTD/q235.log" 2>&1
say "q235 rc=$?"; grep '^TABLE|' "$OUTD/q235.log" | sed 's/^TABLE|/  /'
[ "${HF:-1}" = 1 ] && PYTHONUNBUFFERED=1 timeout 150 python3 "$ROOT/validation/gpu/hf_many.py" 4 "$OUTD/hf235.json" qwen3-235b-a22b > "$OUTD/hf235.log" 2>&1
say "transformers rc=$?"; cat "$OUTD/hf235.json" 2>/dev/null
