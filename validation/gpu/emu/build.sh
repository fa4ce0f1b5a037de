#!/usr/bin/env bash
# Builds the CPU emulator of kernels/*.cu: validation/gpu/emu/build.sh [OUT_DIR]
# -> OUT_DIR/libtarfa_emu.so (default /tmp/tarfa-emu). Then, e.g.:
#   TARFA_CUDA_EMU=/tmp/tarfa-emu/libtarfa_emu.so cargo test -p tarfa-run --lib cuda::mock
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
OUT=${1:-/tmp/tarfa-emu}
mkdir -p "$OUT/src"
python3 "$HERE/gen.py" "$OUT/src"
FLAGS="-std=c++20 -O2 -g -fPIC -ffp-contract=off -fno-fast-math -mfma -fno-strict-aliasing -fno-omit-frame-pointer -I$HERE -w"
objs=()
for f in "$OUT"/src/*.cpp "$HERE/runner.cpp"; do
  o="$OUT/$(basename "$f" .cpp).o"
  g++ $FLAGS -c "$f" -o "$o" &
  objs+=("$o")
done
wait
g++ -shared -o "$OUT/libtarfa_emu.so" "${objs[@]}" -lpthread
echo "$OUT/libtarfa_emu.so"
