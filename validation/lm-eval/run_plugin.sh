#!/usr/bin/env bash
# lm-eval with the Python package's in-process model (`--model tarfa`, python/tarfa/lm_eval.py),
# for real: the two tasks beside this file (tarfa_tiny_mc: loglikelihood; tarfa_tiny_gen:
# generate_until) on the demo model (the qwen3moe-code fixture converted with tarfa-convert), run
# twice, with max_batch=1 and 8; then compare.py checks that both runs' scores and every logged
# response are identical, and equal to `tarfa-run score` on the same requests (exit 1 otherwise).
#
# Not run by CI: lm-eval's import path needs datasets, pandas, pyarrow and lxml (about 500 MB of
# binary wheels; plugin-requirements.txt). Usage, from anywhere:
#   validation/lm-eval/run_plugin.sh [OUT_DIR]
# Environment:
#   LMEVAL_VENV  a virtual environment with lm-eval (default /work/venv-lmeval):
#                python3 -m venv DIR && DIR/bin/pip install --no-deps -r validation/lm-eval/plugin-requirements.txt
#   TARFA_BIN    the directory holding tarfa-run and tarfa-convert (default target/release,
#                else target/debug)
#   TARFA_LIB    the package's native module (default: TARFA_BIN's deps/lib_tarfa.so or
#                lib_tarfa.so, as `cargo build -p tarfa-python` or `cargo test` leave it); it is
#                linked into a temporary copy of python/tarfa, as .ci/run does. Unused when the
#                venv already has the package (`pip install ./python`).
#
# lm-eval 0.4.13 finds models only by import (no plugin entry points), so lm-eval's command line
# runs as `python -m tarfa.lm_eval`, which registers `tarfa` first. The texts are tokenized by
# m.score with the bundle's own tokenizer, the way `tarfa-run score` tokenizes them.
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
    [[ -x "$TARFA_BIN/$b" ]] || { echo "no $TARFA_BIN/$b: cargo build -p $b (or set TARFA_BIN)" >&2; exit 2; }
done
[[ -x "$VENV/bin/python" ]] && "$VENV/bin/python" -c 'import lm_eval.api.model' 2>/dev/null \
    || { echo "no lm-eval in $VENV (set LMEVAL_VENV; see plugin-requirements.txt)" >&2; exit 2; }
mkdir -p "$OUT"

PYPATH=
if ! "$VENV/bin/python" -c 'import tarfa._tarfa' 2>/dev/null; then
    LIB=${TARFA_LIB:-}
    if [[ -z "$LIB" ]]; then
        for c in "$TARFA_BIN/deps/lib_tarfa.so" "$TARFA_BIN/lib_tarfa.so"; do
            [[ -e "$c" ]] && { LIB=$c; break; }
        done
    fi
    [[ -n "$LIB" && -e "$LIB" ]] || { echo "no lib_tarfa.so: cargo build -p tarfa-python (or set TARFA_LIB)" >&2; exit 2; }
    PYPATH=$OUT/py
    rm -rf "$PYPATH"
    mkdir -p "$PYPATH"
    cp -r "$ROOT/python/tarfa" "$PYPATH/tarfa"
    ln -s "$(cd "$(dirname "$LIB")" && pwd)/$(basename "$LIB")" "$PYPATH/tarfa/_tarfa.so"
fi

BUNDLE=$OUT/qwen3moe-code
rm -rf "$BUNDLE"
"$TARFA_BIN/tarfa-convert" "$ROOT/fixtures/oracle/qwen3moe-code" "$BUNDLE" >/dev/null

cd "$ROOT"   # the task YAMLs name their JSONL relative to the repository root
for mb in 1 8; do
    rm -rf "$OUT/mb$mb"
    echo "== max_batch=$mb" >&2
    PYTHONPATH=$PYPATH${PYTHONPATH:+:$PYTHONPATH} "$VENV/bin/python" -m tarfa.lm_eval run \
        --model tarfa --model_args "bundle=$BUNDLE,backend=cpu,max_batch=$mb" \
        --include_path validation/lm-eval --tasks tarfa_tiny_mc tarfa_tiny_gen \
        --log_samples --output_path "$OUT/mb$mb" 2>&1 | tee "$OUT/lmeval-mb$mb.log" >&2
done

python3 "$ROOT/validation/lm-eval/compare.py" --tarfa-run "$TARFA_BIN/tarfa-run" --bundle "$BUNDLE" \
    "$OUT/mb1" "$OUT/mb8"
