#!/usr/bin/env bash
# Builds the CPU emulator of kernels/*.cu: validation/gpu/emu/build.sh [OUT_DIR]
# -> OUT_DIR/libtarfa_emu.so (default /tmp/tarfa-emu). Then, e.g.:
#   TARFA_CUDA_EMU=/tmp/tarfa-emu/libtarfa_emu.so cargo test -p tarfa-cuda --lib mock::
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
OUT=${1:-/tmp/tarfa-emu}
mkdir -p "$OUT/src"
python3 "$HERE/gen.py" "$OUT/src"
FLAGS="-std=c++20 -O2 -g -fPIC -ffp-contract=off -fno-fast-math -mfma -fno-strict-aliasing -fno-omit-frame-pointer -I$HERE -w"
objs=()
pids=()
rm -f "$OUT"/*.o "$OUT/libtarfa_emu.so"  # never link an object left from an earlier build
for f in "$OUT"/src/*.cpp "$HERE/runner.cpp"; do
  o="$OUT/$(basename "$f" .cpp).o"
  g++ $FLAGS -c "$f" -o "$o" &
  pids+=($!)
  objs+=("$o")
done
failed=0
for pid in "${pids[@]}"; do wait "$pid" || failed=1; done
if [ "$failed" != 0 ]; then
  echo "emulator build failed (see the compiler messages above)" >&2
  exit 1
fi
g++ -shared -o "$OUT/libtarfa_emu.so" "${objs[@]}" -lpthread
echo "$OUT/libtarfa_emu.so"
