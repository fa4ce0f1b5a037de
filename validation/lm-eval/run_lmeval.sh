#!/usr/bin/env bash
# lm-eval's local-completions against `tarfa-run serve`, for real: the two tasks beside this file
# (tarfa_tiny_mc: loglikelihood; tarfa_tiny_gen: generate_until) on the demo model (the
# qwen3moe-code fixture converted with tarfa-convert), served twice, with --max-batch 1 and 8;
# then compare.py checks that both runs' scores and every logged response are identical, and
# equal to `tarfa-run score` on the same requests (exit 1 otherwise).
#
# Not run by CI (it needs lm-eval in a virtual environment). Usage, from anywhere:
#   validation/lm-eval/run_lmeval.sh [OUT_DIR]
# Environment: LMEVAL_VENV (default /work/venv-lmeval: `python3 -m venv DIR && DIR/bin/pip
# install "lm-eval[api]"`), TARFA_BIN (the directory holding tarfa-run and tarfa-convert;
# default target/release, else target/debug), NUM_CONCURRENT (default 8).
#
# lm-eval tokenizes with the server's own tokenizer (tokenizer_backend=remote: the server's
# /tokenizer_info, /tokenize, /detokenize), so the ids it sends are the bundle's tokenizer's, the
# ones `tarfa-run score` encodes the same texts to. (transformers' AutoTokenizer on the fixture
# rebuilds a Qwen2Tokenizer that splits these texts differently.)
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
VENV=${LMEVAL_VENV:-/work/venv-lmeval}
OUT=${1:-$(mktemp -d /tmp/tarfa-lmeval.XXXXXX)}
CONC=${NUM_CONCURRENT:-8}
if [[ -z "${TARFA_BIN:-}" ]]; then
    if [[ -x "$ROOT/target/release/tarfa-run" && -x "$ROOT/target/release/tarfa-convert" ]]; then
        TARFA_BIN=$ROOT/target/release
    else
        TARFA_BIN=$ROOT/target/debug
    fi
fi
for b in tarfa-run tarfa-convert; do
    [[ -x "$TARFA_BIN/$b" ]] || { echo "no $TARFA_BIN/$b: cargo build -p $b (or set TARFA_BIN)" >&2; exit 2; }
done
[[ -x "$VENV/bin/lm_eval" ]] || { echo "no lm_eval in $VENV (set LMEVAL_VENV)" >&2; exit 2; }
mkdir -p "$OUT"
BUNDLE=$OUT/qwen3moe-code
rm -rf "$BUNDLE"
"$TARFA_BIN/tarfa-convert" "$ROOT/fixtures/oracle/qwen3moe-code" "$BUNDLE" >/dev/null

SERVER=
stop_server() {
    if [[ -n "$SERVER" ]]; then
        kill -TERM "$SERVER" 2>/dev/null || true
        wait "$SERVER" || true
        SERVER=
    fi
}
trap stop_server EXIT

cd "$ROOT"   # the task YAMLs name their JSONL relative to the repository root
for mb in 1 8; do
    log=$OUT/serve-mb$mb.log
    "$TARFA_BIN/tarfa-run" serve "$BUNDLE" --backend cpu --port 0 --max-batch "$mb" --quiet 2>"$log" &
    SERVER=$!
    addr=
    for _ in $(seq 600); do
        addr=$(sed -n 's/^listening on http:\/\///p' "$log")
        [[ -n "$addr" ]] && break
        kill -0 "$SERVER" 2>/dev/null || { cat "$log" >&2; exit 3; }
        sleep 0.1
    done
    [[ -n "$addr" ]] || { echo "the server did not start" >&2; exit 3; }
    model=$(python3 -c 'import json,sys,urllib.request; print(json.load(urllib.request.urlopen(sys.argv[1]))["data"][0]["id"])' "http://$addr/v1/models")
    fetch() { python3 -c 'import sys,urllib.request; sys.stdout.write(urllib.request.urlopen(sys.argv[1]).read().decode())' "$1"; }
    fetch "http://$addr/tokenizer_info" >"$OUT/tokenizer_info-mb$mb.json"
    echo "== --max-batch $mb: $model at $addr" >&2
    "$VENV/bin/lm_eval" run --model local-completions --include_path validation/lm-eval \
        --tasks tarfa_tiny_mc tarfa_tiny_gen \
        --model_args "model=$model,base_url=http://$addr/v1/completions,tokenizer_backend=remote,num_concurrent=$CONC,max_retries=1" \
        --log_samples --output_path "$OUT/mb$mb" 2>&1 | tee "$OUT/lmeval-mb$mb.log" >&2
    fetch "http://$addr/metrics" >"$OUT/metrics-mb$mb.txt"
    stop_server
done

python3 "$ROOT/validation/lm-eval/compare.py" --tarfa-run "$TARFA_BIN/tarfa-run" --bundle "$BUNDLE" \
    --tokenizer-info "$OUT/tokenizer_info-mb1.json" "$OUT/mb1" "$OUT/mb8"
