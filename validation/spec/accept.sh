#!/usr/bin/env bash
# Prompt lookup's acceptance on every oracle fixture, on the CPU (the CUDA runs give the same
# tokens, bit for bit: PHASE_LOG D4), with spec/gpu.sh's exact-phase prompt (6 ids said three
# times and a half), greedy, 24 new tokens, --draft-tokens K (default 4):
#
#   validation/spec/accept.sh BIN_DIR [SHARED_ORACLE] > table.md
#
# BIN_DIR: release tarfa-run and tarfa-convert. Prints a markdown table: fixture, drafted,
# accepted, acceptance, tokens per decode step. Exit 3 when a conversion or run fails.
set -u
BIN=$(cd "${1:?usage: accept.sh BIN_DIR [SHARED_ORACLE]}" && pwd) || exit 2
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
SHARED=${2:-$ROOT/../shared/oracle}
K=${K:-4}
W=$(mktemp -d /tmp/tarfa-accept.XXXX)
trap 'rm -rf "$W"' EXIT
echo "| fixture | drafted | accepted | acceptance | tokens per step |"
echo "| --- | ---: | ---: | ---: | ---: |"
for d in "$ROOT"/fixtures/oracle/*/ "$SHARED"/*/; do
  [ -f "$d/config.json" ] || continue
  name=$(basename "$d"); case $d in "$SHARED"/*) name=shared-$name ;; esac
  "$BIN/tarfa-convert" "${d%/}" "$W/$name" > "$W/convert.log" 2>&1 || { echo "convert failed: $name" >&2; exit 3; }
  ids=$(python3 -c 'import json,sys; c=json.load(open(sys.argv[1])); v=c.get("vocab_size") or c["text_config"]["vocab_size"]; base=[(7*i+3)%min(v,997) for i in range(6)]; print(",".join(map(str,base*3+base[:3])))' "$d/config.json")
  "$BIN/tarfa-run" generate "$W/$name" --tokens "$ids" --max-new-tokens 24 --ignore-eos --quiet \
    --speculate ngram --draft-tokens "$K" --summary-json "$W/s.json" > /dev/null 2> "$W/run.log" || { cat "$W/run.log" >&2; exit 3; }
  python3 -c 'import json,sys; s=json.load(open(sys.argv[1]))["speculate"]; d,a=s["drafted"],s["accepted"]; t=s.get("tokens_per_step", 0); print(f"| {sys.argv[2]} | {d} | {a} | {100*a/d if d else 0:.0f}% | {t:.2f} |")' "$W/s.json" "$name"
  rm -rf "${W:?}/$name"
done
