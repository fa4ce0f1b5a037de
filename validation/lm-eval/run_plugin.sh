#!/usr/bin/env bash
# lm-eval with the Python package's in-process model (`--model tarfa`, python/tarfa/lm_eval.py),
# for real, through lm-eval's own bare command line (`lm_eval run --model tarfa ...`): the three
# tasks beside this file (tarfa_tiny_mc: loglikelihood; tarfa_tiny_gen: generate_until;
# tarfa_tiny_ppl: loglikelihood_rolling) on the demo model (the qwen3moe-code fixture converted
# with tarfa-convert), run twice, with max_batch=1 and 8; then compare.py checks that both runs'
# scores and every logged response are identical, and equal to `tarfa-run score` on the same
# requests (exit 1 otherwise).
#
# Not run by CI: lm-eval's import path needs datasets, pandas, pyarrow and lxml (about 500 MB of
# binary wheels; plugin-requirements.txt). Usage, from anywhere:
#   validation/lm-eval/run_plugin.sh [OUT_DIR]
# Environment:
#   LMEVAL_VENV  a virtual environment with lm-eval and the tarfa wheel (default /work/venv-lmeval):
#                python3 -m venv DIR && DIR/bin/pip install --no-deps -r validation/lm-eval/plugin-requirements.txt
#                DIR/bin/pip install ./python     (or python/README.md's faster dev wheel)
#   TARFA_BIN    the directory holding tarfa-run and tarfa-convert (default target/release,
#                else target/debug)
#
# Exit codes: 0 identical, 1 differences (compare.py), 3 a missing binary, venv or wheel.
#
# lm-eval (up to 0.4.13) finds models only by import (no plugin entry points): the bare `lm_eval`
# finds `tarfa` through the wheel's tarfa-lm-eval.pth (python/_tarfa_lm_eval_hook.py), which is
# why the package must be installed in the venv, not put on PYTHONPATH. The texts are tokenized
# by m.score with the bundle's own tokenizer, the way `tarfa-run score` tokenizes them.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
VENV=${LMEVAL_VENV:-/work/venv-lmeval}
OUT=${1:-$(mktemp -d /tmp/tarfa-lmeval-plugin.XXXXXX)}
if [[ -z "${TARFA_BIN:-}" ]]; then
    if [[ -x "$ROOT/target/release/tarfa-run" && -x "$ROOT/target/release/tarfa-convert" ]]; then
        TARFA_BIN=$ROOT/target/release
    else
        TARFA_BIN=$ROOT/target/debug
    fi
fi
for b in tarfa-run tarfa-convert; do
    [[ -x "$TARFA_BIN/$b" ]] || { echo "no $TARFA_BIN/$b: cargo build -p $b (or set TARFA_BIN)" >&2; exit 3; }
done
[[ -x "$VENV/bin/python" ]] && "$VENV/bin/python" -c 'import lm_eval.api.model' 2>/dev/null \
    || { echo "no lm-eval in $VENV (set LMEVAL_VENV; see plugin-requirements.txt)" >&2; exit 3; }
mkdir -p "$OUT"

"$VENV/bin/python" -c 'import tarfa._tarfa, _tarfa_lm_eval_hook' 2>/dev/null \
    || { echo "the tarfa wheel is not installed in $VENV: $VENV/bin/pip install ./python (python/README.md)" >&2; exit 3; }
[[ -x "$VENV/bin/lm_eval" ]] || { echo "no $VENV/bin/lm_eval" >&2; exit 3; }

BUNDLE=$OUT/qwen3moe-code
rm -rf "$BUNDLE"
"$TARFA_BIN/tarfa-convert" "$ROOT/fixtures/oracle/qwen3moe-code" "$BUNDLE" >/dev/null

cd "$ROOT"   # the task YAMLs name their JSONL relative to the repository root
for mb in 1 8; do
    rm -rf "$OUT/mb$mb"
    echo "== max_batch=$mb" >&2
    "$VENV/bin/lm_eval" run \
        --model tarfa --model_args "bundle=$BUNDLE,backend=cpu,max_batch=$mb" \
        --include_path validation/lm-eval --tasks tarfa_tiny_mc tarfa_tiny_gen tarfa_tiny_ppl \
        --log_samples --output_path "$OUT/mb$mb" 2>&1 | tee "$OUT/lmeval-mb$mb.log" >&2
done

python3 "$ROOT/validation/lm-eval/compare.py" --tarfa-run "$TARFA_BIN/tarfa-run" --bundle "$BUNDLE" \
    "$OUT/mb1" "$OUT/mb8"
