#!/usr/bin/env bash
# One GPU call for issues 25 and 27 after their first runs (PHASE_LOG T1, D4):
#   1. mma.sh's verify alone, against the corrected model, every mismatch dumped
#      (MODEL, VERIFY_CASES, VERIFY_SECONDS as in mma.sh);
#   2. spec/gpu.sh PHASE=big BIG_BENCH=0: tarfa-ab off vs ngram:4 on the 16-layer synthetic
#      Qwen3-30B-A3B bundle and the peak RSS of a resident CUDA run (issue 17);
#   3. mma.sh's four compute-sanitizer tools on the verify and GEMM kernels.
#
#   validation/gpu/mma-spec-ab.sh BIN_DIR OUT_DIR
#
# BIN_DIR: release mma-check, tarfa-run, tarfa-convert, tarfa-ab. After each step OUT_DIR/r.tgz
# holds everything so far (a cut-off call still brings back the finished steps). Table last.
set -u
BIN=$(cd "${1:?usage: mma-spec-ab.sh BIN_DIR OUT_DIR}" && pwd) || exit 2
OUTD=${2:?usage: mma-spec-ab.sh BIN_DIR OUT_DIR}
mkdir -p "$OUTD" && OUTD=$(cd "$OUTD" && pwd) || exit 3
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
W=$(mktemp -d /tmp/t1d4.XXXX)
pack() { tar -C "$W" -czf "$OUTD/r.tgz.part" . && mv "$OUTD/r.tgz.part" "$OUTD/r.tgz"; }
SKIP_GEMM=1 SKIP_CPU=1 SANITIZE=0 VERIFY_CASES=${VERIFY_CASES:-500000000} VERIFY_SECONDS=${VERIFY_SECONDS:-45} \
  "$ROOT/validation/gpu/mma.sh" "$BIN" "$W/mma" > "$W/mma.log" 2>&1
pack
PHASE=big BIG_BENCH=0 AB_PAIRS=${AB_PAIRS:-3} AB_TIMEOUT=${AB_TIMEOUT:-200} "$ROOT/validation/spec/gpu.sh" "$BIN" "$W/spec" > "$W/spec.log" 2>&1
pack
SKIP_VERIFY=1 SKIP_GEMM=1 SKIP_CPU=1 "$ROOT/validation/gpu/mma.sh" "$BIN" "$W/san" > "$W/san.log" 2>&1
pack
cat "$W/mma/table.txt" "$W/spec/table.txt" "$W/san/table.txt" 2>/dev/null
