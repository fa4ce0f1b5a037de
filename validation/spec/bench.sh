#!/usr/bin/env bash
# Speculative decoding (prompt lookup, and a draft model: the model as its own draft and a weak
# draft) against plain decoding, on one bundle: the outputs must be byte-identical (cmp of the
# generated text and of --logits-out files), then tok/s, acceptance, tokens per step and the
# speed ratio per mode and draft length. Prints a short table last (also OUT/table.txt).
#
#   validation/spec/bench.sh BIN_DIR OUT [BUNDLE] [PROMPT_FILE...]
#
# BIN_DIR: tarfa-run (and tarfa-convert when BUNDLE is not given) of a release build:
#   cargo build --release -p tarfa-run -p tarfa-convert; BIN_DIR=target/release
# BUNDLE: a converted bundle with a tokenizer; default: the demo model (fixtures/oracle/
#   qwen3moe-code) converted into OUT/demo-bundle, and its first WEAK_LAYERS (1) layers
#   (validation/spec/truncate.py) into OUT/weak-bundle, the weak draft.
# PROMPT_FILE: default: validation/spec/prompts/{code-repeats,prose-fresh}.txt (one prompt that
#   quotes its own context, one that does not). A file named *.ids holds token ids (commas or
#   whitespace between them), given as --tokens: for a bundle without a tokenizer (a synthetic
#   one).
# Environment: BACKEND (auto), THREADS (0: one per core), TOKENS (max new tokens, 128), ROUNDS
#   (3; the modes are interleaved within each round), KS ("2 4 8": prompt lookup's draft
#   lengths), MODEL_KS (KS: the draft models'), SELF_DRAFT (the self-draft's bundle: BUNDLE; ""
#   skips it), WEAK_DRAFT (the weak draft's bundle: the cut demo model by default, none when
#   BUNDLE is given; "" skips it), EXTRA (more generate options, e.g. "--temperature 0.8 --seed
#   1": sampling must be exact too).
# Modes: off, ngram:K, self:K (--speculate model --draft-bundle SELF_DRAFT), weak:K (WEAK_DRAFT).
# The logits files of round 0 are deleted once compared (a large vocabulary makes them big).
# Exit: 0 when every output is identical, 1 when one differs, 2 bad usage, 3 a run failed.
set -u
BIN=$(cd "${1:?usage: bench.sh BIN_DIR OUT [BUNDLE] [PROMPT_FILE...]}" && pwd) || exit 2
OUTD=${2:?usage: bench.sh BIN_DIR OUT [BUNDLE] [PROMPT_FILE...]}
mkdir -p "$OUTD" && OUTD=$(cd "$OUTD" && pwd) || exit 3
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BUNDLE=${3:-}
shift 2; [ $# -gt 0 ] && shift
PROMPTS=("$@")
[ ${#PROMPTS[@]} -eq 0 ] && PROMPTS=("$ROOT/validation/spec/prompts/code-repeats.txt" "$ROOT/validation/spec/prompts/prose-fresh.txt")
BACKEND=${BACKEND:-auto}; THREADS=${THREADS:-0}; TOKENS=${TOKENS:-128}; ROUNDS=${ROUNDS:-3}
KS=${KS:-"2 4 8"}; MODEL_KS=${MODEL_KS:-$KS}; EXTRA=${EXTRA:-}
RUN=$BIN/tarfa-run
[ -x "$RUN" ] || { echo "bench.sh: no tarfa-run in $BIN" >&2; exit 2; }
if [ -z "$BUNDLE" ]; then
  BUNDLE=$OUTD/demo-bundle
  if [ ! -f "$BUNDLE/manifest.toml" ]; then
    "$BIN/tarfa-convert" "$ROOT/fixtures/oracle/qwen3moe-code" "$BUNDLE" >"$OUTD/convert.log" 2>&1 \
      || { echo "bench.sh: conversion failed (OUT/convert.log)" >&2; exit 3; }
  fi
  if [ -z "${WEAK_DRAFT+set}" ]; then
    WEAK_DRAFT=$OUTD/weak-bundle
    if [ ! -f "$WEAK_DRAFT/manifest.toml" ]; then
      rm -rf "$OUTD/weak-src"
      python3 "$ROOT/validation/spec/truncate.py" "$ROOT/fixtures/oracle/qwen3moe-code" \
          "$OUTD/weak-src" "${WEAK_LAYERS:-1}" >"$OUTD/weak.log" 2>&1 \
        && "$BIN/tarfa-convert" "$OUTD/weak-src" "$WEAK_DRAFT" >>"$OUTD/weak.log" 2>&1 \
        || { echo "bench.sh: the weak draft failed (OUT/weak.log)" >&2; exit 3; }
    fi
  fi
fi
SELF_DRAFT=${SELF_DRAFT-$BUNDLE}; WEAK_DRAFT=${WEAK_DRAFT:-}
MODES="off"; for k in $KS; do MODES="$MODES ngram:$k"; done
[ -n "$SELF_DRAFT" ] && for k in $MODEL_KS; do MODES="$MODES self:$k"; done
[ -n "$WEAK_DRAFT" ] && for k in $MODEL_KS; do MODES="$MODES weak:$k"; done
RES=$OUTD/runs.tsv
printf 'prompt\tmode\tround\tdecode_tok_s\tdrafted\taccepted\tsteps\n' >"$RES"
status=0
for p in "${PROMPTS[@]}"; do
  name=$(basename "$p"); name=${name%.txt}; name=${name%.ids}
  case $p in
    *.ids) input=(--tokens "$(tr -s ' \n\t' ',,,' < "$p" | sed 's/^,//; s/,$//')") ;;
    *) input=(--prompt-file "$p") ;;
  esac
  # Round 0 checks the logits files too (untimed: keeping logits takes the GPU off its
  # token-only path); rounds 1..ROUNDS are timed, their text compared.
  for r in $(seq 0 "$ROUNDS"); do
    for m in $MODES; do
      tag=$name.${m/:/-}.r$r
      args=(generate "$BUNDLE" "${input[@]}" --max-new-tokens "$TOKENS" --ignore-eos
            --backend "$BACKEND" --threads "$THREADS" --summary-json "$OUTD/$tag.json")
      [ "$r" = 0 ] && args+=(--logits-out "$OUTD/$tag.logits")
      case $m in
        off) ;;
        ngram:*) args+=(--speculate ngram --draft-tokens "${m#*:}") ;;
        self:*) args+=(--speculate model --draft-bundle "$SELF_DRAFT" --draft-tokens "${m#*:}") ;;
        weak:*) args+=(--speculate model --draft-bundle "$WEAK_DRAFT" --draft-tokens "${m#*:}") ;;
      esac
      # shellcheck disable=SC2086
      if ! "$RUN" "${args[@]}" $EXTRA >"$OUTD/$tag.txt" 2>"$OUTD/$tag.log"; then
        echo "bench.sh: $tag failed (OUT/$tag.log)" >&2; exit 3
      fi
      ref=$name.off.r0
      if ! cmp -s "$OUTD/$tag.txt" "$OUTD/$ref.txt" \
         || { [ "$r" = 0 ] && ! cmp -s "$OUTD/$tag.logits" "$OUTD/$ref.logits"; }; then
        echo "DIFFERS: $tag against $ref" | tee -a "$OUTD/differences.txt" >&2; status=1
      fi
      [ "$r" = 0 ] && continue
      python3 - "$OUTD/$tag.json" "$name" "$m" "$r" >>"$RES" <<'PY'
import json, sys
v = json.load(open(sys.argv[1])); s = v.get("speculate") or {}
print("\t".join(map(str, [sys.argv[2], sys.argv[3], sys.argv[4], v["decode_tok_s"],
      s.get("drafted", 0), s.get("accepted", 0), s.get("decode_steps", v["generated_tokens"] - 1)])))
PY
    done
  done
  rm -f "$OUTD/$name".*.r0.logits
done
python3 - "$RES" "$BACKEND" "$TOKENS" "$ROUNDS" <<'PY' | tee "$OUTD/table.txt"
import csv, statistics, sys
rows = list(csv.DictReader(open(sys.argv[1]), delimiter="\t"))
print(f"speculative decoding (ngram:K prompt lookup, self:K the model as its own draft, weak:K "
      f"a weak draft model) vs off: backend {sys.argv[2]}, {sys.argv[3]} tokens, "
      f"{sys.argv[4]} interleaved rounds, median decode tok/s")
print(f"{'prompt':<16} {'mode':<9} {'tok/s':>9} {'ratio':>6} {'accept':>7} {'tok/step':>8}")
for p in dict.fromkeys(r["prompt"] for r in rows):
    mine = [r for r in rows if r["prompt"] == p]
    med = lambda m: statistics.median(float(r["decode_tok_s"]) for r in mine if r["mode"] == m)
    base = med("off")
    for m in dict.fromkeys(r["mode"] for r in mine):
        one = [r for r in mine if r["mode"] == m][0]
        d, a, s = int(one["drafted"]), int(one["accepted"]), int(one["steps"])
        acc = f"{a / d:.0%}" if d else "-"
        per = (s + a) / s if s else 0
        print(f"{p:<16} {m:<9} {med(m):>9.1f} {med(m) / base:>6.2f} {acc:>7} {per:>8.2f}")
PY
if [ $status -eq 0 ]; then echo "outputs: identical (text and logits files, every mode and round)"; else echo "outputs: DIFFER (OUT/differences.txt)"; fi
exit $status
