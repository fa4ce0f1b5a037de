#!/usr/bin/env bash
# Issue 17, PHASE_LOG B9: the few-pair experts kernels (kernels/tile.cu gate_up_few_bf16 and
# down_few, `--cuda-many few`) on the GPU machine, in two device calls of under 10 minutes:
#
#   PART=1 validation/gpu/few.sh BIN_DIR [OUT_DIR]   # exactness and speed
#   PART=2 validation/gpu/few.sh BIN_DIR [OUT_DIR]   # compute-sanitizer, where the time goes
#
# BIN_DIR as for prefill.sh (release tarfa-convert, examples/cuda_selftest, examples/cuda_bench).
# PART=1: the kernel checks (every expert kernel, the few-pair ones on tiles of 1 to 4 pairs and
#   rows of several load groups) and the CPU-vs-CUDA selftests of the repository's fixtures with
#   --many-kernels few; then cuda_bench --only-many on the 16-layer synthetic Qwen3-30B-A3B:
#   prefill of 64 and 128 tokens and batched decode at B = 1, 8, 32, 128 in the arms tiled, auto
#   and few (every arm's logits equal to the first's, every sequence equal to it alone).
# PART=2: compute-sanitizer's four tools on cuda_bench --many-kernels few over qwen3moe-a, then
#   ncu's per-kernel GPU time of batched decode and an 8-token step, auto against few
#   (validation/gpu/tools/ncu_steps.py prints each step's kernels).
# Decision rule (stated before the run): few becomes Auto's choice below 4 pairs per expert if
# every check and selftest is identical, the sanitizers are clean, and batched decode at B = 8
# and 32 is faster than auto by more than 2% with no B or prefill length slower by more than 2%.
set -u
BIN=${1:?usage: few.sh BIN_DIR [OUT_DIR]}
OUTD=${2:-${OUT:-./gpu-out}}
HERE=$(cd "$(dirname "$0")" && pwd)
case "${PART:-1}" in
1)
  PHASE=check,bench ARM=few NSYS=0 PREFILL=64,128 BATCH=1,8,32,128 ARMS=tiled,auto,few \
    BENCH_TIMEOUT=300 "$HERE/prefill.sh" "$BIN" "$OUTD/part1"
  ;;
2)
  PHASE=san ARM=few SAN_TIMEOUT=240 "$HERE/prefill.sh" "$BIN" "$OUTD/san"
  STEPS=ncu NCU_TIMEOUT=90 "$HERE/prefill-cli.sh" "$BIN" "$OUTD/ncu"
  for f in "$OUTD"/ncu/ncu-*.csv; do
    [ -f "$f" ] && python3 "$HERE/tools/ncu_steps.py" "$f" --top 6 | head -60
  done
  ;;
*) echo "PART must be 1 or 2" >&2; exit 2 ;;
esac
