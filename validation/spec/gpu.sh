#!/usr/bin/env bash
# Speculative decoding on the GPU machine (issue 27), with the bitwise checks that make it count:
#
#   [PHASE=exact|demo|big|all] validation/spec/gpu.sh BIN_DIR OUT_DIR
#
# BIN_DIR: release tarfa-run, tarfa-convert and tarfa-ab (CARGO_PROFILE_RELEASE_STRIP=true cargo
# build --release -p tarfa-run -p tarfa-convert -p tarfa-validate --bins).
#   exact  every oracle fixture (fixtures/oracle and SHARED_ORACLE, default ../shared/oracle, or
#          BIN_DIR/oracle where the shared fixtures were carried), converted, then `generate
#          --backend cuda` on a prompt that repeats itself (so prompt lookup drafts), greedy: off,
#          ngram:1, ngram:4, ngram:8, the model as its own draft (self:3); sampled
#          (--temperature 0.8 --seed 7): off and ngram:4. Every mode's --logits-out file and
#          printed text against off's, by cmp. JOBS (6) fixtures at once. REPO_FIXTURES=0: the
#          shared ones alone (to split the fixtures over several GPU calls).
#   demo   validation/spec/bench.sh on the demo model (code-repeats, prose-fresh), CUDA.
#   big    the 16-layer synthetic Qwen3-30B-A3B bundle (BIG_DIR, default /tmp/tarfa-q30-16,
#          written when missing): bench.sh with two token prompts, one that repeats its context
#          and one that does not (off, ngram:2/4/8), resident; then streamed (--vram-budget
#          STREAM_VRAM, default 4 GiB: the experts through the GPU's hot tier) off vs ngram:4;
#          then tarfa-ab off vs ngram:4 on its random (non-repeating) prompts, decode metric, the
#          2% bar; the peak RSS of a resident CUDA run against the size of model.jnf (issue 17).
# Prints a short table last (OUT_DIR/table.txt). Exit 0 when every comparison is identical, 1 when
# one differs, 2 bad usage, 3 a run failed.
set -u
BIN=$(cd "${1:?usage: gpu.sh BIN_DIR OUT_DIR}" && pwd) || exit 2
OUTD=${2:?usage: gpu.sh BIN_DIR OUT_DIR}
mkdir -p "$OUTD/logs" && OUTD=$(cd "$OUTD" && pwd) || exit 3
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
[ -f "$ROOT/validation/gpu/cuda-env.sh" ] && . "$ROOT/validation/gpu/cuda-env.sh"
PHASE=${PHASE:-all}
T0=$(date +%s)
say() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
TABLE=$OUTD/table.txt
: > "$TABLE"
row() { printf '%s | %s | %s\n' "$1" "$2" "$3" >> "$TABLE"; }
status=0
W=$(mktemp -d /tmp/tarfa-spec.XXXX)

if [ "$PHASE" = all ] || [ "$PHASE" = exact ]; then
  SHARED=${SHARED_ORACLE:-$ROOT/../shared/oracle}
  [ -d "$BIN/oracle" ] && SHARED=$BIN/oracle
  one_fixture() { # SRC_DIR: prints "name|IDENTICAL or DIFFER (modes)|drafted/accepted of ngram:4"
    local src=$1 name b ids m tag differ="" a
    name=$(basename "$src")
    # the shared oracle repeats some of the repository's names with bigger checkpoints
    case $src in "$SHARED"/*) name=shared-$name ;; esac
    b=$W/bundles/$name
    if ! timeout 300 "$BIN/tarfa-convert" "$src" "$b" > "$OUTD/logs/$name.convert.log" 2>&1; then
      echo "$name|CONVERT FAILED (logs/$name.convert.log)|-"; return
    fi
    # a prompt that repeats itself, inside every fixture's vocabulary
    ids=$(python3 -c 'import json,sys; v=json.load(open(sys.argv[1])).get("vocab_size") or json.load(open(sys.argv[1]))["text_config"]["vocab_size"]; base=[(7*i+3)%min(v,997) for i in range(6)]; print(",".join(map(str,base*3+base[:3])))' "$src/config.json")
    for m in off ngram:1 ngram:4 ngram:8 self:3 s-off s-ngram:4; do
      tag=$name.${m/:/-}
      local args=(generate "$b" --backend "${BACKEND:-cuda}" --tokens "$ids" --max-new-tokens 24 --ignore-eos --quiet
                  --logits-out "$W/$tag.logits" --summary-json "$W/$tag.json")
      case $m in
        s-*) args+=(--temperature 0.8 --seed 7) ;;
      esac
      case ${m#s-} in
        off) ;;
        ngram:*) args+=(--speculate ngram --draft-tokens "${m#*:}") ;;
        self:*) args+=(--speculate model --draft-bundle "$b" --draft-tokens "${m#*:}") ;;
      esac
      if ! timeout 300 "$BIN/tarfa-run" "${args[@]}" > "$W/$tag.txt" 2> "$OUTD/logs/$tag.err"; then
        echo "$name|RUN FAILED ($m, logs/$tag.err)|-"; return
      fi
    done
    for m in ngram:1 ngram:4 ngram:8 self:3; do
      cmp -s "$W/$name.${m/:/-}.logits" "$W/$name.off.logits" && cmp -s "$W/$name.${m/:/-}.txt" "$W/$name.off.txt" || differ="$differ $m"
    done
    cmp -s "$W/$name.s-ngram-4.logits" "$W/$name.s-off.logits" && cmp -s "$W/$name.s-ngram-4.txt" "$W/$name.s-off.txt" || differ="$differ sampled-ngram:4"
    a=$(python3 -c 'import json,sys; s=json.load(open(sys.argv[1])).get("speculate") or {}; print(s.get("accepted", 0), s.get("drafted", 0), sep="/")' "$W/$name.ngram-4.json" 2>/dev/null)
    if [ -z "$differ" ]; then echo "$name|IDENTICAL (7 runs, logits files and text)|$a"; else echo "$name|DIFFER:$differ|$a"; fi
    rm -f "$W/$name".*.logits
  }
  export -f one_fixture
  export BIN W OUTD BACKEND SHARED
  mkdir -p "$W/bundles"
  srcs=()
  repo_fix="$ROOT/fixtures/oracle/*/"
  [ "${REPO_FIXTURES:-1}" = 0 ] && repo_fix=""
  for d in $repo_fix "$SHARED"/*/; do
    [ -f "$d/config.json" ] && srcs+=("${d%/}")
  done
  say "exact: ${#srcs[@]} fixtures"
  printf '%s\n' "${srcs[@]}" | xargs -P "${JOBS:-6}" -I{} bash -c 'one_fixture "$@"' _ {} > "$OUTD/exact.txt"
  sort "$OUTD/exact.txt" | while IFS='|' read -r n v a; do row "speculation = plain, ${BACKEND:-cuda}, $n" "$v" "ngram:4 accepted/drafted $a"; done
  grep -q 'DIFFER\|FAILED' "$OUTD/exact.txt" && status=1
  rm -rf "$W/bundles"
  say "exact done: $(grep -c IDENTICAL "$OUTD/exact.txt") of ${#srcs[@]} identical"
fi

if [ "$PHASE" = all ] || [ "$PHASE" = demo ]; then
  BACKEND=cuda ROUNDS=${DEMO_ROUNDS:-2} KS=4 MODEL_KS=4 timeout 400 \
    "$ROOT/validation/spec/bench.sh" "$BIN" "$OUTD/demo" > "$OUTD/logs/demo.log" 2>&1
  rc=$?; [ $rc -ne 0 ] && status=1
  sed 's/^/demo: /' "$OUTD/demo/table.txt" >> "$TABLE" 2>/dev/null
  say "demo rc=$rc"
fi

if [ "$PHASE" = all ] || [ "$PHASE" = big ]; then
  BIG=${BIG_DIR:-/tmp/tarfa-q30-16}
  if [ ! -f "$BIG/model.jnf" ]; then
    rm -rf "$BIG"
    timeout 300 "$BIN/tarfa-convert" synth --shape qwen3-30b-a3b --layers 16 --skew 1 --format bundle "$BIG" \
      > "$OUTD/logs/synth.log" 2>&1
    say "synth rc=$?"
  fi
  # 32 ids said four times, and 128 ids with no repeat
  python3 -c 'print(",".join(str(11 + (37 * i) % 5000) for i in range(32)) * 1)' > "$W/x"
  { for _ in 1 2 3 4; do cat "$W/x"; done; } | paste -sd, > "$W/repeats.ids"
  seq -s, 11 138 > "$W/fresh.ids"
  if [ "${BIG_BENCH:-1}" = 1 ]; then
  BACKEND=cuda ROUNDS=${BIG_ROUNDS:-3} KS="2 4 8" SELF_DRAFT="" WEAK_DRAFT="" TOKENS=128 timeout 600 \
    "$ROOT/validation/spec/bench.sh" "$BIN" "$OUTD/big" "$BIG" "$W/repeats.ids" "$W/fresh.ids" \
    > "$OUTD/logs/big.log" 2>&1
  rc=$?; [ $rc -ne 0 ] && status=1
  sed 's/^/big resident: /' "$OUTD/big/table.txt" >> "$TABLE" 2>/dev/null
  say "big rc=$rc"
  BACKEND=cuda ROUNDS=1 KS=4 SELF_DRAFT="" WEAK_DRAFT="" TOKENS=64 \
    EXTRA="--vram-budget ${STREAM_VRAM:-4GiB}" timeout 600 \
    "$ROOT/validation/spec/bench.sh" "$BIN" "$OUTD/stream" "$BIG" "$W/repeats.ids" "$W/fresh.ids" \
    > "$OUTD/logs/stream.log" 2>&1
  rc=$?; [ $rc -ne 0 ] && status=1
  sed 's/^/big streamed: /' "$OUTD/stream/table.txt" >> "$TABLE" 2>/dev/null
  say "streamed rc=$rc"
  fi
  # issue 17: no second host copy of a model whose every weight is on the GPU
  rj=$OUTD/big/repeats.off.r1.json
  if [ ! -f "$rj" ]; then
    mkdir -p "$OUTD/big"
    timeout 300 "$BIN/tarfa-run" generate "$BIG" --backend cuda --tokens "$(cat "$W/repeats.ids")" \
      --max-new-tokens 128 --ignore-eos --quiet --summary-json "$rj" > /dev/null 2> "$OUTD/logs/rss.err"
  fi
  rss=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["peak_rss_bytes"])' "$rj" 2>/dev/null)
  jnf=$(stat -c %s "$BIG/model.jnf")
  row "peak RSS of resident CUDA generate (big, 128+128 tokens) vs model.jnf" "${rss:-?} bytes" "model.jnf $jnf bytes"
  if [ -x "$BIN/tarfa-ab" ]; then
    timeout "${AB_TIMEOUT:-600}" "$BIN/tarfa-ab" "$BIG" --a-bin "$BIN/tarfa-run" --a-args "--backend cuda" \
      --b-args "--backend cuda --speculate ngram --draft-tokens 4" --workload 128:64 --pairs "${AB_PAIRS:-5}" \
      --metric decode --out "$OUTD/ab.md" -q > "$OUTD/logs/ab.log" 2>&1
    rc=$?
    row "tarfa-ab off vs ngram:4, big, 128:64, decode, 2% bar" "exit $rc ($([ $rc = 0 ] && echo ACCEPT || { [ $rc = 1 ] && echo REJECT || echo FAILED; }))" "OUT/ab.md"
  fi
fi

rm -rf "$W"
say "done, status $status"
cat "$TABLE"
exit $status
